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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from types import MappingProxyType

from gpusched.domain.inventory import GpuRef, Inventory, Pool

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
    "Ledger",
    "LedgerError",
    "LedgerEvent",
    "Placement",
    "PlacementRequest",
    "PlacementStrategy",
    "PoolCapacity",
    "PriorityClass",
    "UnknownAllocation",
    "UnknownGpu",
    "UnknownReservation",
    "default_pools",
    "first_fit",
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

    def __post_init__(self) -> None:
        # The three statuses and their ids must agree, or counts and replays drift.
        consistent = {
            GpuStatus.FREE: self.allocation_id is None and self.reserved_for is None,
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
        return self.status is not GpuStatus.ALLOCATED


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

    def __post_init__(self) -> None:
        if self.gpus < 1:
            raise InvalidRequest(f"job {self.job_id}: needs at least 1 GPU, asked {self.gpus}")
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


LedgerEvent = AllocationGranted | AllocationReleased | GpusReserved | GpusReturned


# --- the aggregate ----------------------------------------------------------------


class Ledger:
    """GPU slots and live allocations of one cluster. Mutable; see the module docstring."""

    __slots__ = ("_allocations", "_slots")

    def __init__(self, gpus: Iterable[GpuSlot]) -> None:
        """An idle ledger over ``gpus``; live state comes back through ``restore``/``apply``."""
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

    @classmethod
    def from_inventory(cls, inventory: Inventory) -> Ledger:
        return cls(
            GpuSlot(gpu.ref, gpu.model, gpu.memory_mib, node.pool)
            for node in inventory.nodes
            for gpu in node.gpus
        )

    @classmethod
    def restore(
        cls,
        inventory: Inventory,
        allocations: Iterable[Allocation],
        reservations: Mapping[GpuRef, str],
    ) -> Ledger:
        """Rebuild from stored rows: live allocations and the GPU -> reservation map."""
        ledger = cls.from_inventory(inventory)
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
            if slot.placeable and slot.serving_pool is pool
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
                allocated=by_status[GpuStatus.ALLOCATED],
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
        return tuple(found.values())

    def reservation(self, reservation_id: str) -> tuple[GpuRef, ...]:
        return tuple(
            slot.ref for slot in self._slots.values() if slot.reserved_for == reservation_id
        )

    def lent_gpus(self) -> tuple[GpuRef, ...]:
        return tuple(slot.ref for slot in self._slots.values() if slot.reserved_for is not None)

    # --- commands (decide, then evolve) ---

    def place(
        self, request: PlacementRequest, strategy: PlacementStrategy = first_fit
    ) -> Placement | None:
        """Find GPUs for ``request`` without changing anything; ``allocate`` commits."""
        candidates: dict[str, list[GpuSlot]] = {}
        for slot in self._slots.values():
            if _eligible(slot, request):
                candidates.setdefault(slot.ref.node, []).append(slot)
        chosen = strategy(candidates, request)
        if chosen is None:
            return None
        return self._check_placement(request, chosen)

    def allocate(
        self,
        allocation_id: str,
        placement: Placement,
        team: str,
        priority_class: PriorityClass,
        now: datetime,
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
        checked = self._check_placement(request, placement.gpus)
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
        match event:
            case AllocationGranted():
                for ref in event.gpus:
                    slots[ref] = replace(
                        slots[ref], status=GpuStatus.ALLOCATED, allocation_id=event.allocation_id
                    )
                self._allocations[event.allocation_id] = event.allocation
            case AllocationReleased():
                for ref in self._allocations.pop(event.allocation_id).gpus:
                    slot = slots[ref]
                    status = (
                        GpuStatus.FREE
                        if slot.reserved_for is None
                        else GpuStatus.RESERVED_INFERENCE
                    )
                    slots[ref] = replace(slot, status=status, allocation_id=None)
            case GpusReserved():
                for ref in event.gpus:
                    slot = slots[ref]
                    status = (
                        GpuStatus.RESERVED_INFERENCE
                        if slot.status is GpuStatus.FREE
                        else slot.status
                    )
                    slots[ref] = replace(slot, status=status, reserved_for=event.reservation_id)
            case GpusReturned():
                for ref in event.gpus:
                    slot = slots[ref]
                    status = (
                        GpuStatus.FREE
                        if slot.status is GpuStatus.RESERVED_INFERENCE
                        else slot.status
                    )
                    slots[ref] = replace(slot, status=status, reserved_for=None)

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
            if not _eligible(slot, request):
                raise GpuNotEligible(
                    f"GPU {slot.ref} ({slot.model}, serving pool {slot.serving_pool}) does not "
                    f"fit job {request.job_id} (model {request.model or 'any'}, pools "
                    f"{', '.join(request.pools)})"
                )
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
        if slot.pool is not Pool.SHARED:
            raise GpuNotEligible(
                f"GPU {slot.ref} is in the {slot.pool} pool; only shared GPUs are lent to inference"
            )

    def _allocated(self, refs: Iterable[GpuRef]) -> tuple[GpuRef, ...]:
        return tuple(ref for ref in refs if self._slots[ref].status is GpuStatus.ALLOCATED)


def _require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise InvalidRequest(f"time must be timezone-aware, got {now.isoformat()}")
