"""The ledger's cluster as the placement score reads it (``gpusched.domain.fragmentation``):
one table row per node, derived from the slots, the sharing state and the hosts, and
recomputed only for the nodes that changed since the last decision.

A GPU counts as free (1000 milli) when a training or inference pod of its home pool may
take it whole: FREE and not lent. A partly used fractional GPU counts what its tenants
left; any other GPU (allocated, lent, in MIG, on a node that is down) counts nothing.

Scores are kept per request shape: a node's score for a shape depends only on that
node's row and the workload's typical pods, so a decision recomputes the rows that
changed since the shape was last scored (usually one) and reads the others; a new mix
of typical pods starts every shape afresh. Model scarcity, which moves with every
placement anywhere, is added at the time of the decision.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from gpusched.domain.fragmentation import (
    UNLIMITED,
    WHOLE,
    Bools,
    Floats,
    Fragmentation,
    Ints,
    ModelDemand,
    NodeTable,
    PodType,
    PodTypes,
    ScoreWeights,
    model_pressure,
)
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.placement import HostRoom
from gpusched.domain.sharing import PodShape, SharedGpu

from .model import GpuSlot, GpuStatus

__all__ = ["Scores"]

# Request shapes whose node scores are kept (least recently used ones are dropped).
_SHAPES_KEPT = 256
# Beyond this share of the nodes changed, a shape's scores are recomputed whole.
_RECOMPUTE_ALL = 0.5
# Among GPUs of one node that score alike, the one with least compute left.
_TIGHTER = 1e-6
# Up to this many nodes to rescore, one by one.
_ONE_BY_ONE = 4


@dataclass(slots=True)
class _Kept:
    seen: Ints  # each row's version when last scored
    score: Floats  # per row: inf where the shape cannot go
    column: Ints  # per row, for a share: the GPU column it would take


class Scores:
    """Node table, fragmentation, kept scores and the weights of one ledger."""

    __slots__ = (
        "_dirty",
        "_frag",
        "_kept",
        "_mix",
        "_pools",
        "_version",
        "free_whole",
        "max_cpu",
        "max_gpu",
        "pool",
        "refs",
        "table",
        "weights",
    )

    def __init__(
        self,
        slots: Mapping[GpuRef, GpuSlot],
        hosts: Mapping[str, HostRoom],
        weights: ScoreWeights,
    ) -> None:
        self.weights = weights
        by_node: dict[str, list[GpuSlot]] = {}
        for slot in slots.values():
            by_node.setdefault(slot.ref.node, []).append(slot)
        names = sorted(by_node)
        self.table = NodeTable([(n, by_node[n][0].model, len(by_node[n])) for n in names])
        # Each GPU of a row, by column.
        self.refs: list[list[GpuRef]] = [sorted(s.ref for s in by_node[n]) for n in names]
        pools = sorted(Pool)
        self.pool: Ints = np.array([pools.index(by_node[n][0].pool) for n in names], np.int64)
        self.max_cpu = max((room.cpu_total for room in hosts.values()), default=0)
        self.max_gpu = max((len(refs) for refs in self.refs), default=1) * WHOLE
        # Per row, how many GPUs are free whole.
        self.free_whole: Ints = np.zeros(len(names), dtype=np.int64)
        self._pools: dict[tuple[Pool, ...], Bools] = {}
        self._dirty: set[int] = set(range(len(names)))
        self._version: Ints = np.zeros(len(names), dtype=np.int64)
        self._kept: OrderedDict[tuple[object, ...], _Kept] = OrderedDict()
        self._mix: tuple[tuple[PodShape, float], ...] | None = None
        self._frag: Fragmentation | None = None

    def pools_mask(self, pools: Sequence[Pool]) -> Bools:
        """The nodes of ``pools`` (a shared array: copy before changing it)."""
        key = tuple(pools)
        mask = self._pools.get(key)
        if mask is None:
            ordered = sorted(Pool)
            mask = np.isin(self.pool, [ordered.index(pool) for pool in pools])
            self._pools[key] = mask
        return mask

    def rows_of(self, names: Sequence[str] | frozenset[str]) -> list[int]:
        index = self.table.index
        return [index[name] for name in names if name in index]

    def usable(
        self,
        models: tuple[str, ...],
        cpu: int,
        memory: int,
        excluded: frozenset[str],
        pools: Sequence[Pool] | None = None,
    ) -> Bools:
        """The nodes with ``cpu`` and ``memory`` left, of a model in ``models`` (empty:
        any) and of ``pools`` (None: any), not ``excluded``: a new array."""
        table = self.table
        mask: Bools = table.access(models) & (table.cpu >= cpu) & (table.memory >= memory)
        if pools is not None:
            mask &= self.pools_mask(pools)
        mask[self.rows_of(excluded)] = False
        return mask

    def touch(self, node: str) -> None:
        row = self.table.index.get(node)
        if row is not None:
            self._dirty.add(row)

    def refresh(
        self,
        slots: Mapping[GpuRef, GpuSlot],
        shared: Mapping[GpuRef, SharedGpu],
        hosts: Mapping[str, HostRoom],
        down: Mapping[str, object],
        mix: tuple[tuple[PodShape, float], ...],
    ) -> Fragmentation:
        """The fragmentation, with the changed nodes' rows recomputed (and everything,
        when the workload's typical shapes changed)."""
        table = self.table
        for row in self._dirty:
            name = table.names[row]
            room = hosts.get(name)
            if room is None:
                table.set_host(row, UNLIMITED, UNLIMITED)
            else:
                table.set_host(row, room.cpu_free, room.memory_free)
            lefts = [0 if name in down else _left(slots[r], shared.get(r)) for r in self.refs[row]]
            table.left[row, : len(lefts)] = lefts
            self.free_whole[row] = lefts.count(WHOLE)
        if self._frag is None or mix is not self._mix:
            self._mix = mix
            types = PodTypes([(_pod_type(shape), weight) for shape, weight in mix])
            self._frag = Fragmentation(table, types)
            self._kept.clear()
        elif self._dirty:
            rows = sorted(self._dirty)
            self._frag.refresh(rows)
            self._version[rows] += 1
        self._dirty = set()
        return self._frag

    # --- scores per request shape -------------------------------------------------------

    def whole(self, frag: Fragmentation, gpus: int, cpu: int, memory: int) -> Floats:
        """Per node, the score of taking ``gpus`` free whole GPUs (0: host only) and
        that host room there, before scarcity; lower is better."""
        kept = self._kept_for(("whole", gpus, cpu, memory))

        def compute(rows: Ints) -> None:
            if len(rows) <= _ONE_BY_ONE:
                # A node or two changed since: plain Python beats numpy's per-call cost.
                kept.score[rows] = [
                    self._terms_one(
                        frag, row, frag.growth_whole_one(row, gpus, cpu, memory), gpus * WHOLE, cpu
                    )
                    for row in rows.tolist()
                ]
                return
            growth = frag.growth_whole(rows, gpus, cpu, memory)
            kept.score[rows] = self._terms(frag, rows, growth, gpus * WHOLE, cpu)

        return self._update(kept, compute).score

    def share(self, frag: Fragmentation, milli: int, cpu: int, memory: int) -> tuple[Floats, Ints]:
        """Per node, the score of taking ``milli`` of its best GPU for it, and that GPU's
        column (inf where no GPU has ``milli`` left), before scarcity."""
        kept = self._kept_for(("share", milli, cpu, memory))
        table = self.table

        def compute(rows: Ints) -> None:
            kept.score[rows] = np.inf
            at, cols = np.nonzero(table.left[rows] >= milli)
            if not len(at):
                return
            pairs = rows[at]
            lefts = table.left[pairs, cols]
            # A node's GPUs with the same compute left score alike, and the lowest column
            # wins their tie: score one of each (np.nonzero lists columns in order, and
            # np.unique keeps the first of each key). Most GPUs are whole or idle.
            _, one = np.unique(pairs * (WHOLE + 1) + lefts, return_index=True)
            pairs, lefts, cols = pairs[one], lefts[one], cols[one]
            growth = frag.growth_share(pairs, lefts, milli, cpu, memory)
            score = self._terms(frag, pairs, growth, milli, cpu) + _TIGHTER * lefts
            # Per node its best GPU: sorted by node, then score, the first of each node.
            order = np.lexsort((cols, score, pairs))
            first = order[np.r_[True, pairs[order][1:] != pairs[order][:-1]]]
            kept.score[pairs[first]] = score[first]
            kept.column[pairs[first]] = cols[first]

        kept = self._update(kept, compute)
        return kept.score, kept.column

    def share_columns(
        self, frag: Fragmentation, row: int, milli: int, cpu: int, memory: int
    ) -> list[int]:
        """The GPU columns of node ``row`` with ``milli`` left, best-scored first."""
        lefts = self.table.left[row]
        cols = np.flatnonzero(lefts >= milli)
        rows = np.full(len(cols), row, dtype=np.int64)
        growth = frag.growth_share(rows, lefts[cols], milli, cpu, memory)
        score = self._terms(frag, rows, growth, milli, cpu) + _TIGHTER * lefts[cols]
        return [int(cols[i]) for i in np.lexsort((cols, score))]

    def scarcity(self, frag: Fragmentation, demand: ModelDemand, gpu_milli: int) -> Floats | float:
        """Per node, the cost of taking ``gpu_milli`` of its model's compute (a constant
        while no recent request was constrained to some models)."""
        if not self.weights.scarcity or not gpu_milli or not demand.constrained:
            return 0.0
        pressure = model_pressure(self.table, demand.shares(), frag.free_by_model)
        cost: Floats = self.weights.scarcity * gpu_milli * pressure
        return cost

    def pressure_of(self, frag: Fragmentation, demand: ModelDemand) -> dict[str, float]:
        """Each GPU model's pressure over the cluster's average (1 everywhere while no
        recent request was constrained)."""
        table = self.table
        if not demand.constrained:
            return dict.fromkeys(table.model_names, 1.0)
        per_node = model_pressure(table, demand.shares(), frag.free_by_model)
        pairs = zip(table.model.tolist(), per_node.tolist(), strict=True)
        return {table.model_names[model]: pressure for model, pressure in pairs}

    def _kept_for(self, key: tuple[object, ...]) -> _Kept:
        kept = self._kept.get(key)
        if kept is None:
            size = len(self.table)
            kept = _Kept(
                np.full(size, -1, dtype=np.int64),
                np.full(size, np.inf),
                np.zeros(size, dtype=np.int64),
            )
            self._kept[key] = kept
            if len(self._kept) > _SHAPES_KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return kept

    def _update(self, kept: _Kept, compute: Callable[[Ints], None]) -> _Kept:
        changed = np.flatnonzero(kept.seen != self._version)
        if len(changed):
            if len(changed) > _RECOMPUTE_ALL * len(self.table):
                changed = np.arange(len(self.table))
            compute(changed)
            kept.seen[changed] = self._version[changed]
        return kept

    def _terms(
        self, frag: Fragmentation, rows: Ints, growth: Floats, gpu_milli: int, cpu: int
    ) -> Floats:
        """The growth of fragmentation plus how tightly taking ``gpu_milli`` and
        ``cpu`` packs each node and how it balances its CPU against its GPUs."""
        table, weights = self.table, self.weights
        gpu_after = frag.unallocated[rows] - gpu_milli
        host_cpu = table.cpu[rows]
        limited = host_cpu < UNLIMITED
        cpu_after = np.where(limited, host_cpu - cpu, 0)
        score: Floats = growth.astype(np.float64)
        if weights.fit and self.max_cpu:
            score += weights.fit * (0.5 * cpu_after / self.max_cpu + 0.5 * gpu_after / self.max_gpu)
        per_gpu = frag.types.cpu_per_gpu
        if weights.balance and per_gpu:
            cpu_before = np.where(limited, host_cpu, 0)
            before = np.abs(cpu_before / per_gpu - (gpu_after + gpu_milli) / WHOLE)
            after = np.abs(cpu_after / per_gpu - gpu_after / WHOLE)
            score += np.where(limited, weights.balance * WHOLE * (after - before), 0.0)
        return score

    def _terms_one(
        self, frag: Fragmentation, row: int, growth: float, gpu_milli: int, cpu: int
    ) -> float:
        """``_terms`` of one node in plain Python, the same operations in the same order
        (so the same number to the last bit)."""
        weights = self.weights
        gpu_after = int(frag.unallocated[row]) - gpu_milli
        host_cpu = int(self.table.cpu[row])
        limited = host_cpu < UNLIMITED
        cpu_after = host_cpu - cpu if limited else 0
        score = float(growth)
        if weights.fit and self.max_cpu:
            score += weights.fit * (0.5 * cpu_after / self.max_cpu + 0.5 * gpu_after / self.max_gpu)
        per_gpu = frag.types.cpu_per_gpu
        if weights.balance and per_gpu and limited:
            before = abs(host_cpu / per_gpu - (gpu_after + gpu_milli) / WHOLE)
            after = abs(cpu_after / per_gpu - gpu_after / WHOLE)
            score += weights.balance * WHOLE * (after - before)
        return score


def _left(slot: GpuSlot, shared: SharedGpu | None) -> int:
    if shared is not None:
        return 0 if shared.mig else WHOLE - shared.milli_used
    if slot.status is GpuStatus.FREE and slot.reserved_for is None:
        return WHOLE
    return 0


def _pod_type(shape: PodShape) -> PodType:
    return PodType(shape.gpus, shape.milli, shape.cpu_milli, shape.memory_mib, shape.models)
