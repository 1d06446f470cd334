"""Capacity ledger: which GPU is free, allocated or lent to inference, and placement.

The ledger is the admission service's aggregate. Each command method checks the
command against the current state (decide), builds a domain event, then applies it
(evolve); ``apply`` runs the same evolution for events read back from the database
or from the bus, so a replica or a projection rebuilds identical state. Nothing here
does I/O or reads a clock: times arrive as aware datetimes.

Vocabulary:
- home pool: the pool label a GPU has in the inventory (``GpuSlot.pool``).
- serving pool: INFERENCE while a shared GPU is lent to inference, else the home pool.
- lent: a shared GPU with ``reserved_for`` set. If it is free it is RESERVED_INFERENCE
  at once; if training holds it the reservation is pending and takes effect when that
  allocation is released, so no other training job can slip in between.
- host room: each node's CPU and memory left; an allocation holds ``cpu_per_gpu`` and
  ``memory_per_gpu`` on the node of each of its GPUs (0 when the request named none).

Placement (``pack``, the default) reads an index of free GPUs that every slot change
keeps in step (``_put``), so a decision costs a few candidate nodes, not a walk over
every GPU; ``pack`` lives in this module because it reads that index directly.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum
from itertools import islice
from types import MappingProxyType

from gpusched.domain.inventory import GpuRef, Inventory, NodeSpec, Pool
from gpusched.domain.placement import HostRoom, NodeFree, choose_in_node, per_gpu, stranded
from gpusched.domain.sharing import (
    WHOLE_GPU_MILLI,
    GpuShare,
    NodeRoom,
    PodShape,
    ShareAsk,
    SharedGpu,
    Tenant,
    WorkloadMix,
    can_change_layout,
    fill_layout,
    layout_valid,
    mig_capable,
    node_fragment,
)

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


# --- errors -------------------------------------------------------------------------


class LedgerError(Exception):
    """A command the ledger refuses; the state is left unchanged."""


class InvalidRequest(LedgerError, ValueError):
    pass


class UnknownAllocation(LedgerError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class UnknownGpu(LedgerError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class UnknownReservation(LedgerError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class AllocationExists(LedgerError):
    pass


class GpuNotFree(LedgerError):
    pass


class GpuNotEligible(LedgerError):
    """The GPU exists and may be free, but its pool or model does not fit the command."""


class GpuNotReserved(LedgerError):
    pass


class LayoutChangeRefused(LedgerError):
    """A MIG layout change within the interval since the GPU's last change."""


class UnknownNode(LedgerError, KeyError):
    def __str__(self) -> str:
        return str(self.args[0])


class NodeBusy(LedgerError):
    """The node still holds allocations or lent GPUs, so it cannot be removed."""


# --- state values -------------------------------------------------------------------


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
            # A shared GPU's tenants are in the ledger's sharing state, and it is never lent.
            GpuStatus.SHARED: self.allocation_id is None and self.reserved_for is None,
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
    # Host CPU and memory held on each GPU's node, per GPU (0: not accounted).
    cpu_per_gpu: int = 0
    memory_per_gpu: int = 0
    # Granted beyond the team's guaranteed quota: reclaimed first.
    borrowed: bool = False
    # Part of its one GPU (a fraction or a MIG slice); None: whole GPUs.
    share: GpuShare | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(ref.node for ref in self.gpus))

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


# --- placement --------------------------------------------------------------------


def default_pools(kind: JobKind) -> tuple[Pool, ...]:
    # Inference reaches lent shared GPUs through their serving pool, INFERENCE.
    if kind is JobKind.INFERENCE:
        return (Pool.INFERENCE,)
    return (Pool.SHARED, Pool.TRAINING)


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    job_id: str
    kind: JobKind
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

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise InvalidRequest(f"job {self.job_id}: needs at least 1 GPU, asked {self.gpus}")
        if self.share is not None and self.gpus != 1:
            raise InvalidRequest(f"job {self.job_id}: a share of a GPU is for one GPU")
        if self.cpu_milli < 0 or self.memory_mib < 0:
            raise InvalidRequest(f"job {self.job_id}: host CPU and memory must not be negative")
        if not self.pools:
            object.__setattr__(self, "pools", default_pools(self.kind))
        if self.kind is JobKind.TRAINING and Pool.INFERENCE in self.pools:
            raise InvalidRequest(
                f"job {self.job_id}: training may not use the inference pool "
                "(inference is never preempted by training)"
            )


@dataclass(frozen=True, slots=True)
class Placement:
    request: PlacementRequest
    gpus: tuple[GpuRef, ...]
    model: str
    pool: Pool
    share: GpuShare | None = None
    # A MIG layout the GPU must be given first (``Ledger.change_layout``), or None.
    layout: tuple[str, ...] | None = None

    @property
    def nodes(self) -> tuple[str, ...]:
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


def first_fit(
    free_by_node: Mapping[str, Sequence[GpuSlot]], request: PlacementRequest
) -> tuple[GpuRef, ...] | None:
    """Whole GPUs: the first node in name order that fits the gang, else span nodes.

    A gang never mixes GPU models, serving pools, or own and lent GPUs: a mixed-model
    gang runs at the slowest GPU's pace, and a gang partly on lent or shared GPUs could
    only be partly given back or evicted. Preference between such groups: the order of
    ``request.pools``, then a pool's own GPUs before lent ones (which keeps lent GPUs
    idle and easy to return). One node in a less preferred group still beats spanning
    nodes in a preferred one, since crossing nodes costs every training step.
    """
    wanted = request.gpus
    nodes = sorted(free_by_node)
    groups = {node: _gangs(free_by_node[node]) for node in nodes}
    tiers = sorted({_tier(key, request) for by_key in groups.values() for key in by_key})
    for tier in tiers:
        for node in nodes:
            for key, group in groups[node].items():
                if _tier(key, request) == tier and len(group) >= wanted:
                    return tuple(slot.ref for slot in group[:wanted])
    if not request.may_span_nodes:
        return None
    # All-or-nothing: partial gathers are discarded unless one reaches the full count.
    for tier in tiers:
        gathered: dict[_GangKey, list[GpuRef]] = {}
        for node in nodes:
            for key, group in groups[node].items():
                if _tier(key, request) != tier:
                    continue
                refs = gathered.setdefault(key, [])
                refs.extend(slot.ref for slot in group[: wanted - len(refs)])
                if len(refs) == wanted:
                    return tuple(refs)
    return None


# (serving pool, home pool, model): GPUs that may share one gang.
_GangKey = tuple[Pool, Pool, str]


def _gangs(slots: Sequence[GpuSlot]) -> dict[_GangKey, list[GpuSlot]]:
    groups: dict[_GangKey, list[GpuSlot]] = {}
    for slot in sorted(slots, key=lambda slot: slot.ref):
        groups.setdefault((slot.serving_pool, slot.pool, slot.model), []).append(slot)
    return groups


def _tier(key: _GangKey, request: PlacementRequest) -> tuple[int, bool]:
    serving, home, _ = key
    rank = request.pools.index(serving) if serving in request.pools else len(request.pools)
    return rank, serving is not home


def _eligible(slot: GpuSlot, request: PlacementRequest) -> bool:
    return (
        slot.placeable
        and slot.serving_pool in request.pools
        and (request.model is None or slot.model == request.model)
    )


# --- events -----------------------------------------------------------------------


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


# --- the aggregate ----------------------------------------------------------------


