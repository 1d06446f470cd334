"""The ledger's events: what a command decided, and what ``Ledger.apply`` replays.

Each is a frozen value that carries everything its evolution needs, so a replica or a
projection that applies the same events in the same order holds the same ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.sharing import GpuShare

from .model import Allocation, JobKind, PriorityClass

__all__ = [
    "AllocationGranted",
    "AllocationReleased",
    "GpusReserved",
    "GpusReturned",
    "LayoutApplied",
    "LayoutChanged",
    "LayoutFailed",
    "LedgerEvent",
]


@dataclass(frozen=True, slots=True)
class AllocationGranted:
    allocation_id: str
    job_id: str
    team: str
    kind: JobKind
    priority_class: PriorityClass
    gpus: tuple[GpuRef, ...]
    granted_at: datetime
    model: str
    pool: Pool
    cpu_per_gpu: int = 0
    memory_per_gpu: int = 0
    borrowed: bool = False
    share: GpuShare | None = None
    node: str | None = None

    @classmethod
    def of(cls, allocation: Allocation) -> AllocationGranted:
        return cls(
            allocation.allocation_id,
            allocation.job_id,
            allocation.team,
            allocation.kind,
            allocation.priority_class,
            allocation.gpus,
            allocation.granted_at,
            allocation.model,
            allocation.pool,
            allocation.cpu_per_gpu,
            allocation.memory_per_gpu,
            allocation.borrowed,
            allocation.share,
            allocation.node,
        )

    @property
    def allocation(self) -> Allocation:
        return Allocation(
            self.allocation_id,
            self.job_id,
            self.team,
            self.kind,
            self.priority_class,
            self.gpus,
            self.granted_at,
            self.model,
            self.pool,
            self.cpu_per_gpu,
            self.memory_per_gpu,
            self.borrowed,
            self.share,
            self.node,
        )

    @property
    def spans_nodes(self) -> bool:
        return self.allocation.spans_nodes


@dataclass(frozen=True, slots=True)
class AllocationReleased:
    allocation_id: str
    job_id: str
    team: str
    kind: JobKind
    priority_class: PriorityClass
    gpus: tuple[GpuRef, ...]
    granted_at: datetime
    released_at: datetime
    model: str
    pool: Pool
    # GPUs that were lent to inference meanwhile: they go to RESERVED_INFERENCE, not FREE.
    kept_for_inference: tuple[GpuRef, ...] = ()


@dataclass(frozen=True, slots=True)
class GpusReserved:
    reservation_id: str
    gpus: tuple[GpuRef, ...]
    # Subset of gpus still allocated: the reservation takes effect on their release.
    pending: tuple[GpuRef, ...] = ()


@dataclass(frozen=True, slots=True)
class GpusReturned:
    reservation_ids: tuple[str, ...]
    gpus: tuple[GpuRef, ...]
    # Subset of gpus that were idle and are FREE shared GPUs now; the others stay
    # allocated (to their current job) until released, then become FREE.
    freed: tuple[GpuRef, ...] = ()


@dataclass(frozen=True, slots=True)
class LayoutChanged:
    """An empty MIG-capable GPU got a new MIG layout (empty: whole GPU again)."""

    gpu: GpuRef
    model: str
    before: tuple[str, ...]
    layout: tuple[str, ...]
    at: datetime


@dataclass(frozen=True, slots=True)
class LayoutApplied:
    """The cluster agent reported a new MIG layout applied: its slices may be used."""

    gpu: GpuRef
    layout: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LayoutFailed:
    """A layout change failed (the agent said so, or never answered): the GPU has its
    previous layout, as the agent still has it. Its change time stays: the attempt may
    have reset the GPU, so it counts against the once-per-interval limit."""

    gpu: GpuRef
    failed: tuple[str, ...]
    restored: tuple[str, ...]


LedgerEvent = (
    AllocationGranted
    | AllocationReleased
    | GpusReserved
    | GpusReturned
    | LayoutChanged
    | LayoutApplied
    | LayoutFailed
)
