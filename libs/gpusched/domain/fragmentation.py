"""What a placement costs the cluster, over every node at once: FGD's fragmentation over
GPU, CPU and memory, how tightly it packs, how it balances CPU against GPUs, and how
scarce the GPU model it uses is. Pure: numpy arrays in, scores out; no I/O, no clock.

The cluster is a ``NodeTable``: per node, each GPU's compute left in milli (a free GPU
1000, a partly used fractional GPU what its tenants left, a GPU that cannot take a pod
0, -1 past the node's last GPU), its host CPU and memory left, its GPU model. The
workload is ``PodTypes``: the shapes of recent requests (GPUs, compute per GPU, CPU,
memory, acceptable models) with their probabilities.

Fragmentation (Weng et al., "Beware of Fragmentation", USENIX ATC'23): a node's
fragment for one pod type is all its unallocated GPU compute when that pod cannot run
there (its host lacks the pod's CPU or memory, fewer GPUs than it asks have its compute
left, or none is of a model it accepts), else the compute left on GPUs with less than
it asks. A node's fragmentation is the expectation over the types; a placement is
scored by how much it grows its node's (``Fragmentation.growth_*``).

Scarcity: the GPUs a constrained type may use are only those of its models. Each
type's expected demand spreads over its models in proportion to their unallocated
compute, so the pressure on a model is the demand that may land there over what it
has left (``model_pressure``). Taking a GPU of a model under more pressure than the
cluster's average costs in proportion: a pod that can run anywhere leaves the scarce
models to the pods that need them.
"""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "WHOLE",
    "Fragmentation",
    "ModelDemand",
    "NodeTable",
    "PodType",
    "PodTypes",
    "ScoreWeights",
    "model_pressure",
]

WHOLE = 1000
# Host room of a node whose CPU or memory the ledger does not limit.
UNLIMITED = 2**62
# Up to this many changed nodes are recomputed one by one, in plain Python.
_ONE_BY_ONE = 4

Ints = npt.NDArray[np.int64]
Floats = npt.NDArray[np.float64]
Bools = npt.NDArray[np.bool_]


@dataclass(frozen=True, slots=True)
class PodType:
    """One shape of pod: whole GPUs (``milli`` 1000) or a fraction of one, its host CPU
    and memory, the GPU models it accepts (empty: any)."""

    gpus: int
    milli: int
    cpu_milli: int
    memory_mib: int
    models: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ScoreWeights:
    """How the terms of a placement's score add up, in milli of GPU compute: the growth
    of fragmentation counts one for one; ``fit`` weighs what the node has left after it
    (half its CPU over the largest host's, half its GPU compute over the largest
    node's, so tight fits win among alike placements); ``balance`` the change in how
    far the node's CPU and GPUs are from the workload's CPU per GPU; ``scarcity`` the
    model's pressure over the average, per milli taken."""

    fit: float = 250.0
    balance: float = 1000.0
    scarcity: float = 1.0


class PodTypes:
    """Pod types as arrays over the types (``gpus``, ``milli``, ``cpu``, ``memory``,
    ``weight``), with their accepted models."""

    def __init__(self, types: Sequence[tuple[PodType, float]]) -> None:
        self.types = tuple(shape for shape, _ in types)
        self.gpus: Ints = np.array([t.gpus for t in self.types], dtype=np.int64)
        self.milli: Ints = np.array([t.milli for t in self.types], dtype=np.int64)
        self.cpu: Ints = np.array([t.cpu_milli for t in self.types], dtype=np.int64)
        self.memory: Ints = np.array([t.memory_mib for t in self.types], dtype=np.int64)
        weight = np.array([w for _, w in types], dtype=np.float64)
        self.weight: Floats = weight / weight.sum() if len(weight) else weight
        self.models = tuple(t.models for t in self.types)
        self.constrained = any(self.models)
        gpu_demand = float((self.weight * self.gpus * self.milli).sum())
        # The workload's CPU per GPU (milli CPU per 1000 milli of GPU compute).
        self.cpu_per_gpu = (
            float((self.weight * self.cpu).sum()) * WHOLE / gpu_demand if gpu_demand else 0.0
        )

    def __len__(self) -> int:
        return len(self.types)