class Ledger:
    """GPU slots and live allocations of one cluster. Mutable; see the module docstring."""

    __slots__ = (
        "_allocations",
        "_buckets",
        "_by_cpu",
        "_by_left",
        "_down",
        "_fraction_nodes",
        "_free",
        "_groups",
        "_hosts",
        "_layout_at",
        "_layout_before",
        "_lefts",
        "_mix",
        "_node_gpus",
        "_node_lefts",
        "_shapes",
        "_shared",
        "_slots",
    )

    def __init__(
        self,
        gpus: Iterable[GpuSlot],
        hosts: Mapping[str, tuple[int, int]] | None = None,
        groups: Mapping[str, tuple[tuple[int, ...], ...]] | None = None,
    ) -> None:
        """An idle ledger over ``gpus``; live state comes back through ``restore``/``apply``.

        ``hosts`` gives each node's (cpu_milli, memory_mib) so placement also respects
        host CPU and memory; a node missing from it is not limited. ``groups`` gives a
        node's NVLink islands / NUMA GPU groups.
        """
        # Sorted once here so every query and strategy sees name order, then index.
        ordered = sorted(gpus, key=lambda slot: slot.ref)
        self._slots: dict[GpuRef, GpuSlot] = {slot.ref: slot for slot in ordered}
        if len(self._slots) != len(ordered):
            raise InvalidRequest("a GPU is listed twice")
        # Statuses without their allocations would break every count; start clean.
        busy = [str(slot.ref) for slot in ordered if slot.status is not GpuStatus.FREE]
        if busy:
            raise InvalidRequest(f"a new ledger starts with free GPUs only: {', '.join(busy)}")
        self._allocations: dict[str, Allocation] = {}
        self._hosts: dict[str, HostRoom] = {
            node: HostRoom(cpu, memory, cpu, memory)
            for node, (cpu, memory) in (hosts or {}).items()
        }
        self._groups: dict[str, tuple[tuple[int, ...], ...]] = dict(groups or {})
        self._node_gpus: dict[str, int] = {}
        for slot in ordered:
            self._node_gpus[slot.ref.node] = self._node_gpus.get(slot.ref.node, 0) + 1
        # A node's shape is its host size: placement fills small hosts before large
        # ones, which keeps large hosts for the jobs that need their CPU and memory.
        self._shapes: dict[str, _Shape] = {
            node: (room.cpu_total, room.memory_total) if (room := self._hosts.get(node)) else (0, 0)
            for node in self._node_gpus
        }
        # The placement index, kept in step with every slot change so a decision looks
        # only at nodes that can take the gang: per gang key, each node's free GPUs, and
        # the nodes bucketed by how many GPUs of that key they have free, then by shape.
        self._free: dict[_GangKey, dict[str, dict[int, GpuSlot]]] = {}
        self._buckets: dict[_GangKey, dict[int, dict[_Shape, dict[str, None]]]] = {}
        # Drained and failed nodes: their GPUs stay in the slots (and counts) but out
        # of the placement index, so no decision ever sees them.
        self._down: dict[str, NodeCondition] = {}
        # GPU sharing: the GPUs with tenants or a MIG layout, the time of each GPU's
        # last layout change, and the fractional ones by compute left, per (pool, model).
        self._shared: dict[GpuRef, SharedGpu] = {}
        self._layout_at: dict[GpuRef, datetime] = {}
        # While a layout change is pending: the layout the agent still has (it is the
        # GPU's layout again if the change fails).
        self._layout_before: dict[GpuRef, tuple[str, ...]] = {}
        self._by_left: dict[tuple[Pool, str], dict[int, dict[GpuRef, None]]] = {}
        # The compute-left values present in _by_left, sorted, for a bisect to the
        # tightest fit.
        self._lefts: dict[tuple[Pool, str], list[int]] = {}
        # Per node, the compute left on each of its partly used fractional GPUs, and the
        # shapes of recent requests: what the fragmentation score of a fraction reads.
        self._node_lefts: dict[str, dict[GpuRef, int]] = {}
        # The nodes in _node_lefts with a host, by host CPU left: (cpu_free, node), sorted.
        self._by_cpu: list[tuple[int, str]] = []
        self._mix = WorkloadMix()
        # The last few nodes a fraction landed on, oldest first.
        self._fraction_nodes: dict[str, None] = {}
        for slot in ordered:
            self._index_add(slot)

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Ledger:
        return cls(
            (
                GpuSlot(gpu.ref, gpu.model, gpu.memory_mib, node.pool, mig=node.mig)
                for node in inventory.nodes
                for gpu in node.gpus
            ),
            hosts={node.name: (node.cpu_milli, node.memory_mib) for node in inventory.nodes},
            groups={node.name: node.gpu_groups for node in inventory.nodes if node.gpu_groups},
        )

    @classmethod
    def restore(
        cls,
        inventory: Inventory,
        allocations: Iterable[Allocation],
        reservations: Mapping[GpuRef, str],
        conditions: Mapping[str, NodeCondition] | None = None,
        layouts: Mapping[GpuRef, tuple[tuple[str, ...], datetime | None]] | None = None,
        pending_layouts: Collection[GpuRef] = (),
        layouts_before: Mapping[GpuRef, tuple[str, ...]] | None = None,
    ) -> Ledger:
        """Rebuild from stored rows: live allocations, the GPU -> reservation map, and
        the nodes that are drained or failed."""
        ledger = cls.from_inventory(inventory)
        for node, condition in (conditions or {}).items():
            ledger.set_condition(node, condition)
        # MIG layouts before allocations: their tenants' slices must exist.
        for ref, (layout, changed_at) in (layouts or {}).items():
            if layout and changed_at is not None:
                before = (layouts_before or {}).get(ref, ())
                model = ledger.gpu(ref).model
                ledger.apply(LayoutChanged(ref, model, before, layout, changed_at))
                if ref not in pending_layouts:
                    ledger.apply(LayoutApplied(ref, layout))
            elif changed_at is not None:
                ledger._layout_at[ref] = changed_at
        # Allocations first, so a reservation on an allocated GPU comes back pending.
        for allocation in allocations:
            ledger.apply(AllocationGranted.of(allocation))
        by_reservation: dict[str, list[GpuRef]] = {}
        for ref, reservation_id in reservations.items():
            by_reservation.setdefault(reservation_id, []).append(ref)
        for reservation_id, refs in sorted(by_reservation.items()):
            ordered = tuple(sorted(refs))
            ledger.apply(GpusReserved(reservation_id, ordered, ledger._allocated(ordered)))
        return ledger

    # --- queries ---

    @property
    def gpus(self) -> tuple[GpuSlot, ...]:
        return tuple(self._slots.values())

    @property
    def allocations(self) -> Mapping[str, Allocation]:
        return MappingProxyType(self._allocations)

    def gpu(self, ref: GpuRef) -> GpuSlot:
        try:
            return self._slots[ref]
        except KeyError:
            raise UnknownGpu(f"unknown GPU {ref}") from None

    def allocation(self, allocation_id: str) -> Allocation:
        try:
            return self._allocations[allocation_id]
        except KeyError:
            raise UnknownAllocation(f"unknown allocation {allocation_id!r}") from None

    def free_gpus(self, pool: Pool) -> tuple[GpuRef, ...]:
        """Placeable GPUs whose serving pool is ``pool`` (lent idle GPUs count as INFERENCE)."""
        return tuple(
            slot.ref
            for slot in self._slots.values()
            if self._indexed(slot) and slot.serving_pool is pool
        )

    def free_counts(self) -> dict[Pool, int]:
        return {pool: len(self.free_gpus(pool)) for pool in Pool}

    def capacity(self) -> dict[Pool, PoolCapacity]:
        """Counts per home pool, every Pool present (zeros where the inventory has none)."""
        counts = {pool: dict.fromkeys(GpuStatus, 0) for pool in Pool}
        lent = dict.fromkeys(Pool, 0)
        for slot in self._slots.values():
            counts[slot.pool][slot.status] += 1
            if slot.reserved_for is not None:
                lent[slot.pool] += 1
        return {
            pool: PoolCapacity(
                pool=pool,
                total=sum(by_status.values()),
                allocated=by_status[GpuStatus.ALLOCATED] + by_status[GpuStatus.SHARED],
                reserved=by_status[GpuStatus.RESERVED_INFERENCE],
                free=by_status[GpuStatus.FREE],
                lent=lent[pool],
            )
            for pool, by_status in counts.items()
        }

    def allocations_on(self, refs: Iterable[GpuRef]) -> tuple[Allocation, ...]:
        """Distinct allocations holding any of ``refs``, in order of first mention."""
        found: dict[str, Allocation] = {}
        for ref in refs:
            allocation_id = self.gpu(ref).allocation_id
            if allocation_id is not None:
                found.setdefault(allocation_id, self._allocations[allocation_id])
            if (shared := self._shared.get(ref)) is not None:
                for tenant in shared.tenants:
                    found.setdefault(tenant.allocation_id, self._allocations[tenant.allocation_id])
        return tuple(found.values())

    def reservation(self, reservation_id: str) -> tuple[GpuRef, ...]:
        return tuple(
            slot.ref for slot in self._slots.values() if slot.reserved_for == reservation_id
        )

    def lent_gpus(self) -> tuple[GpuRef, ...]:
        return tuple(slot.ref for slot in self._slots.values() if slot.reserved_for is not None)

    def host_room(self, node: str) -> HostRoom | None:
        """The node's CPU and memory left, or None when the ledger does not limit them."""
        return self._hosts.get(node)

    def nodes_free(self) -> tuple[NodeFree, ...]:
        """Placeable GPUs per node (every serving pool), in name order."""
        free = dict.fromkeys(self._node_gpus, 0)
        for by_node in self._free.values():
            for node, slots in by_node.items():
                free[node] += len(slots)
        return tuple(NodeFree(node, free[node], self._node_gpus[node]) for node in sorted(free))

    def stranded_gpus(self) -> int:
        """Free GPUs whose node has no CPU or memory left to feed them."""
        return sum(
            stranded(node.free, self._hosts.get(node.node), node.total)
            for node in self.nodes_free()
        )

    # --- commands (decide, then evolve) ---

    def place(
        self, request: PlacementRequest, strategy: PlacementStrategy | None = None
    ) -> Placement | None:
        """Find GPUs for ``request`` without changing the GPUs; ``allocate`` commits.
        The request's shape is remembered (``WorkloadMix``) for placing fractions.

        Without a strategy: ``pack`` (see there) on the ledger's index. A strategy
        function sees every eligible free GPU, trimmed per node to what the node's host
        CPU and memory can feed.
        """
        if request.share is None or not request.share.mig:
            milli = WHOLE_GPU_MILLI if request.share is None else request.share.milli
            assert milli is not None  # not a MIG ask
            self._mix.observe(PodShape(request.gpus, milli, request.cpu_milli, request.memory_mib))
        if request.share is not None:
            return self._place_share(request, request.share)
        if strategy is None:
            chosen = pack(self, request)
        else:
            chosen = strategy(self._candidates(request), request)
        if chosen is None:
            return None
        return self._check_placement(request, chosen)

    def _candidates(self, request: PlacementRequest) -> dict[str, list[GpuSlot]]:
        cpu, memory = _host_per_gpu(request)
        candidates: dict[str, list[GpuSlot]] = {}
        for slot in self._slots.values():
            if (
                _eligible(slot, request)
                and slot.ref.node not in request.exclude_nodes
                and slot.ref.node not in self._down
            ):
                candidates.setdefault(slot.ref.node, []).append(slot)
        if cpu or memory:
            for node, slots in list(candidates.items()):
                fed = self._host_feeds(node, cpu, memory, len(slots))
                if fed:
                    candidates[node] = slots[:fed]
                else:
                    del candidates[node]
        return candidates

    def _host_feeds(self, node: str, cpu_per_gpu: int, memory_per_gpu: int, upto: int) -> int:
        """How many GPUs (at most ``upto``) the node's host room can feed."""
        room = self._hosts.get(node)
        if room is None:
            return upto
        fed = upto
        if cpu_per_gpu:
            fed = min(fed, room.cpu_free // cpu_per_gpu)
        if memory_per_gpu:
            fed = min(fed, room.memory_free // memory_per_gpu)
        return max(fed, 0)

    def allocate(
        self,
        allocation_id: str,
        placement: Placement,
        team: str,
        priority_class: PriorityClass,
        now: datetime,
        *,
        borrowed: bool = False,
    ) -> AllocationGranted:
        _require_aware(now)
        if allocation_id in self._allocations:
            raise AllocationExists(f"allocation {allocation_id!r} already exists")
        request = placement.request
        if priority_class.kind is not request.kind:
            raise InvalidRequest(
                f"job {request.job_id}: priority class {priority_class} is for "
                f"{priority_class.kind} jobs, not {request.kind}"
            )
        # Re-checked here: the ledger may have changed since place() proposed it.
        if placement.share is not None:
            checked = self._check_share(placement)
        else:
            checked = self._check_placement(request, placement.gpus)
        cpu, memory = _host_per_gpu(request)
        event = AllocationGranted(
            allocation_id=allocation_id,
            job_id=request.job_id,
            team=team,
            kind=request.kind,
            priority_class=priority_class,
            gpus=checked.gpus,
            granted_at=now,
            model=checked.model,
            pool=checked.pool,
            cpu_per_gpu=cpu,
            memory_per_gpu=memory,
            borrowed=borrowed,
            share=checked.share,
        )
        self._evolve(event)
        return event

    def release(self, allocation_id: str, now: datetime) -> AllocationReleased:
        _require_aware(now)
        allocation = self.allocation(allocation_id)
        if now < allocation.granted_at:
            raise InvalidRequest(
                f"allocation {allocation_id!r} cannot be released at {now.isoformat()}, "
                f"before it was granted at {allocation.granted_at.isoformat()}"
            )
        event = AllocationReleased(
            allocation_id=allocation.allocation_id,
            job_id=allocation.job_id,
            team=allocation.team,
            kind=allocation.kind,
            priority_class=allocation.priority_class,
            gpus=allocation.gpus,
            granted_at=allocation.granted_at,
            released_at=now,
            model=allocation.model,
            pool=allocation.pool,
            kept_for_inference=tuple(
                ref for ref in allocation.gpus if self._slots[ref].reserved_for is not None
            ),
        )
        self._evolve(event)
        return event

    def reserve_for_inference(self, reservation_id: str, gpus: Sequence[GpuRef]) -> GpusReserved:
        """Lend shared GPUs to inference: free ones at once, allocated ones on release.

        Idempotent per GPU: a GPU already reserved under the same id is left out of
        the event, so a controller may add victims to a reservation it already made.
        """
        if not reservation_id:
            raise InvalidRequest("reservation id must be non-empty")
        if not gpus:
            raise InvalidRequest(f"reservation {reservation_id!r}: no GPUs given")
        new: list[GpuRef] = []
        for ref in dict.fromkeys(gpus):
            slot = self.gpu(ref)
            self._check_lendable(slot)
            if slot.reserved_for == reservation_id:
                continue
            if slot.reserved_for is not None:
                raise GpuNotFree(f"GPU {ref} is already reserved for {slot.reserved_for!r}")
            new.append(ref)
        ordered = tuple(sorted(new))
        event = GpusReserved(reservation_id, ordered, self._allocated(ordered))
        self._evolve(event)
        return event

    def return_to_shared(
        self,
        *,
        reservation_id: str | None = None,
        gpus: Sequence[GpuRef] | None = None,
    ) -> GpusReturned:
        """Lift reservations, by reservation id or by GPU (exactly one of the two)."""
        if (reservation_id is None) == (gpus is None):
            raise InvalidRequest("give exactly one of reservation_id or gpus")
        if reservation_id is not None:
            refs = self.reservation(reservation_id)
            if not refs:
                raise UnknownReservation(f"no GPUs are reserved for {reservation_id!r}")
        else:
            assert gpus is not None  # narrowed by the exactly-one check above
            if not gpus:
                raise InvalidRequest("no GPUs given to return")
            refs = tuple(sorted(dict.fromkeys(gpus)))
            for ref in refs:
                if self.gpu(ref).reserved_for is None:
                    raise GpuNotReserved(f"GPU {ref} is not reserved for inference")
        slots = [self._slots[ref] for ref in refs]
        event = GpusReturned(
            reservation_ids=tuple(
                sorted({slot.reserved_for for slot in slots if slot.reserved_for is not None})
            ),
            gpus=refs,
            freed=tuple(slot.ref for slot in slots if slot.status is GpuStatus.RESERVED_INFERENCE),
        )
        self._evolve(event)
        return event

    # --- nodes: added, drained, failed, recovered, removed ---

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted(self._node_gpus))

    def node_condition(self, node: str) -> NodeCondition | None:
        """DRAINED or FAILED, or None for a node that takes placements."""
        self._require_node(node)
        return self._down.get(node)

    def node_gpus(self, node: str) -> tuple[GpuRef, ...]:
        self._require_node(node)
        return tuple(ref for ref in self._slots if ref.node == node)

    def allocations_on_node(self, node: str) -> tuple[Allocation, ...]:
        return self.allocations_on(self.node_gpus(node))

    def add_node(self, node: NodeSpec) -> tuple[GpuRef, ...]:
        """A new node, up and idle; its GPUs join the placeable set at once."""
        if node.name in self._node_gpus:
            raise InvalidRequest(f"node {node.name!r} already exists")
        added = [GpuSlot(gpu.ref, gpu.model, gpu.memory_mib, node.pool) for gpu in node.gpus]
        self._hosts[node.name] = HostRoom(
            node.cpu_milli, node.memory_mib, node.cpu_milli, node.memory_mib
        )
        if node.gpu_groups:
            self._groups[node.name] = node.gpu_groups
        self._node_gpus[node.name] = len(added)
        self._shapes[node.name] = (node.cpu_milli, node.memory_mib)
        # Every query walks the slots in (node, index) order, as after __init__.
        self._slots = dict(sorted([*self._slots.items(), *((slot.ref, slot) for slot in added)]))
        for slot in added:
            self._index_add(slot)
        return tuple(slot.ref for slot in added)

    def set_condition(self, node: str, condition: NodeCondition | None) -> None:
        """Drain or fail a node (None: back up). Running allocations of a drained node
        stay; a node is failed only once its allocations are released."""
        refs = self.node_gpus(node)
        if condition is NodeCondition.FAILED and (held := self.allocations_on(refs)):
            raise NodeBusy(
                f"node {node} still holds allocation(s) "
                f"{', '.join(a.allocation_id for a in held)}: release them before failing it"
            )
        slots = [self._slots[ref] for ref in refs]
        for slot in slots:
            if self._indexed(slot):
                self._index_remove(slot)
        if condition is None:
            self._down.pop(node, None)
        else:
            self._down[node] = condition
        for slot in slots:
            if self._indexed(slot):
                self._index_add(slot)

    def remove_node(self, node: str) -> tuple[GpuRef, ...]:
        """Take an empty node out of the ledger; refuses one with allocations or lent GPUs."""
        refs = self.node_gpus(node)
        held = self.allocations_on(refs)
        lent = [ref for ref in refs if self._slots[ref].reserved_for is not None]
        if held or lent:
            what = [f"allocation {a.allocation_id}" for a in held]
            if lent:
                what.append(f"{len(lent)} GPU(s) lent to inference")
            raise NodeBusy(
                f"node {node} is not empty ({', '.join(what)}): drain it and wait for them "
                "to end, or fail it"
            )
        for ref in refs:
            slot = self._slots.pop(ref)
            if slot.placeable and node not in self._down:
                self._index_remove(slot)
        del self._node_gpus[node]
        del self._shapes[node]
        self._hosts.pop(node, None)
        self._groups.pop(node, None)
        self._down.pop(node, None)
        return refs

    def _require_node(self, node: str) -> None:
        if node not in self._node_gpus:
            raise UnknownNode(f"unknown node {node!r}")

    # --- GPU sharing: fractions and MIG slices (rules in gpusched.domain.sharing) ---

    @property
    def shared(self) -> Mapping[GpuRef, SharedGpu]:
        """GPUs in sharing: with fractional tenants or a MIG layout."""
        return MappingProxyType(self._shared)

    def layout_of(self, ref: GpuRef) -> tuple[str, ...]:
        shared = self._shared.get(ref)
        return () if shared is None else shared.layout

    def layout_changed_at(self, ref: GpuRef) -> datetime | None:
        return self._layout_at.get(ref)

    def layout_pending(self, ref: GpuRef) -> bool:
        """A new layout the cluster agent has not reported applied."""
        shared = self._shared.get(ref)
        return shared is not None and shared.pending

    def apply_layout(self, ref: GpuRef, layout: Sequence[str]) -> LayoutApplied | None:
        """The agent applied ``layout``: its slices may be used (None: already were)."""
        event = LayoutApplied(ref, tuple(layout))
        if not self.layout_pending(ref) and event.layout == self.layout_of(ref):
            return None
        self.apply(event)
        return event

    def layout_before(self, ref: GpuRef) -> tuple[str, ...]:
        """The layout the agent still has while a change of ``ref`` is pending."""
        return self._layout_before.get(ref, ())

    def fail_layout(self, ref: GpuRef) -> LayoutFailed:
        """The pending layout of ``ref`` was not applied: back to the layout the agent
        still has, usable at once; the change time is kept."""
        event = LayoutFailed(ref, self.layout_of(ref), self.layout_before(ref))
        self.apply(event)
        return event

    def change_layout(
        self, ref: GpuRef, layout: Sequence[str], now: datetime, interval: timedelta
    ) -> LayoutChanged:
        """Give an empty MIG-capable GPU a new layout, at most once per ``interval``."""
        _require_aware(now)
        wanted = tuple(layout)
        self._require_layout_change(ref, wanted)
        changed_at = self._layout_at.get(ref)
        if not can_change_layout(changed_at, now, interval):
            assert changed_at is not None  # a GPU never changed may always change
            raise LayoutChangeRefused(
                f"GPU {ref} changed its MIG layout at {changed_at.isoformat()}; the next "
                f"change is allowed from {(changed_at + interval).isoformat()}"
            )
        event = LayoutChanged(ref, self.gpu(ref).model, self.layout_of(ref), wanted, now)
        self._evolve(event)
        return event

    def _require_layout_change(self, ref: GpuRef, layout: tuple[str, ...]) -> None:
        slot = self.gpu(ref)
        if not slot.mig_enabled:
            raise GpuNotEligible(f"GPU {ref} ({slot.model}) is not MIG-capable")
        if layout and not layout_valid(slot.model, layout):
            raise InvalidRequest(
                f"MIG layout {'+'.join(layout)} is not valid on {slot.model} (known profiles, "
                "at most 7 compute and 8 memory slices)"
            )
        shared = self._shared.get(ref)
        busy = slot.status is GpuStatus.ALLOCATED or (shared is not None and not shared.empty)
        if busy or slot.reserved_for is not None:
            raise GpuNotFree(f"GPU {ref} is in use; a layout change resets the GPU")
        if layout == self.layout_of(ref):
            raise InvalidRequest(f"GPU {ref} already has MIG layout {'+'.join(layout) or 'none'}")

    def _share_eligible(self, slot: GpuSlot, request: PlacementRequest) -> bool:
        cpu, memory = _host_per_gpu(request)
        node = slot.ref.node
        return (
            slot.reserved_for is None
            and slot.status is not GpuStatus.ALLOCATED
            and slot.pool in request.pools
            and (request.model is None or slot.model == request.model)
            and node not in request.exclude_nodes
            and node not in self._down
            and self._host_feeds(node, cpu, memory, 1) == 1
        )

    def _place_share(self, request: PlacementRequest, ask: ShareAsk) -> Placement | None:
        return self._place_slice(request, ask) if ask.mig else self._place_fraction(request, ask)

    def _place_fraction(self, request: PlacementRequest, ask: ShareAsk) -> Placement | None:
        """FGD-style (Weng et al., ATC'23) on a small candidate set, so a decision stays
        well under a millisecond: the tightest partly used GPUs that fit, the partly used
        GPUs on the hosts with least CPU left (``_starved_partials``), and free GPUs
        (``_fresh_for_fraction``). The winner is the one whose node's fragmentation
        (``node_fragment`` over the recent workload mix) grows least; ties go to the
        tightest fit, so whole GPUs stay whole. Pools in the request's order: a later
        pool only when nothing fits in an earlier one."""
        training = request.kind is JobKind.TRAINING
        assert ask.milli is not None  # a fraction
        for pool in request.pools:
            # (slot, share, compute left on it now; None for a free whole GPU)
            candidates: list[tuple[GpuSlot, GpuShare, int | None]] = []
            keys = [
                key
                for key in self._by_left
                if key[0] is pool and (request.model is None or key[1] == request.model)
            ]
            # Bounded like pack: past _SCAN_LIMIT GPUs examined (shared GPUs whose hosts
            # are full, say) other candidates are the better use of the decision's time.
            examined = 0
            for group in self._tightest_shared(keys, ask.milli):
                taken = 0
                for ref in group:
                    examined += 1
                    slot = self._slots[ref]
                    share = ask.fraction_for(slot.memory_mib)
                    shared = self._shared[ref]
                    if self._share_eligible(slot, request) and shared.fits_fraction(
                        share, training, ask.overcommit
                    ):
                        candidates.append((slot, share, WHOLE_GPU_MILLI - shared.milli_used))
                        taken += 1
                    if taken >= _PER_LEFT or examined >= _SCAN_LIMIT:
                        break
                if examined >= _SCAN_LIMIT or len(candidates) >= _FRACTION_CANDIDATES:
                    break
            seen = {slot.ref for slot, _, _ in candidates}
            for ref in self._starved_partials(request, ask.milli):
                slot = self._slots[ref]
                if ref not in seen and slot.pool is pool:
                    share = ask.fraction_for(slot.memory_mib)
                    shared = self._shared[ref]
                    if self._share_eligible(slot, request) and shared.fits_fraction(
                        share, training, ask.overcommit
                    ):
                        candidates.append((slot, share, WHOLE_GPU_MILLI - shared.milli_used))
            for slot in self._fresh_for_fraction(request, pool, candidates):
                share = ask.fraction_for(slot.memory_mib)
                if self._share_eligible(slot, request) and SharedGpu(slot.memory_mib).fits_fraction(
                    share, training, ask.overcommit
                ):
                    candidates.append((slot, share, None))
            if candidates:
                break
        else:
            return None
        mix = self._mix.typical()

        def rank(candidate: tuple[GpuSlot, GpuShare, int | None]) -> tuple[float, int, GpuRef]:
            slot, _, left = candidate
            growth = self._fragment_growth(slot, left, request, mix) if len(candidates) > 1 else 0
            return (growth, WHOLE_GPU_MILLI if left is None else left, slot.ref)

        slot, share, _ = min(candidates, key=rank)
        return Placement(request, (slot.ref,), slot.model, slot.pool, share)

    def _starved_partials(self, request: PlacementRequest, milli: int) -> Iterator[GpuRef]:
        """On the nodes with partly used GPUs whose host has the least CPU left that still
        feeds the request, the tightest GPU that holds ``milli``. A fraction there costs
        the least: what those hosts have left is already too little for larger pods."""
        start = bisect_left(self._by_cpu, (request.cpu_milli, ""))
        found = 0
        for _, node in islice(self._by_cpu, start, start + _STARVED_SCAN):
            room = self._hosts[node]
            if room.memory_free < request.memory_mib or node in request.exclude_nodes:
                continue
            fits = [(left, ref) for ref, left in self._node_lefts[node].items() if left >= milli]
            if fits:
                yield min(fits)[1]
                found += 1
                if found >= _FRACTION_CANDIDATES // 2:
                    return

    def _fresh_for_fraction(
        self,
        request: PlacementRequest,
        pool: Pool,
        partials: Sequence[tuple[GpuSlot, GpuShare, int | None]],
    ) -> list[GpuSlot]:
        """Free GPUs of ``pool`` a fraction may start sharing: one per node among the
        partials' nodes, the nodes that took fractions last (so fractions gather on few
        nodes, as first fit's do), an empty node, and ``pack``'s choice."""
        keys = [
            key
            for key in self._free
            if key[0] is pool and (request.model is None or key[2] == request.model)
        ]
        nodes = dict.fromkeys(slot.ref.node for slot, _, _ in partials)
        nodes.update(dict.fromkeys(reversed(self._fraction_nodes)))
        fresh: list[GpuSlot] = []
        for key in keys:
            by_node = self._free[key]
            for node in nodes:
                free = by_node.get(node)
                if free and node not in request.exclude_nodes:
                    fresh.append(free[min(free)])
            # One node of each (free GPUs, host size) class: the index's buckets.
            for by_shape in self._buckets.get(key, {}).values():
                for shaped in by_shape.values():
                    for node in shaped:
                        if node not in request.exclude_nodes:
                            free = by_node[node]
                            fresh.append(free[min(free)])
                            break
        chosen = pack(self, replace(request, share=None, pools=(pool,)))
        if chosen is not None:
            fresh.append(self._slots[chosen[0]])
        return list({slot.ref: slot for slot in fresh}.values())

    def _fragment_growth(
        self,
        slot: GpuSlot,
        left: int | None,
        request: PlacementRequest,
        mix: Sequence[tuple[PodShape, float]],
    ) -> float:
        """How much the fraction would grow its node's expected fragment, in milli."""
        node = slot.ref.node
        host = self._hosts.get(node)
        room = NodeRoom(
            len(self._free.get(_key_of(slot), {}).get(node, ())),
            tuple(self._node_lefts.get(node, {}).values()),
            None if host is None else host.cpu_free,
            None if host is None else host.memory_free,
        )
        assert request.share is not None and request.share.milli is not None  # a fraction
        after = room.taking(left, request.share.milli, request.cpu_milli, request.memory_mib)
        return node_fragment(after, mix) - node_fragment(room, mix)

    def _tightest_shared(
        self, keys: Sequence[tuple[Pool, str]], milli: int
    ) -> Iterator[Iterator[GpuRef]]:
        """Fractional GPUs with at least ``milli`` compute left, grouped by compute left,
        least left first."""
        lefts = sorted(
            {
                left
                for key in keys
                for left in self._lefts[key][bisect_left(self._lefts[key], milli) :]
            }
        )
        for left in lefts:
            yield (ref for key in keys for ref in self._by_left[key].get(left, ()))

    def _place_slice(self, request: PlacementRequest, ask: ShareAsk) -> Placement | None:
        """A free slice of the smallest profile that holds the memory, on the GPU with the
        fewest free slices; else an empty MIG-capable GPU gets a layout with that profile
        (one already in MIG first, then a free GPU on the fullest node)."""
        best: tuple[tuple[int, GpuRef], GpuSlot, GpuShare] | None = None
        awaited = False
        for ref, shared in self._shared.items():
            slot = self._slots.get(ref)
            if slot is None or not shared.mig or not self._share_eligible(slot, request):
                continue
            profile = ask.slice_profile(slot.model)
            index = None if profile is None else shared.free_slice(profile.name)
            if profile is None or index is None:
                continue
            if shared.pending:
                # A slice is on its way: waiting for it beats re-laying out another GPU.
                awaited = True
                continue
            rank = (len(shared.free_slices()), ref)
            if best is None or rank < best[0]:
                share = GpuShare(profile.milli, profile.memory_gib * 1024, profile.name, index)
                best = (rank, slot, share)
        if best is not None:
            _, slot, share = best
            return Placement(request, (slot.ref,), slot.model, slot.pool, share)
        if ask.now is None or awaited:
            return None
        empty: tuple[tuple[int, int, GpuRef], GpuSlot] | None = None
        for slot in self._slots.values():
            current = self._shared.get(slot.ref)
            if (
                not slot.mig_enabled
                or not self._share_eligible(slot, request)
                or (current is not None and not current.empty)
                or ask.slice_profile(slot.model) is None
                or not can_change_layout(
                    self._layout_at.get(slot.ref), ask.now, ask.change_interval
                )
            ):
                continue
            node_free = len(self._free.get(_key_of(slot), {}).get(slot.ref.node, {}))
            order = (0 if current is not None else 1, node_free, slot.ref)
            if empty is None or order < empty[0]:
                empty = (order, slot)
        if empty is None:
            return None
        slot = empty[1]
        profile = ask.slice_profile(slot.model)
        assert profile is not None  # checked in the loop
        layout = fill_layout(slot.model, profile)
        share = GpuShare(profile.milli, profile.memory_gib * 1024, profile.name, 0)
        return Placement(request, (slot.ref,), slot.model, slot.pool, share, layout)

    def _check_share(self, placement: Placement) -> Placement:
        request = placement.request
        share = placement.share
        assert share is not None and request.share is not None  # the caller's branch
        if len(placement.gpus) != 1:
            raise InvalidRequest(f"job {request.job_id}: a share names exactly one GPU")
        slot = self.gpu(placement.gpus[0])
        if not self._share_eligible(slot, request):
            raise GpuNotEligible(f"GPU {slot.ref} does not fit job {request.job_id}")
        if placement.layout is not None and self.layout_of(slot.ref) != placement.layout:
            raise InvalidRequest(
                f"GPU {slot.ref} needs MIG layout {'+'.join(placement.layout)} first "
                "(Ledger.change_layout)"
            )
        tenant = Tenant("", request.kind is JobKind.TRAINING, share)
        if not self._room(slot).admits(tenant, request.share.overcommit):
            raise GpuNotFree(f"GPU {slot.ref} has no room for job {request.job_id}'s share")
        return Placement(request, (slot.ref,), slot.model, slot.pool, share)

    def _require_tenancy(self, event: AllocationGranted) -> None:
        assert event.share is not None
        if len(event.gpus) != 1:
            raise InvalidRequest(f"allocation {event.allocation_id!r}: a share is of one GPU")
        slot = self.gpu(event.gpus[0])
        tenant = Tenant(event.allocation_id, event.kind is JobKind.TRAINING, event.share)
        # Stored grants are replayed under the overcommit of their time: compute only.
        if slot.reserved_for is not None or not self._room(slot).admits(tenant, None):
            raise GpuNotFree(f"GPU {slot.ref} has no room for allocation {event.allocation_id!r}")

    def _room(self, slot: GpuSlot) -> SharedGpu:
        shared = self._shared.get(slot.ref)
        if shared is not None:
            return shared
        if slot.status is not GpuStatus.FREE:
            raise GpuNotFree(f"GPU {slot.ref} is {slot.status}")
        return SharedGpu(slot.memory_mib)

    def _add_tenant(self, event: AllocationGranted) -> None:
        assert event.share is not None
        ref = event.gpus[0]
        tenant = Tenant(event.allocation_id, event.kind is JobKind.TRAINING, event.share)
        shared = self._shared.get(ref) or SharedGpu(self._slots[ref].memory_mib)
        self._set_shared(ref, shared.with_tenant(tenant))

    def _drop_tenant(self, allocation: Allocation) -> None:
        ref = allocation.gpus[0]
        self._set_shared(ref, self._shared[ref].without(allocation.allocation_id))

    def _set_shared(self, ref: GpuRef, shared: SharedGpu) -> None:
        """Keep the sharing state, the slot's status and the fraction index in step; a
        GPU without tenants or layout leaves sharing."""
        slot = self._slots[ref]
        key = (slot.pool, slot.model)
        old = self._shared.get(ref)
        had_lefts = ref.node in self._node_lefts
        if old is not None and not old.mig and old.milli_used < 1000:
            left = 1000 - old.milli_used
            lefts = self._node_lefts[ref.node]
            del lefts[ref]
            if not lefts:
                del self._node_lefts[ref.node]
            by_left = self._by_left[key]
            del by_left[left][ref]
            if not by_left[left]:
                del by_left[left]
                self._lefts[key].remove(left)
        if not shared.mig and shared.milli_used > (0 if old is None else old.milli_used):
            self._fraction_nodes.pop(ref.node, None)
            self._fraction_nodes[ref.node] = None
            if len(self._fraction_nodes) > _RECENT_FRACTION_NODES:
                del self._fraction_nodes[next(iter(self._fraction_nodes))]
        if shared.tenants or shared.layout:
            self._shared[ref] = shared
            if not shared.mig and shared.milli_used < 1000:
                left = 1000 - shared.milli_used
                bucket = self._by_left.setdefault(key, {}).setdefault(left, {})
                if not bucket:
                    insort(self._lefts.setdefault(key, []), left)
                bucket[ref] = None
                self._node_lefts.setdefault(ref.node, {})[ref] = left
            if slot.status is not GpuStatus.SHARED:
                self._put(replace(slot, status=GpuStatus.SHARED))
        else:
            self._shared.pop(ref, None)
            if slot.status is GpuStatus.SHARED:
                self._put(replace(slot, status=GpuStatus.FREE))
        has_lefts = ref.node in self._node_lefts
        host = self._hosts.get(ref.node)
        if host is not None and had_lefts != has_lefts:
            self._index_host(ref.node, host.cpu_free, add=has_lefts)

    # --- evolve ---

    def apply(self, event: LedgerEvent) -> None:
        """Apply a recorded event (replay, projections); refuses one that does not fit."""
        match event:
            case AllocationGranted():
                if event.allocation_id in self._allocations:
                    raise AllocationExists(f"allocation {event.allocation_id!r} already exists")
                if not event.gpus:
                    raise InvalidRequest(f"allocation {event.allocation_id!r} has no GPUs")
                for ref in event.gpus:
                    self._require_unallocated(self.gpu(ref))
                if event.share is not None:
                    self._require_tenancy(event)
            case LayoutChanged():
                self._require_layout_change(event.gpu, event.layout)
            case LayoutFailed():
                if not self.layout_pending(event.gpu):
                    raise InvalidRequest(f"GPU {event.gpu} has no MIG layout change pending")
                slot = self.gpu(event.gpu)
                if event.restored and not layout_valid(slot.model, event.restored):
                    raise InvalidRequest(
                        f"MIG layout {'+'.join(event.restored)} is not valid on {slot.model}"
                    )
            case LayoutApplied():
                if event.layout != self.layout_of(event.gpu):
                    raise InvalidRequest(
                        f"GPU {event.gpu} has MIG layout {'+'.join(self.layout_of(event.gpu))}, "
                        f"not {'+'.join(event.layout)}"
                    )
            case AllocationReleased():
                self.allocation(event.allocation_id)
            case GpusReserved():
                for ref in event.gpus:
                    slot = self.gpu(ref)
                    self._check_lendable(slot)
                    if slot.reserved_for is not None:
                        raise GpuNotFree(f"GPU {ref} is already reserved for {slot.reserved_for!r}")
            case GpusReturned():
                for ref in event.gpus:
                    if self.gpu(ref).reserved_for is None:
                        raise GpuNotReserved(f"GPU {ref} is not reserved for inference")
        self._evolve(event)

    def _evolve(self, event: LedgerEvent) -> None:
        # Callers have validated the whole event first, so a refused command never
        # leaves the ledger half-changed.
        slots = self._slots
        put = self._put
        match event:
            case AllocationGranted():
                if event.share is not None:
                    self._add_tenant(event)
                for ref in event.gpus if event.share is None else ():
                    put(
                        replace(
                            slots[ref],
                            status=GpuStatus.ALLOCATED,
                            allocation_id=event.allocation_id,
                        )
                    )
                allocation = event.allocation
                self._allocations[event.allocation_id] = allocation
                self._hold_hosts(allocation, -1)
            case AllocationReleased():
                allocation = self._allocations.pop(event.allocation_id)
                self._hold_hosts(allocation, +1)
                if allocation.share is not None:
                    self._drop_tenant(allocation)
                for ref in allocation.gpus if allocation.share is None else ():
                    slot = slots[ref]
                    status = (
                        GpuStatus.FREE
                        if slot.reserved_for is None
                        else GpuStatus.RESERVED_INFERENCE
                    )
                    put(replace(slot, status=status, allocation_id=None))
            case GpusReserved():
                for ref in event.gpus:
                    slot = slots[ref]
                    status = (
                        GpuStatus.RESERVED_INFERENCE
                        if slot.status is GpuStatus.FREE
                        else slot.status
                    )
                    put(replace(slot, status=status, reserved_for=event.reservation_id))
            case GpusReturned():
                for ref in event.gpus:
                    slot = slots[ref]
                    status = (
                        GpuStatus.FREE
                        if slot.status is GpuStatus.RESERVED_INFERENCE
                        else slot.status
                    )
                    put(replace(slot, status=status, reserved_for=None))
            case LayoutChanged():
                shared = self._shared.get(event.gpu) or SharedGpu(slots[event.gpu].memory_mib)
                # Slices wait for the agent's word; going back to whole needs no slice.
                changed = replace(shared, layout=event.layout, pending=bool(event.layout))
                self._set_shared(event.gpu, changed)
                self._layout_at[event.gpu] = event.at
                if changed.pending:
                    self._layout_before[event.gpu] = event.before
                else:
                    self._layout_before.pop(event.gpu, None)
            case LayoutApplied():
                if (applied := self._shared.get(event.gpu)) is not None:
                    self._set_shared(event.gpu, replace(applied, pending=False))
                self._layout_before.pop(event.gpu, None)
            case LayoutFailed():
                self._layout_before.pop(event.gpu, None)
                # No tenant uses a pending layout's slices: nothing else to undo.
                failed = self._shared[event.gpu]
                self._set_shared(event.gpu, replace(failed, layout=event.restored, pending=False))

    def _put(self, slot: GpuSlot) -> None:
        old = self._slots[slot.ref]
        if self._indexed(old):
            self._index_remove(old)
        self._slots[slot.ref] = slot
        if self._indexed(slot):
            self._index_add(slot)

    def _indexed(self, slot: GpuSlot) -> bool:
        return slot.placeable and slot.ref.node not in self._down

    def _index_add(self, slot: GpuSlot) -> None:
        key = _key_of(slot)
        node = slot.ref.node
        free = self._free.setdefault(key, {}).setdefault(node, {})
        buckets = self._buckets.setdefault(key, {})
        shape = self._shapes[node]
        count = len(free)
        if count:
            _unbucket(buckets, count, shape, node)
        free[slot.ref.index] = slot
        buckets.setdefault(count + 1, {}).setdefault(shape, {})[node] = None

    def _index_remove(self, slot: GpuSlot) -> None:
        key = _key_of(slot)
        node = slot.ref.node
        by_node = self._free[key]
        free = by_node[node]
        buckets = self._buckets[key]
        shape = self._shapes[node]
        count = len(free)
        _unbucket(buckets, count, shape, node)
        del free[slot.ref.index]
        if free:
            buckets.setdefault(count - 1, {}).setdefault(shape, {})[node] = None
        else:
            del by_node[node]

    def _hold_hosts(self, allocation: Allocation, sign: int) -> None:
        if not (allocation.cpu_per_gpu or allocation.memory_per_gpu):
            return
        per_node: dict[str, int] = {}
        for ref in allocation.gpus:
            per_node[ref.node] = per_node.get(ref.node, 0) + 1
        for node, count in per_node.items():
            room = self._hosts.get(node)
            if room is not None:
                sharing = node in self._node_lefts
                if sharing:
                    self._index_host(node, room.cpu_free, add=False)
                self._hosts[node] = replace(
                    room,
                    cpu_free=room.cpu_free + sign * count * allocation.cpu_per_gpu,
                    memory_free=room.memory_free + sign * count * allocation.memory_per_gpu,
                )
                if sharing:
                    self._index_host(node, self._hosts[node].cpu_free, add=True)

    def _index_host(self, node: str, cpu_free: int, add: bool) -> None:
        if add:
            insort(self._by_cpu, (cpu_free, node))
        else:
            del self._by_cpu[bisect_left(self._by_cpu, (cpu_free, node))]

    # --- checks ---

    def _check_placement(self, request: PlacementRequest, refs: Sequence[GpuRef]) -> Placement:
        if len(refs) != request.gpus or len(set(refs)) != len(refs):
            raise InvalidRequest(
                f"job {request.job_id}: placement must name {request.gpus} distinct GPUs, "
                f"got {', '.join(map(str, refs)) or 'none'}"
            )
        slots = [self.gpu(ref) for ref in refs]
        for slot in slots:
            self._require_unallocated(slot)
            if (condition := self._down.get(slot.ref.node)) is not None:
                raise GpuNotEligible(f"GPU {slot.ref} is on a {condition} node")
            if not _eligible(slot, request):
                raise GpuNotEligible(
                    f"GPU {slot.ref} ({slot.model}, serving pool {slot.serving_pool}) does not "
                    f"fit job {request.job_id} (model {request.model or 'any'}, pools "
                    f"{', '.join(request.pools)})"
                )
        cpu, memory = _host_per_gpu(request)
        per_node: dict[str, int] = {}
        for ref in refs:
            per_node[ref.node] = per_node.get(ref.node, 0) + 1
        for node, count in per_node.items():
            if self._host_feeds(node, cpu, memory, count) < count:
                raise GpuNotEligible(
                    f"node {node} has not enough host CPU or memory left for {count} GPU(s) "
                    f"of job {request.job_id}"
                )
        if not request.may_span_nodes and len(per_node) > 1:
            raise InvalidRequest(f"job {request.job_id} may not span nodes")
        held = sorted(set(per_node) & request.exclude_nodes)
        if held:
            raise GpuNotEligible(f"job {request.job_id} may not use held node(s) {', '.join(held)}")
        gangs = {(slot.serving_pool, slot.model) for slot in slots}
        if len(gangs) != 1:
            raise InvalidRequest(
                f"job {request.job_id}: a gang must use one GPU model in one pool, got "
                + ", ".join(sorted(f"{model} in {pool}" for pool, model in gangs))
            )
        ((pool, model),) = gangs
        return Placement(request, tuple(sorted(refs)), model, pool)

    @staticmethod
    def _require_unallocated(slot: GpuSlot) -> None:
        if slot.status is GpuStatus.ALLOCATED:
            raise GpuNotFree(f"GPU {slot.ref} is allocated to {slot.allocation_id!r}")

    @staticmethod
    def _check_lendable(slot: GpuSlot) -> None:
        if slot.status is GpuStatus.SHARED:
            # Its tenants could only be evicted all at once; shared GPUs are never lent.
            raise GpuNotEligible(f"GPU {slot.ref} is shared by fractional or MIG tenants")
        if slot.pool is not Pool.SHARED:
            raise GpuNotEligible(
                f"GPU {slot.ref} is in the {slot.pool} pool; only shared GPUs are lent to inference"
            )

    def _allocated(self, refs: Iterable[GpuRef]) -> tuple[GpuRef, ...]:
        return tuple(ref for ref in refs if self._slots[ref].status is GpuStatus.ALLOCATED)


def _require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise InvalidRequest(f"time must be timezone-aware, got {now.isoformat()}")


# (cpu_milli, memory_mib) of a node's host; (0, 0) when the ledger does not limit it.
_Shape = tuple[int, int]


def _unbucket(
    buckets: dict[int, dict[_Shape, dict[str, None]]], count: int, shape: _Shape, node: str
) -> None:
    by_shape = buckets[count]
    nodes = by_shape[shape]
    del nodes[node]
    if not nodes:
        del by_shape[shape]
        if not by_shape:
            del buckets[count]


def _key_of(slot: GpuSlot) -> _GangKey:
    return (slot.serving_pool, slot.pool, slot.model)


def _host_per_gpu(request: PlacementRequest) -> tuple[int, int]:
    return per_gpu(request.cpu_milli, request.gpus), per_gpu(request.memory_mib, request.gpus)


# --- gpusched's packing -----------------------------------------------------------

# Candidates examined per decision once one is found that fits: bounds the cost of a
# decision on a large cluster; any of them is a valid best fit by GPU count.
_SCAN_LIMIT = 64
# Tightest partly used GPUs a fraction's placement scores (and half as many on starved
# hosts, beside the free GPUs): enough to find a good node, few enough to stay fast.
_FRACTION_CANDIDATES = 8
# Nodes that took fractions last whose free GPUs are candidates too: fractions gather
# on few nodes instead of opening GPUs all over the cluster.
_RECENT_FRACTION_NODES = 8
# Of them, at most this many with the same compute left: GPUs left alike differ only
# in their nodes, and the best node is rarely among the very tightest.
_PER_LEFT = 1
# Nodes with partly used GPUs looked at, least host CPU first, for the starved ones
# (half of _FRACTION_CANDIDATES): measured on openb, 64 finds too few on a full cluster.
_STARVED_SCAN = 512


def pack(ledger: Ledger, request: PlacementRequest) -> tuple[GpuRef, ...] | None:
    """gpusched's placement: whole GPUs, all or nothing, packed to keep big holes whole.

    In order: one group (NVLink island / NUMA node) of one node, then one node, then,
    if the job allows it, across nodes. Among single nodes, best fit: the node with the
    fewest free GPUs that still fits, so empty nodes stay empty for whole-node gangs;
    ties go to the placement that strands fewest GPUs (leaves them without host CPU or
    memory). Across nodes: the fewest nodes, the remainder on the tightest fit. Pool
    preference (``request.pools`` order, a pool's own GPUs before lent ones) ranks first,
    as in ``first_fit``.
    """
    keys = [
        key
        for key in ledger._free
        if key[0] in request.pools and (request.model is None or key[2] == request.model)
    ]
    tiers = sorted({_tier(key, request) for key in keys})
    by_tier = {tier: [key for key in keys if _tier(key, request) == tier] for tier in tiers}
    for tier in tiers:
        found = _best_node(ledger, by_tier[tier], request)
        if found is not None:
            return found
    if request.may_span_nodes:
        for tier in tiers:
            for key in by_tier[tier]:
                found = _fewest_nodes(ledger, key, request)
                if found is not None:
                    return found
    return None


def _best_node(
    ledger: Ledger, keys: Sequence[_GangKey], request: PlacementRequest
) -> tuple[GpuRef, ...] | None:
    wanted = request.gpus
    cpu, memory = _host_per_gpu(request)
    largest = max((max(ledger._buckets[key], default=0) for key in keys), default=0)
    best: tuple[tuple[int, bool, int, int], str, tuple[int, ...]] | None = None
    examined = 0
    for count in range(wanted, largest + 1):
        shapes = sorted(
            (shape, key) for key in keys for shape in ledger._buckets[key].get(count, ())
        )
        for shape, key in shapes:
            for node in ledger._buckets[key][count][shape]:
                if node in request.exclude_nodes:
                    continue
                if ledger._host_feeds(node, cpu, memory, wanted) < wanted:
                    continue
                free = sorted(ledger._free[key][node])
                chosen, in_group = choose_in_node(free, wanted, ledger._groups.get(node, ()))
                room = ledger._hosts.get(node)
                total = ledger._node_gpus[node]
                after = (
                    None
                    if room is None
                    else replace(
                        room,
                        cpu_free=room.cpu_free - wanted * cpu,
                        memory_free=room.memory_free - wanted * memory,
                    )
                )
                strands = stranded(count - wanted, after, total) - stranded(count, room, total)
                score = (0 if in_group else 1, strands > 0, count, strands)
                if best is None or score < best[0]:
                    best = (score, node, chosen)
                if in_group and strands <= 0:
                    # Buckets run tightest first: nothing later can beat this one.
                    return tuple(GpuRef(node, index) for index in chosen)
                examined += 1
                if examined >= _SCAN_LIMIT:
                    return tuple(GpuRef(best[1], index) for index in best[2])
    if best is None:
        return None
    return tuple(GpuRef(best[1], index) for index in best[2])


def _fewest_nodes(
    ledger: Ledger, key: _GangKey, request: PlacementRequest
) -> tuple[GpuRef, ...] | None:
    wanted = request.gpus
    cpu, memory = _host_per_gpu(request)
    usable: list[tuple[int, str]] = []
    for node, free in ledger._free[key].items():
        if node in request.exclude_nodes:
            continue
        fed = ledger._host_feeds(node, cpu, memory, len(free))
        if fed:
            usable.append((fed, node))
    if sum(fed for fed, _ in usable) < wanted:
        return None
    usable.sort(key=lambda item: (-item[0], item[1]))
    chosen: list[GpuRef] = []
    remaining = wanted
    position = 0
    while remaining:
        fed, node = usable[position]
        if fed >= remaining:
            # The remainder goes on the tightest node that holds it whole.
            fed, node = min(
                (item for item in usable[position:] if item[0] >= remaining),
                key=lambda item: (item[0], item[1]),
            )
            take = remaining
        else:
            take = fed
            position += 1
        indices = sorted(ledger._free[key][node])
        picked, _ = choose_in_node(indices, take, ledger._groups.get(node, ()))
        chosen.extend(GpuRef(node, index) for index in picked)
        remaining -= take
    return tuple(sorted(chosen))
