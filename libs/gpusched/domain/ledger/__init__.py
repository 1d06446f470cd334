"""Capacity ledger: which GPU is free, allocated or lent to inference, and placement.

The ledger is the admission service's aggregate, and the pure core a simulator runs:
build one (``Ledger.from_inventory``, or ``Ledger.restore`` from stored rows), ask it
where a job goes (``place``), commit (``allocate``), end it (``release``), lend and
return shared GPUs (``reserve_for_inference``/``return_to_shared``), change MIG layouts,
and replay recorded events (``apply``). Nothing here does I/O or reads a clock.

The package, one seam per module:
- ``model``: job kinds, priority classes, a GPU's slot, an allocation (and the
  vocabulary: home pool, serving pool, lent).
- ``errors``: what a command refuses; a refused command changes nothing.
- ``events``: what commands decide and ``apply`` replays.
- ``requests``: what a job asks (``PlacementRequest``) and is proposed (``Placement``),
  and which free GPUs may form one gang.
- ``index``: the free-capacity indexes placement reads, kept in step with every change.
- ``state``: the state and its evolution by events, and the read-only queries.
- ``aggregate``: ``Ledger``, the commands (decide, then evolve) and ``apply``.
- ``packing``: whole GPUs (``pack``, and ``first_fit`` to measure it against).
- ``shares``: part of one GPU, a fraction or a MIG slice.

Host room: each node's CPU and memory left; an allocation holds ``cpu_per_gpu`` and
``memory_per_gpu`` on the node of each of its GPUs (0 when the request named none).
"""

from gpusched.domain.inventory import GpuRef

from .aggregate import Ledger
from .errors import (
    AllocationExists,
    GpuNotEligible,
    GpuNotFree,
    GpuNotReserved,
    InvalidRequest,
    LayoutChangeRefused,
    LedgerError,
    NodeBusy,
    UnknownAllocation,
    UnknownGpu,
    UnknownNode,
    UnknownReservation,
)
from .events import (
    AllocationGranted,
    AllocationReleased,
    GpusReserved,
    GpusReturned,
    LayoutApplied,
    LayoutChanged,
    LayoutFailed,
    LedgerEvent,
)
from .model import (
    Allocation,
    GpuSlot,
    GpuStatus,
    JobKind,
    NodeCondition,
    PoolCapacity,
    PriorityClass,
)
from .packing import first_fit, pack
from .requests import Placement, PlacementRequest, PlacementStrategy, default_pools

__all__ = [
    "Allocation",
    "AllocationExists",
    "AllocationGranted",
    "AllocationReleased",
    "GpuNotEligible",
    "GpuNotFree",
    "GpuNotReserved",
    "GpuRef",
    "GpuSlot",
    "GpuStatus",
    "GpusReserved",
    "GpusReturned",
    "InvalidRequest",
    "JobKind",
    "LayoutApplied",
    "LayoutChangeRefused",
    "LayoutChanged",
    "LayoutFailed",
    "Ledger",
    "LedgerError",
    "LedgerEvent",
    "NodeBusy",
    "NodeCondition",
    "Placement",
    "PlacementRequest",
    "PlacementStrategy",
    "PoolCapacity",
    "PriorityClass",
    "UnknownAllocation",
    "UnknownGpu",
    "UnknownNode",
    "UnknownReservation",
    "default_pools",
    "first_fit",
    "pack",
]
