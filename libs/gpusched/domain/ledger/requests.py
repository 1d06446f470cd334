"""What a job asks of the ledger (``PlacementRequest``) and what placement proposes
(``Placement``), with the rules that say which free GPUs may form one gang."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.placement import per_gpu
from gpusched.domain.sharing import GpuShare, ShareAsk

from .errors import InvalidRequest
from .model import GpuSlot, JobKind

__all__ = [
    "GangKey",
    "Placement",
    "PlacementRequest",
    "PlacementStrategy",
    "default_pools",
    "eligible",
    "gangs",
    "host_per_gpu",
    "key_of",
    "tier",
]


def default_pools(kind: JobKind) -> tuple[Pool, ...]:
    # Inference reaches lent shared GPUs through their serving pool, INFERENCE.
    if kind is JobKind.INFERENCE:
        return (Pool.INFERENCE,)
    return (Pool.SHARED, Pool.TRAINING)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    job_id: str
    kind: JobKind
    # Whole GPUs (1 for a share of one GPU; 0 for a job of host CPU and memory alone).
    gpus: int
    model: str | None = None
    # Serving pools the job may use, most preferred first; empty: default_pools(kind).
    pools: tuple[Pool, ...] = ()
    # Host CPU (1/1000 core) and memory the whole job needs beside its GPUs.
    cpu_milli: int = 0
    memory_mib: int = 0
    # False for a workload that cannot cross nodes (one Kubernetes pod).
    may_span_nodes: bool = True
    # Nodes held for another job (a starving gang's reservation): not used here.
    exclude_nodes: frozenset[str] = frozenset()
    # Part of one GPU instead of whole GPUs (gpus must be 1).
    share: ShareAsk | None = None
    # The GPU models the job accepts, any one of them (a gang never mixes models), as a
    # trace's `V100M16|V100M32`; with ``model``, or neither for any model. Kept sorted;
    # ``model`` is set when exactly one is accepted.
    models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.gpus < 0:
            raise InvalidRequest(f"job {self.job_id}: a GPU count is not negative, got {self.gpus}")
        if self.share is not None and self.gpus != 1:
            raise InvalidRequest(f"job {self.job_id}: a share of a GPU is for one GPU")
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise InvalidRequest(f"job {self.job_id}: host CPU and memory must not be negative")
        accepted = tuple(sorted({*self.models, *([self.model] if self.model else [])}))
        if self.model is not None and self.models and self.model not in self.models:
            raise InvalidRequest(
                f"job {self.job_id}: model {self.model} is not among its models "
                f"{', '.join(self.models)}"
            )
        if self.gpus == 0:
            if not (self.cpu_milli or self.memory_mib):
                raise InvalidRequest(
                    f"job {self.job_id}: asks no GPU, no host CPU and no memory; a job without "
                    "GPUs needs cpu_milli or memory_mib"
                )
            if accepted:
                raise InvalidRequest(f"job {self.job_id}: a job without GPUs names no GPU model")
        object.__setattr__(self, "models", accepted)
        if len(accepted) == 1:
            object.__setattr__(self, "model", accepted[0])
        if not self.pools:
            object.__setattr__(self, "pools", default_pools(self.kind))
        if self.kind is JobKind.TRAINING and Pool.INFERENCE in self.pools:
            raise InvalidRequest(
                f"job {self.job_id}: training may not use the inference pool "
                "(inference is never preempted by training)"
            )

    def accepts(self, model: str) -> bool:
        """Whether a GPU of ``model`` may serve this request."""
        return not self.models or model in self.models


@dataclass(frozen=True, slots=True)
class Placement:
    request: PlacementRequest
    gpus: tuple[GpuRef, ...]
    model: str
    pool: Pool
    share: GpuShare | None = None
    # A MIG layout the GPU must be given first (``Ledger.change_layout``), or None.
    layout: tuple[str, ...] | None = None
    # The node of a placement without GPUs (host CPU and memory only).
    node: str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        if self.node is not None:
            return (self.node,)
        return tuple(dict.fromkeys(ref.node for ref in self.gpus))

    @property
    def spans_nodes(self) -> bool:
        """True when the gang crosses nodes; callers attach a placement warning."""
        return len(self.nodes) > 1


PlacementStrategy = Callable[
    [Mapping[str, Sequence[GpuSlot]], PlacementRequest], tuple[GpuRef, ...] | None
]
"""Picks the GPUs of a gang among eligible free GPUs grouped by node, or None.

The ledger has already filtered by status, serving pool and model, and validates
the answer, so a topology-aware strategy (NVLink island, NUMA) only has to rank.
"""


# (serving pool, home pool, model): GPUs that may share one gang.
GangKey = tuple[Pool, Pool, str]


def key_of(slot: GpuSlot) -> GangKey:
    return (slot.serving_pool, slot.pool, slot.model)


def gangs(slots: Sequence[GpuSlot]) -> dict[GangKey, list[GpuSlot]]:
    """A node's free GPUs grouped by gang key, each group in index order."""
    groups: dict[GangKey, list[GpuSlot]] = {}
    for slot in sorted(slots, key=lambda slot: slot.ref):
        groups.setdefault(key_of(slot), []).append(slot)
    return groups


def tier(key: GangKey, request: PlacementRequest) -> tuple[int, bool]:
    """Preference between gang keys, lowest first: the request's pool order, then a
    pool's own GPUs before lent ones."""
    serving, home, _ = key
    rank = request.pools.index(serving) if serving in request.pools else len(request.pools)
    return rank, serving is not home


def eligible(slot: GpuSlot, request: PlacementRequest) -> bool:
    return slot.placeable and slot.serving_pool in request.pools and request.accepts(slot.model)


def host_per_gpu(request: PlacementRequest) -> tuple[int, int]:
    """What the request holds on a node per GPU (a job without GPUs: all of it, on one)."""
    units = max(request.gpus, 1)
    return per_gpu(request.cpu_milli, units), per_gpu(request.memory_mib, units)
