"""The ledger's values: job kinds and priority classes, one GPU's slot, one allocation.

Vocabulary:
- home pool: the pool label a GPU has in the inventory (``GpuSlot.pool``).
- serving pool: INFERENCE while a shared GPU is lent to inference, else the home pool.
- lent: a shared GPU with ``reserved_for`` set. If it is free it is RESERVED_INFERENCE
  at once; if training holds it the reservation is pending and takes effect when that
  allocation is released, so no other training job can slip in between.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.sharing import GpuShare, mig_capable

__all__ = [
    "Allocation",
    "GpuSlot",
    "GpuStatus",
    "JobKind",
    "NodeCondition",
    "PoolCapacity",
    "PriorityClass",
]


class JobKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


class PriorityClass(StrEnum):
    INFERENCE = "inference"
    P0_URGENT = "p0-urgent"
    P1_NORMAL = "p1-normal"
    P2_OFFLINE = "p2-offline"

    @property
    def preemption_rank(self) -> int:
        """Eviction order: lower ranks are evicted first."""
        return _PREEMPTION_RANK[self]

    @property
    def preemptible(self) -> bool:
        """Whether the elastic pool may evict it to make room for inference."""
        return self in (PriorityClass.P1_NORMAL, PriorityClass.P2_OFFLINE)

    @property
    def kind(self) -> JobKind:
        return JobKind.INFERENCE if self is PriorityClass.INFERENCE else JobKind.TRAINING


_PREEMPTION_RANK: Mapping[PriorityClass, int] = {
    PriorityClass.P2_OFFLINE: 0,
    PriorityClass.P1_NORMAL: 1,
    PriorityClass.P0_URGENT: 2,
    PriorityClass.INFERENCE: 3,
}


class GpuStatus(StrEnum):
    FREE = "free"
    ALLOCATED = "allocated"
    RESERVED_INFERENCE = "reserved_inference"
    # Carries fractional tenants or a MIG layout: never placed as a whole GPU.
    SHARED = "shared"


class NodeCondition(StrEnum):
    """Why a node takes no new placements; a node without one is up."""

    # Operator's choice: what runs there runs to its end.
    DRAINED = "drained"
    # Its allocations were ended; its GPUs stay out until it recovers.
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class GpuSlot:
    ref: GpuRef
    model: str
    memory_mib: int
    pool: Pool
    status: GpuStatus = GpuStatus.FREE
    allocation_id: str | None = None
    reserved_for: str | None = None
    # MIG-capable: None follows the model's profile table; the inventory may override.
    mig: bool | None = None

    def __post_init__(self) -> None:
        # The statuses and their ids must agree, or counts and replays drift.
        consistent = {
            GpuStatus.FREE: self.allocation_id is None and self.reserved_for is None,
            # A shared GPU's tenants are in the ledger's sharing state; it may be lent
            # while its training fractions leave (inference's once the last has gone).
            GpuStatus.SHARED: self.allocation_id is None,
            GpuStatus.ALLOCATED: self.allocation_id is not None,
            GpuStatus.RESERVED_INFERENCE: (
                self.allocation_id is None and self.reserved_for is not None
            ),
        }[self.status]
        if not consistent:
            raise ValueError(
                f"inconsistent GPU {self.ref}: status={self.status} "
                f"allocation_id={self.allocation_id} reserved_for={self.reserved_for}"
            )

    @property
    def serving_pool(self) -> Pool:
        return Pool.INFERENCE if self.reserved_for is not None else self.pool

    @property
    def placeable(self) -> bool:
        """Free for a whole-GPU placement (a shared GPU is not)."""
        return self.status is GpuStatus.FREE or self.status is GpuStatus.RESERVED_INFERENCE

    @property
    def mig_enabled(self) -> bool:
        return mig_capable(self.model) if self.mig is None else self.mig


@dataclass(frozen=True, slots=True)
class Allocation:
    allocation_id: str
    job_id: str
    team: str
    kind: JobKind
    priority_class: PriorityClass
    gpus: tuple[GpuRef, ...]
    granted_at: datetime
    model: str
    # The serving pool at grant time: INFERENCE for an inference job on lent GPUs.
    pool: Pool
    # Host CPU and memory held on each GPU's node, per GPU (0: not accounted); without
    # GPUs, all of it on ``node``.
    cpu_per_gpu: int = 0
    memory_per_gpu: int = 0
    # Granted beyond the team's guaranteed quota: reclaimed first.
    borrowed: bool = False
    # Part of its one GPU (a fraction or a MIG slice); None: whole GPUs.
    share: GpuShare | None = None
    # Without GPUs (a job of host CPU and memory alone): the node it runs on.
    node: str | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        if self.node is not None:
            return (self.node,)
        return tuple(dict.fromkeys(ref.node for ref in self.gpus))

    def host_held(self) -> dict[str, tuple[int, int]]:
        """The host CPU and memory it holds on each of its nodes."""
        if self.node is not None:
            return {self.node: (self.cpu_per_gpu, self.memory_per_gpu)}
        per_node: dict[str, int] = {}
        for ref in self.gpus:
            per_node[ref.node] = per_node.get(ref.node, 0) + 1
        return {
            node: (count * self.cpu_per_gpu, count * self.memory_per_gpu)
            for node, count in per_node.items()
        }

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1


@dataclass(frozen=True, slots=True)
class PoolCapacity:
    """GPU counts of one home pool: ``total == allocated + reserved + free``."""

    pool: Pool
    total: int
    allocated: int
    reserved: int  # lent to inference and idle (RESERVED_INFERENCE)
    free: int
    lent: int  # every GPU with a reservation: idle, used by inference, or pending
