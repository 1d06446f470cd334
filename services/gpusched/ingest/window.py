"""The telemetry window of one ingest replica, held in memory: pure, no I/O, no clock.

Ingest folds GPU samples as they stream in (docs/ingest.md). Per node it keeps the
samples of the last `window_s` seconds in time order with running sums per GPU, so
a GPU's mean over the window is one division and a sample costs a few additions,
however many nodes there are. What leaves the window is dropped at each flush; the
window is rebuilt from the stream after a restart, so nothing here needs to be stored.

Conventions (those of rollup.py, the snapshot's contract):
- A GPU's utilization is the mean of its samples whose time lies within the window
  ``(now - window_s, ...]``; samples stamped after ``now`` (a node clock slightly
  ahead) still count.
- A sample is identified by (node, time): a second sample of a node with the same
  time is a duplicate (a redelivery, a replayed publish) and is dropped, whatever it
  says. A sample older than the window when it arrives is late and dropped.
- Only GPUs the pool membership places in a pool count; a node the membership knows
  without pool GPUs (a failed node) keeps its samples, which count once it is back.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Added", "Membership", "Partial", "TelemetryWindow"]


class Added(StrEnum):
    """What became of one sample offered to the window."""

    ACCEPTED = "accepted"
    DUPLICATE = "duplicate"
    LATE = "late"


@dataclass(frozen=True, slots=True)
class Membership:
    """The pool membership a replica folds against, as admission's ledger says.

    `nodes`: every node of the inventory and its GPU count (failed nodes included);
    `serving`: per node with GPUs in a pool, the pool each GPU index serves now (None:
    that GPU is in no pool). `version` changes whenever the ledger changes it.
    """

    version: int
    nodes: Mapping[str, int]
    serving: Mapping[str, tuple[str | None, ...]]
    pools: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Partial:
    """One telemetry partition's share of a pool: the sum of its reporting GPUs' means
    and how many GPUs that is. Summed over partitions, it gives the pool's mean."""

    partition: int
    pool: str
    util_sum: float
    reporting: int


# One stored sample: time (epoch seconds), GPU indexes, their utilizations.
_Entry = tuple[float, tuple[int, ...], tuple[float, ...]]


@dataclass(slots=True)
class _Series:
    partition: int
    sums: list[float]
    counts: list[int]
    entries: deque[_Entry] = field(default_factory=deque)

    def add(self, entry: _Entry) -> None:
        _, indexes, utils = entry
        for i, u in zip(indexes, utils, strict=True):
            self.sums[i] += u
            self.counts[i] += 1

    def remove(self, entry: _Entry) -> None:
        _, indexes, utils = entry
        for i, u in zip(indexes, utils, strict=True):
            self.counts[i] -= 1
            # An empty GPU restarts at an exact 0, so float drift never accumulates.
            self.sums[i] = self.sums[i] - u if self.counts[i] else 0.0


class TelemetryWindow:
    """The samples of the last `window_s` seconds, per node, with running sums."""

    def __init__(self, window_s: float) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be positive, not {window_s}")
        self.window_s = window_s
        self._series: dict[str, _Series] = {}

    def __len__(self) -> int:
        """How many samples the window holds."""
        return sum(len(s.entries) for s in self._series.values())

    @property
    def nodes(self) -> int:
        return len(self._series)

    def node_names(self) -> set[str]:
        return set(self._series)

    def add(
        self,
        node: str,
        partition: int,
        gpus: int,
        time: float,
        readings: Sequence[tuple[int, float]],
        now: float,
    ) -> Added:
        """Fold one node sample in. The caller has checked it against the inventory:
        `gpus` is the node's GPU count and every index is below it."""
        if time <= now - self.window_s:
            return Added.LATE
        series = self._series.get(node)
        if series is None or len(series.counts) != gpus or series.partition != partition:
            # A new node, or one the inventory now gives another GPU count: start over.
            series = _Series(partition, [0.0] * gpus, [0] * gpus)
            self._series[node] = series
        entries = series.entries
        entry: _Entry = (
            time,
            tuple(index for index, _ in readings),
            tuple(util for _, util in readings),
        )
        if not entries or time > entries[-1][0]:
            entries.append(entry)  # the usual case: a node's samples come in time order
        else:
            at = bisect.bisect_left(entries, time, key=lambda e: e[0])
            if at < len(entries) and entries[at][0] == time:
                return Added.DUPLICATE
            entries.insert(at, entry)
        series.add(entry)
        return Added.ACCEPTED

    def gpu_means(self) -> Iterator[tuple[str, int, float]]:
        """(node, GPU index, mean utilization) of every GPU with samples in the window, as
        of the last `partials` (which expires what left it)."""
        for node, series in self._series.items():
            for index, count in enumerate(series.counts):
                if count:
                    yield node, index, min(1.0, max(0.0, series.sums[index] / count))

    def forget(self, node: str) -> None:
        """Drop a node's samples (the inventory no longer has it)."""
        self._series.pop(node, None)

    def partials(
        self, now: float, membership: Membership, partitions: Iterable[int]
    ) -> list[Partial]:
        """Expire what left the window, then each partition's share of each pool.

        Every (partition, pool) of `partitions` x the membership's pools is returned,
        zeros included, so a share that stopped reporting is overwritten, not kept."""
        horizon = now - self.window_s
        totals: dict[tuple[int, str], list[float]] = {
            (p, pool): [0.0, 0] for p in partitions for pool in membership.pools
        }
        emptied: list[str] = []
        for node, series in self._series.items():
            entries = series.entries
            while entries and entries[0][0] <= horizon:
                series.remove(entries.popleft())
            if not entries:
                emptied.append(node)
                continue
            serving = membership.serving.get(node)
            if serving is None:
                continue
            for index, count in enumerate(series.counts):
                if not count or index >= len(serving):
                    continue
                pool = serving[index]
                if pool is None:
                    continue
                total = totals.get((series.partition, pool))
                if total is None:
                    continue  # a partition another replica writes
                # min/max: a running sum of values in [0, 1] may drift a hair outside.
                total[0] += min(1.0, max(0.0, series.sums[index] / count))
                total[1] += 1
        for node in emptied:
            del self._series[node]
        return [
            Partial(partition=p, pool=pool, util_sum=total[0], reporting=int(total[1]))
            for (p, pool), total in sorted(totals.items())
        ]
