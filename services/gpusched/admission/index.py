"""The queue held in memory (``QueueIndex``) and the order a pass takes it in (``FairOrder``).

The index holds each queued job as a row of plain values (``JobRecord.as_row``), not as
a record object: CPython's cyclic garbage collector walks every container object a
process holds on each full collection, and a tuple of plain values is not one of them.
So however deep the queue, the collector's pauses stay those of the rest of the
service; a ``JobRecord`` is made from its row when someone asks for the job.
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterator, Mapping, Sequence
from datetime import datetime

from gpusched.domain.ledger import Ledger, PriorityClass
from gpusched.domain.quota import dominant_shares

from .queue import Usage, placement_rank
from .store import JobRecord, JobRow

# Where a row keeps what the index sorts and files it by (see JobRecord.as_row).
_SUBMITTED, _JOB_ID, _TEAM, _PRIORITY_CLASS = range(4)


def _rank(row: JobRow) -> int:
    return placement_rank(PriorityClass(row[_PRIORITY_CLASS]))


def _submitted(row: JobRow) -> datetime:
    return row[_SUBMITTED]  # type: ignore[no-any-return]


class QueueIndex:
    """The queued jobs in memory, by placement rank and team, each team's line in
    submission order: loaded once, then kept up to date by the service (``put`` what
    was queued or changed, ``drop`` what left the queue), so a pass never re-reads the
    queue. Each operation is O(log n) to find its place in one team's line."""

    def __init__(self, jobs: Sequence[JobRecord] = ()) -> None:
        self._rows: dict[str, JobRow] = {}
        self._lines: dict[int, dict[str, list[JobRow]]] = {}
        for job in jobs:
            self.put(job)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._rows

    def get(self, job_id: str) -> JobRecord | None:
        row = self._rows.get(job_id)
        return None if row is None else JobRecord.from_row(row)

    def records(self) -> list[JobRecord]:
        return [JobRecord.from_row(row) for row in self._rows.values()]

    def put(self, job: JobRecord) -> None:
        """Add a queued job, or replace the version held of it."""
        self._put(job.as_row())

    def _put(self, row: JobRow) -> None:
        job_id = row[_JOB_ID]
        held = self._rows.get(job_id)
        if held is not None and held[:4] == row[:4]:
            # Same line, same place in it (the common case: a flag changed).
            line = self._lines[_rank(row)][row[_TEAM]]
            line[bisect.bisect_left(line, row[:2])] = row
            self._rows[job_id] = row
            return
        self.drop(job_id)
        self._rows[job_id] = row
        line = self._lines.setdefault(_rank(row), {}).setdefault(row[_TEAM], [])
        # Rows sort by submission time, then id (unique): the newest submit goes last.
        if not line or line[-1][:2] < row[:2]:
            line.append(row)
        else:
            bisect.insort(line, row)

    def audited(self, job_id: str) -> None:
        """The job's wait was audited (no-op if unknown)."""
        row = self._rows.get(job_id)
        if row is not None:
            self._put(JobRecord.audited_row(row))

    def drop(self, job_id: str) -> None:
        """Forget a job that left the queue (placed, cancelled, parked...); no-op if unknown."""
        row = self._rows.pop(job_id, None)
        if row is None:
            return
        rank = _rank(row)
        teams = self._lines[rank]
        line = teams[row[_TEAM]]
        at = bisect.bisect_left(line, row[:2])
        assert line[at][_JOB_ID] == job_id  # every job held is in its line
        del line[at]
        if not line:
            del teams[row[_TEAM]]
            if not teams:
                del self._lines[rank]

    def submitted_between(self, after: datetime, until: datetime) -> list[JobRecord]:
        """The jobs submitted in (after, until]: O(lines x log n)."""
        found: list[JobRecord] = []
        for teams in self._lines.values():
            for line in teams.values():
                start = bisect.bisect_right(line, after, key=_submitted)
                end = bisect.bisect_right(line, until, key=_submitted)
                found.extend(JobRecord.from_row(row) for row in line[start:end])
        return found

    def first_submitted_after(self, after: datetime) -> datetime | None:
        """The earliest submission time later than ``after``, or None."""
        first: datetime | None = None
        for teams in self._lines.values():
            for line in teams.values():
                at = bisect.bisect_right(line, after, key=_submitted)
                if at < len(line) and (first is None or _submitted(line[at]) < first):
                    first = _submitted(line[at])
        return first

    def lines(self) -> dict[int, dict[str, list[JobRecord]]]:
        """rank -> team -> that team's queued jobs, oldest first (made for the caller)."""
        return {
            rank: {team: [JobRecord.from_row(row) for row in line] for team, line in teams.items()}
            for rank, teams in self._lines.items()
        }

    def subset(self, job_ids: Collection[str]) -> QueueIndex:
        """A new index of these jobs (those held here)."""
        subset = QueueIndex()
        for job_id in job_ids:
            row = self._rows.get(job_id)
            if row is not None:
                subset._put(row)
        return subset


class FairOrder:
    """Jobs of a ``QueueIndex`` in the pass's order, lazily: ``charge`` what a placement
    takes, and the next pick sees the team's new dominant share."""

    def __init__(self, queue: QueueIndex, capacity: Mapping[str, int], usage: Usage) -> None:
        self._queue = queue
        self._capacity = capacity
        self.usage = usage
        self._shares: dict[str, float] | None = None
        # The usage the shares were computed from, as (entries, GPUs): a caller may
        # also change ``usage`` itself between picks.
        self._seen: tuple[int, int] = (-1, -1)

    @classmethod
    def of(cls, queue: QueueIndex, ledger: Ledger, usage: Usage) -> FairOrder:
        capacity: dict[str, int] = {}
        for slot in ledger.gpus:
            capacity[slot.model] = capacity.get(slot.model, 0) + 1
        return cls(queue, capacity, usage)

    def charge(self, team: str, model: str, gpus: int) -> None:
        key = (team, model)
        self.usage[key] = self.usage.get(key, 0) + gpus
        self._shares = None

    def _current_shares(self) -> dict[str, float]:
        seen = (len(self.usage), sum(self.usage.values()))
        if self._shares is None or seen != self._seen:
            self._shares = dominant_shares(self.usage, self._capacity)
            self._seen = seen
        return self._shares

    def __iter__(self) -> Iterator[JobRecord]:
        held = self._queue._lines
        for rank in sorted(held):
            # Positions in each team's line; the lines themselves are not changed.
            lines = {team: (line, 0) for team, line in held[rank].items()}
            while lines:
                if len(lines) == 1:
                    [(team, (line, at))] = lines.items()
                else:
                    shares = self._current_shares()
                    team = min(
                        lines,
                        key=lambda name: (
                            shares.get(name, 0.0),
                            *lines[name][0][lines[name][1]][:2],
                        ),
                    )
                    line, at = lines[team]
                yield JobRecord.from_row(line[at])
                if at + 1 < len(line):
                    lines[team] = (line, at + 1)
                else:
                    del lines[team]