class NodeTable:
    """Every node as placement sees it (see the module docstring), nodes in a fixed
    order (``index``)."""

    def __init__(self, nodes: Sequence[tuple[str, str, int]]) -> None:
        """``nodes``: (name, GPU model, GPU count); every GPU starts free and every host
        unlimited (``set_host``)."""
        width = max((gpus for _, _, gpus in nodes), default=1)
        self.names = [name for name, _, _ in nodes]
        self.index = {name: row for row, name in enumerate(self.names)}
        self.model_names = sorted({model for _, model, _ in nodes})
        self.model: Ints = np.array(
            [self.model_names.index(model) for _, model, _ in nodes], dtype=np.int64
        )
        self.left: Ints = np.full((len(nodes), width), -1, dtype=np.int64)
        for row, (_, _, gpus) in enumerate(nodes):
            self.left[row, :gpus] = WHOLE
        self.cpu: Ints = np.full(len(nodes), UNLIMITED, dtype=np.int64)
        self.memory: Ints = np.full(len(nodes), UNLIMITED, dtype=np.int64)
        self._access: dict[tuple[str, ...], Bools] = {}

    def __len__(self) -> int:
        return len(self.names)

    def set_host(self, row: int, cpu_milli: int, memory_mib: int) -> None:
        self.cpu[row] = cpu_milli
        self.memory[row] = memory_mib

    def access(self, models: tuple[str, ...]) -> Bools:
        """The nodes a pod accepting ``models`` (empty: any) may use."""
        found = self._access.get(models)
        if found is None:
            wanted = [row for row, name in enumerate(self.model_names) if name in models]
            found = np.isin(self.model, wanted) if models else np.ones(len(self), np.bool_)
            self._access[models] = found
        return found

    def unallocated(self) -> Ints:
        free: Ints = np.maximum(self.left, 0).sum(axis=1)
        return free


class ModelDemand:
    """The GPU compute recent requests asked, by the set of models they accept (empty:
    any): what model scarcity expects the next pods to want. Halved every
    ``halve_every`` observations so it follows a changing workload."""

    __slots__ = ("_by_models", "_halve_every", "_seen")

    def __init__(self, halve_every: int = 4096) -> None:
        self._by_models: dict[tuple[str, ...], float] = {}
        self._halve_every = halve_every
        self._seen = 0

    def observe(self, models: tuple[str, ...], gpu_milli: int) -> None:
        self._by_models[models] = self._by_models.get(models, 0.0) + gpu_milli
        self._seen += 1
        if self._seen % self._halve_every == 0:
            self._by_models = {m: d / 2 for m, d in self._by_models.items()}

    @property
    def constrained(self) -> bool:
        return any(models for models in self._by_models)

    def shares(self) -> tuple[tuple[tuple[str, ...], float], ...]:
        total = sum(self._by_models.values())
        if not total:
            return ()
        return tuple((models, demand / total) for models, demand in self._by_models.items())


@functools.lru_cache(maxsize=64)
def _accepts(model_names: tuple[str, ...], specs: tuple[tuple[str, ...], ...]) -> Floats:
    """1.0 where demand ``i`` (its accepted models; empty: any) may use model ``j``."""
    rows = [[float(not models or name in models) for name in model_names] for models in specs]
    return np.array(rows, dtype=np.float64).reshape(len(specs), len(model_names))


def model_pressure(
    table: NodeTable, demand: Sequence[tuple[tuple[str, ...], float]], free: Floats
) -> Floats:
    """Per node, the pressure on its GPU model over the cluster's average (see the
    module docstring): 1 everywhere while no demand is constrained. ``free``: the
    unallocated compute per model (``Fragmentation.free_by_model``)."""
    total_free = float(free.sum())
    if not total_free or not any(models for models, _ in demand):
        return np.ones(len(table), dtype=np.float64)
    accepts = _accepts(tuple(table.model_names), tuple(models for models, _ in demand))
    shares = np.fromiter((share for _, share in demand), dtype=np.float64, count=len(demand))
    # Each demand over the free compute of the models it may use (the cluster's, if
    # those have none left): the same pressure on each of them.
    pools = accepts @ free
    per_demand = shares / np.where(pools > 0, pools, max(total_free, 1.0))
    pressure: Floats = per_demand @ accepts
    # The average pressure: all demand over all free compute.
    by_model = pressure * total_free
    result: Floats = by_model[table.model]
    return result


