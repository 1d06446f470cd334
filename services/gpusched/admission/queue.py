"""The job queue's vocabulary: job states, the order queued jobs are placed in, ids,
and the queue held in memory (``QueueIndex``) with its fair order (``FairOrder``)."""

from __future__ import annotations

import bisect
import uuid
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from gpusched.domain.ledger import Ledger, PriorityClass
from gpusched.domain.quota import dominant_shares

if TYPE_CHECKING:
    from .store import JobRecord


# Where the admission service reads the time: passed in, so tests and a replay choose it.
Clock = Callable[[], datetime]


class JobState(StrEnum):
    # Above its team's max priority class: waits for an operator's approval.
    HELD = "held"
    QUEUED = "queued"
    RUNNING = "running"
    # Evicted by a saga whose outcome (the checkpoint to resume from) has not arrived.
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"
    # Set aside by the scheduler for a reason of its own (an unreadable row, a placement
    # that raised): not placed until an operator approves it again or cancels it.
    PARKED = "parked"
    # An operator cancelled it while it ran: its workloads are being stopped.
    CANCELLING = "cancelling"
    # Ended by an operator (`gpusched cancel`).
    CANCELLED = "cancelled"


# A job in one of these states is over: it cannot be cancelled or retried.
FINISHED = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


# Inference first: it is never made to wait behind training (DESIGN §7).
_PLACEMENT_ORDER = (
    PriorityClass.INFERENCE,
    PriorityClass.P0_URGENT,
    PriorityClass.P1_NORMAL,
    PriorityClass.P2_OFFLINE,
)


def placement_rank(priority_class: PriorityClass) -> int:
    """Queued jobs are tried by this rank, then first in, first out."""
    return _PLACEMENT_ORDER.index(priority_class)


def new_job_id() -> str:
    # Hex only, so the id is safe as a subject token (`<p>.jobs.<job_id>.events`).
    return f"job-{uuid.uuid4().hex[:12]}"


def new_allocation_id() -> str:
    return f"alloc-{uuid.uuid4().hex[:12]}"


class EvictionOutcome(StrEnum):
    """How the eviction saga of an allocation ended, when it ended in an eviction."""

    COMPLETED = "completed"
    FORCED = "forced"


Usage = dict[tuple[str, str], int]
# What ``find`` depends on besides the ledger: kind and GPU request (and team, with quotas).
Shape = tuple[object, ...]


def shape_of(job: JobRecord) -> Shape:
    gpus, host = job.spec.gpus, job.spec.host
    return (
        job.spec.kind, gpus.count, gpus.accepted, gpus.memory_gib, gpus.milli,
        None if host is None else (host.cpu_milli, host.memory_mib),
    )  # fmt: skip


def _key(job: JobRecord) -> tuple[datetime, str]:
    return (job.submitted_at, job.job_id)


class QueueIndex:
    """The queued jobs in memory, by placement rank and team, each team's line in
    submission order: loaded once, then kept up to date by the service (``put`` what
    was queued or changed, ``drop`` what left the queue), so a pass never re-reads the
    queue. Each operation is O(log n) to find its place in one team's line."""

    def __init__(self, jobs: Sequence[JobRecord] = ()) -> None:
        self._jobs: dict[str, JobRecord] = {}
        self._lines: dict[int, dict[str, list[JobRecord]]] = {}
        for job in jobs:
            self.put(job)

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def get(self, job_id: str) -> JobRecord | None:
        return self._jobs.get(job_id)

    def records(self) -> list[JobRecord]:
        return list(self._jobs.values())

    def put(self, job: JobRecord) -> None:
        """Add a queued job, or replace the version held of it."""
        self.drop(job.job_id)
        self._jobs[job.job_id] = job
        line = self._lines.setdefault(placement_rank(job.priority_class), {}).setdefault(
            job.spec.team, []
        )
        if not line or _key(line[-1]) < _key(job):
            line.append(job)  # the common case: the newest submit goes last
        else:
            bisect.insort(line, job, key=_key)

    def drop(self, job_id: str) -> None:
        """Forget a job that left the queue (placed, cancelled, parked...); no-op if unknown."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return
        rank = placement_rank(job.priority_class)
        teams = self._lines[rank]
        line = teams[job.spec.team]
        at = bisect.bisect_left(line, _key(job), key=_key)
        assert line[at].job_id == job_id  # every job held is in its line
        del line[at]
        if not line:
            del teams[job.spec.team]
            if not teams:
                del self._lines[rank]

    def submitted_between(self, after: datetime, until: datetime) -> list[JobRecord]:
        """The jobs submitted in (after, until]: O(lines x log n)."""
        found: list[JobRecord] = []
        for teams in self._lines.values():
            for line in teams.values():
                start = bisect.bisect_right(line, after, key=lambda job: job.submitted_at)
                end = bisect.bisect_right(line, until, key=lambda job: job.submitted_at)
                found.extend(line[start:end])
        return found

    def first_submitted_after(self, after: datetime) -> datetime | None:
        """The earliest submission time later than ``after``, or None."""
        first: datetime | None = None
        for teams in self._lines.values():
            for line in teams.values():
                at = bisect.bisect_right(line, after, key=lambda job: job.submitted_at)
                if at < len(line) and (first is None or line[at].submitted_at < first):
                    first = line[at].submitted_at
        return first

    def lines(self) -> Mapping[int, Mapping[str, Sequence[JobRecord]]]:
        """rank -> team -> that team's queued jobs, oldest first."""
        return self._lines

    def subset(self, job_ids: Collection[str]) -> QueueIndex:
        """A new index of these jobs (those held here)."""
        return QueueIndex([job for job_id in job_ids if (job := self._jobs.get(job_id))])


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
        for rank in sorted(self._queue.lines()):
            # Positions in each team's line; the lines themselves are not changed.
            lines = {team: (line, 0) for team, line in self._queue.lines()[rank].items()}
            while lines:
                if len(lines) == 1:
                    [(team, (line, at))] = lines.items()
                else:
                    shares = self._current_shares()
                    team = min(
                        lines,
                        key=lambda name: (
                            shares.get(name, 0.0),
                            *_key(lines[name][0][lines[name][1]]),
                        ),
                    )
                    line, at = lines[team]
                yield line[at]
                if at + 1 < len(line):
                    lines[team] = (line, at + 1)
                else:
                    del lines[team]