class Fragmentation:
    """The fragmentation of every node of ``table`` for ``types``, kept per node: for
    each type, how many GPUs have its compute left (``count``) and the compute left on
    the others (``part``), refreshed for the nodes that change."""

    def __init__(self, table: NodeTable, types: PodTypes) -> None:
        self.table = table
        self.types = types
        self._milli = types.milli[:, None]
        self._gpus = types.gpus[:, None]
        self._cpu = types.cpu[:, None]
        self._memory = types.memory[:, None]
        self._weight = types.weight[:, None]
        # The types as plain numbers, for one node at a time.
        self._lists = list(
            zip(
                types.milli.tolist(), types.gpus.tolist(), types.cpu.tolist(),
                types.memory.tolist(), types.weight.tolist(), strict=True,
            )
        )  # fmt: skip
        self._access: Bools = (
            np.stack([table.access(models) for models in types.models])
            if len(types)
            else np.zeros((0, len(table)), np.bool_)
        )
        left = table.left[None, :, :]
        milli = types.milli[:, None, None]
        self.count: Ints = (left >= milli).sum(axis=2)
        self.part: Ints = np.where((left >= 0) & (left < milli), left, 0).sum(axis=2)
        self.unallocated: Ints = table.unallocated()
        # The unallocated compute per GPU model, kept with ``unallocated``.
        self.free_by_model: Floats = np.bincount(
            table.model, weights=self.unallocated, minlength=len(table.model_names)
        ).astype(np.float64)
        everyone = np.arange(len(table))
        self.value: Floats = self.after(
            everyone, self.count, self.part, self.unallocated, table.cpu, table.memory
        )

    def after(
        self, rows: Ints, count: Ints, part: Ints, unallocated: Ints, cpu: Ints, memory: Ints
    ) -> Floats:
        """The fragmentation of nodes ``rows`` were they in the given state (``count``
        and ``part`` over the types, then those nodes)."""
        fits = (
            self._access[:, rows]
            & (cpu >= self._cpu)
            & (memory >= self._memory)
            & (count >= self._gpus)
        )
        value: Floats = (self._weight * np.where(fits, part, unallocated)).sum(axis=0)
        return value

    def refresh(self, rows: Iterable[int]) -> None:
        """Recompute the nodes whose row of ``table`` changed."""
        changed = np.fromiter(rows, dtype=np.int64)
        if not len(changed):
            return
        if len(changed) <= _ONE_BY_ONE:
            for row in changed.tolist():
                self._refresh_one(row)
            return
        table = self.table
        left = table.left[changed][None, :, :]
        milli = self.types.milli[:, None, None]
        self.count[:, changed] = (left >= milli).sum(axis=2)
        self.part[:, changed] = np.where((left >= 0) & (left < milli), left, 0).sum(axis=2)
        before = self.unallocated[changed]
        self.unallocated[changed] = np.maximum(table.left[changed], 0).sum(axis=1)
        np.add.at(self.free_by_model, table.model[changed], self.unallocated[changed] - before)
        self.value[changed] = self.after(
            changed,
            self.count[:, changed],
            self.part[:, changed],
            self.unallocated[changed],
            table.cpu[changed],
            table.memory[changed],
        )

    def _refresh_one(self, row: int) -> None:
        """``refresh`` of one node in plain Python: a decision changes one or two nodes,
        and for so few numbers numpy's per-call cost is most of the work."""
        table = self.table
        lefts = sorted(left for left in table.left[row].tolist() if left >= 0)
        counts: list[int] = []
        parts: list[int] = []
        for milli, *_ in self._lists:
            below = bisect_left(lefts, milli)
            counts.append(len(lefts) - below)
            parts.append(sum(lefts[:below]))
        unallocated = sum(lefts)
        self.count[:, row] = counts
        self.part[:, row] = parts
        self.free_by_model[table.model[row]] += unallocated - int(self.unallocated[row])
        self.unallocated[row] = unallocated
        self.value[row] = self._expected(
            row, counts, parts, unallocated, int(table.cpu[row]), int(table.memory[row])
        )

    def growth_whole_one(self, row: int, gpus: int, cpu: int, memory: int) -> float:
        """``growth_whole`` of one node, in plain Python (see ``_refresh_one``)."""
        table = self.table
        after = self._expected(
            row,
            [count - gpus for count in self.count[:, row].tolist()],
            self.part[:, row].tolist(),
            int(self.unallocated[row]) - gpus * WHOLE,
            int(table.cpu[row]) - cpu,
            int(table.memory[row]) - memory,
        )
        return after - float(self.value[row])

    def _expected(
        self, row: int, counts: list[int], parts: list[int], unallocated: int, cpu: int,
        memory: int,
    ) -> float:  # fmt: skip
        """``after`` of one node, in plain Python."""
        value = 0.0
        access = self._access[:, row].tolist()
        for t, (_, gpus, pod_cpu, pod_memory, weight) in enumerate(self._lists):
            fits = access[t] and cpu >= pod_cpu and memory >= pod_memory and counts[t] >= gpus
            value += weight * (parts[t] if fits else unallocated)
        return value

    def growth_whole(self, rows: Ints, gpus: int, cpu: int, memory: int) -> Floats:
        """How much taking ``gpus`` free whole GPUs (0: host only) and that host room
        grows each node of ``rows``."""
        table = self.table
        after = self.after(
            rows,
            self.count[:, rows] - gpus,
            self.part[:, rows],
            self.unallocated[rows] - gpus * WHOLE,
            table.cpu[rows] - cpu,
            table.memory[rows] - memory,
        )
        return after - self.value[rows]

    def growth_share(self, rows: Ints, lefts: Ints, milli: int, cpu: int, memory: int) -> Floats:
        """How much taking ``milli`` from a GPU with ``lefts`` compute left, on each
        node of ``rows`` (pairs), grows that node."""
        table = self.table
        rest = lefts - milli
        types = self._milli
        count = self.count[:, rows] - (lefts >= types) + (rest >= types)
        part = (
            self.part[:, rows] - np.where(lefts < types, lefts, 0) + np.where(rest < types, rest, 0)
        )
        after = self.after(
            rows,
            count,
            part,
            self.unallocated[rows] - milli,
            table.cpu[rows] - cpu,
            table.memory[rows] - memory,
        )
        return after - self.value[rows]

    def total(self) -> float:
        return float(self.value.sum())
