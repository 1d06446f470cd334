"""The aggregate: ``Ledger``'s commands, each a decide that checks the command against
the current state and builds a domain event, then the evolution of that event
(``LedgerState``). ``apply`` runs the same checks and evolution for events read back
from the database or from the bus, so a replica or a projection rebuilds identical
state. Nothing here does I/O or reads a clock: times arrive as aware datetimes.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from datetime import datetime, timedelta

from gpusched.domain.fragmentation import ScoreWeights
from gpusched.domain.inventory import GpuRef, Inventory, NodeSpec, Pool
from gpusched.domain.placement import HostRoom
from gpusched.domain.sharing import (
    WHOLE_GPU_MILLI,
    PodShape,
    SharedGpu,
    Tenant,
    WorkloadMix,
    can_change_layout,
    layout_valid,
)

from .errors import (
    AllocationExists,
    GpuNotEligible,
    GpuNotFree,
    GpuNotReserved,
    InvalidRequest,
    LayoutChangeRefused,
    NodeBusy,
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
from .host import place_host
from .model import Allocation, GpuSlot, GpuStatus, JobKind, NodeCondition, PriorityClass
from .packing import pack
from .requests import Placement, PlacementRequest, PlacementStrategy, eligible, host_per_gpu
from .scores import Scores
from .shares import place_share
from .state import LedgerState

__all__ = ["Ledger"]


class Ledger(LedgerState):
    """GPU slots and live allocations of one cluster. Mutable; see the package docstring."""

    __slots__ = ("_mix",)

    def __init__(
        self,
        gpus: Iterable[GpuSlot],
        hosts: Mapping[str, tuple[int, int]] | None = None,
        groups: Mapping[str, tuple[tuple[int, ...], ...]] | None = None,
        weights: ScoreWeights | None = None,
    ) -> None:
        """An idle ledger over ``gpus``; live state comes back through ``restore``/``apply``.

        ``hosts`` gives each node's (cpu_milli, memory_mib) so placement also respects
        host CPU and memory; a node missing from it is not limited. ``groups`` gives a
        node's NVLink islands / NUMA GPU groups. ``weights``: how placement scores add
        up (``gpusched.domain.fragmentation.ScoreWeights``; the defaults were measured on
        the openb cluster).
        """
        super().__init__(gpus, hosts, groups, weights)
        # The shapes of recent requests: what the fragmentation score of a fraction reads.
        self._mix = WorkloadMix()

    @classmethod
    def from_inventory(cls, inventory: Inventory, weights: ScoreWeights | None = None) -> Ledger:
        return cls(
            (
                GpuSlot(gpu.ref, gpu.model, gpu.memory_mib, node.pool, mig=node.mig)
                for node in inventory.nodes
                for gpu in node.gpus
            ),
            hosts={node.name: (node.cpu_milli, node.memory_mib) for node in inventory.nodes},
            groups={node.name: node.gpu_groups for node in inventory.nodes if node.gpu_groups},
            weights=weights,
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

    # --- placement and allocations ---

    def place(
        self, request: PlacementRequest, strategy: PlacementStrategy | None = None
    ) -> Placement | None:
        """Find GPUs for ``request`` without changing the GPUs; ``allocate`` commits.
        The request's shape is remembered (``WorkloadMix``) for placing fractions.

        Without a strategy: ``pack`` (see there) on the ledger's index. A strategy
        function sees every eligible free GPU, trimmed per node to what the node's host
        CPU and memory can feed.
        """
        # The mix is of GPU pods: a job without GPUs leaves no GPU fragment of its own.
        if request.gpus and (request.share is None or not request.share.mig):
            milli = WHOLE_GPU_MILLI if request.share is None else request.share.milli
            assert milli is not None  # not a MIG ask
            self._mix.observe(
                PodShape(request.gpus, milli, request.cpu_milli, request.memory_mib, request.models)
            )
            self._demand.observe(request.models, request.gpus * milli)
        if not request.gpus:
            node = place_host(self, request, self._mix.typical())
            return None if node is None else self._check_host(request, node)
        if request.share is not None:
            return place_share(self, request, request.share, self._mix.typical())
        if strategy is None:
            chosen = pack(self, request, self._mix.typical())
        else:
            chosen = strategy(self._candidates(request), request)
        if chosen is None:
            return None
        return self._check_placement(request, chosen)

    def _candidates(self, request: PlacementRequest) -> dict[str, list[GpuSlot]]:
        cpu, memory = host_per_gpu(request)
        candidates: dict[str, list[GpuSlot]] = {}
        for slot in self._slots.values():
            if (
                eligible(slot, request)
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
        if not request.gpus:
            checked = self._check_host(request, placement.node)
        elif placement.share is not None:
            checked = self._check_share(placement)
        else:
            checked = self._check_placement(request, placement.gpus)
        cpu, memory = host_per_gpu(request)
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
            node=checked.node,
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
                ref
                for ref in allocation.gpus
                if self._slots[ref].reserved_for is not None
                and self._last_tenant(ref, allocation_id)
            ),
        )
        self._evolve(event)
        return event

    def _last_tenant(self, ref: GpuRef, allocation_id: str) -> bool:
        """Whether nothing but ``allocation_id`` holds ``ref`` (a whole GPU's holder, or
        the last of its fractional tenants)."""
        shared = self._shared.get(ref)
        return shared is None or all(t.allocation_id == allocation_id for t in shared.tenants)

    # --- lending to inference ---

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
        """Its allocations: on its GPUs, then those of its host alone (no GPU)."""
        hosted = (a for a in self._allocations.values() if a.node == node)
        return (*self.allocations_on(self.node_gpus(node)), *hosted)

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
        self._node_pool[node.name] = node.pool
        self._index.shapes[node.name] = (node.cpu_milli, node.memory_mib)
        # Every query walks the slots in (node, index) order, as after __init__.
        self._slots = dict(sorted([*self._slots.items(), *((slot.ref, slot) for slot in added)]))
        for slot in added:
            self._index.add(slot)
        self._scores = Scores(self._slots, self._hosts, self._weights)
        return tuple(slot.ref for slot in added)

    def set_condition(self, node: str, condition: NodeCondition | None) -> None:
        """Drain or fail a node (None: back up). Running allocations of a drained node
        stay; a node is failed only once its allocations are released."""
        refs = self.node_gpus(node)
        if condition is NodeCondition.FAILED and (held := self.allocations_on_node(node)):
            raise NodeBusy(
                f"node {node} still holds allocation(s) "
                f"{', '.join(a.allocation_id for a in held)}: release them before failing it"
            )
        slots = [self._slots[ref] for ref in refs]
        self._scores.touch(node)
        for slot in slots:
            if self._indexed(slot):
                self._index.remove(slot)
        if condition is None:
            self._down.pop(node, None)
        else:
            self._down[node] = condition
        for slot in slots:
            if self._indexed(slot):
                self._index.add(slot)

    def remove_node(self, node: str) -> tuple[GpuRef, ...]:
        """Take an empty node out of the ledger; refuses one with allocations or lent GPUs."""
        refs = self.node_gpus(node)
        held = self.allocations_on_node(node)
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
                self._index.remove(slot)
        del self._node_gpus[node]
        del self._node_pool[node]
        del self._index.shapes[node]
        self._hosts.pop(node, None)
        self._groups.pop(node, None)
        self._down.pop(node, None)
        self._scores = Scores(self._slots, self._hosts, self._weights)
        return refs

    def _require_node(self, node: str) -> None:
        if node not in self._node_gpus:
            raise UnknownNode(f"unknown node {node!r}")

    # --- MIG layouts (rules in gpusched.domain.sharing) ---

    def apply_layout(self, ref: GpuRef, layout: Sequence[str]) -> LayoutApplied | None:
        """The agent applied ``layout``: its slices may be used (None: already were)."""
        event = LayoutApplied(ref, tuple(layout))
        if not self.layout_pending(ref) and event.layout == self.layout_of(ref):
            return None
        self.apply(event)
        return event

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

    # --- replay ---

    def apply(self, event: LedgerEvent) -> None:
        """Apply a recorded event (replay, projections); refuses one that does not fit."""
        match event:
            case AllocationGranted():
                self._require_grant(event)
            case LayoutChanged():
                self._require_layout_change(event.gpu, event.layout)
            case LayoutFailed():
                self._require_failable(event)
            case LayoutApplied():
                if event.layout != self.layout_of(event.gpu):
                    raise InvalidRequest(
                        f"GPU {event.gpu} has MIG layout {'+'.join(self.layout_of(event.gpu))}, "
                        f"not {'+'.join(event.layout)}"
                    )
            case AllocationReleased():
                self.allocation(event.allocation_id)
            case GpusReserved():
                self._require_lendable(event.gpus)
            case GpusReturned():
                for ref in event.gpus:
                    if self.gpu(ref).reserved_for is None:
                        raise GpuNotReserved(f"GPU {ref} is not reserved for inference")
        self._evolve(event)

    # --- checks ---

    def _require_grant(self, event: AllocationGranted) -> None:
        if event.allocation_id in self._allocations:
            raise AllocationExists(f"allocation {event.allocation_id!r} already exists")
        if event.node is not None:
            if event.gpus or event.share is not None:
                raise InvalidRequest(
                    f"allocation {event.allocation_id!r} names a node for host alone and GPUs"
                )
            self._require_node(event.node)
            return
        if not event.gpus:
            raise InvalidRequest(f"allocation {event.allocation_id!r} has no GPUs and no node")
        for ref in event.gpus:
            _require_unallocated(self.gpu(ref))
        if event.share is not None:
            self._require_tenancy(event)

    def _require_failable(self, event: LayoutFailed) -> None:
        if not self.layout_pending(event.gpu):
            raise InvalidRequest(f"GPU {event.gpu} has no MIG layout change pending")
        slot = self.gpu(event.gpu)
        if event.restored and not layout_valid(slot.model, event.restored):
            raise InvalidRequest(
                f"MIG layout {'+'.join(event.restored)} is not valid on {slot.model}"
            )

    def _require_lendable(self, refs: Iterable[GpuRef]) -> None:
        for ref in refs:
            slot = self.gpu(ref)
            self._check_lendable(slot)
            if slot.reserved_for is not None:
                raise GpuNotFree(f"GPU {ref} is already reserved for {slot.reserved_for!r}")

    def _check_placement(self, request: PlacementRequest, refs: Sequence[GpuRef]) -> Placement:
        if len(refs) != request.gpus or len(set(refs)) != len(refs):
            raise InvalidRequest(
                f"job {request.job_id}: placement must name {request.gpus} distinct GPUs, "
                f"got {', '.join(map(str, refs)) or 'none'}"
            )
        slots = [self.gpu(ref) for ref in refs]
        for slot in slots:
            _require_unallocated(slot)
            if (condition := self._down.get(slot.ref.node)) is not None:
                raise GpuNotEligible(f"GPU {slot.ref} is on a {condition} node")
            if not eligible(slot, request):
                raise GpuNotEligible(
                    f"GPU {slot.ref} ({slot.model}, serving pool {slot.serving_pool}) does not "
                    f"fit job {request.job_id} (model {'|'.join(request.models) or 'any'}, pools "
                    f"{', '.join(request.pools)})"
                )
        cpu, memory = host_per_gpu(request)
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

    def _check_host(self, request: PlacementRequest, node: str | None) -> Placement:
        """A placement without GPUs: on one known node that may take the request."""
        if node is None:
            raise InvalidRequest(f"job {request.job_id}: a placement without GPUs names a node")
        self._require_node(node)
        if not self._host_eligible(node, request):
            raise GpuNotEligible(
                f"node {node} may not take job {request.job_id} (its pool, its condition, a "
                "hold for another job, or not enough host CPU or memory left)"
            )
        return Placement(request, (), "", self._node_pool[node], node=node)

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

    def _allocated(self, refs: Iterable[GpuRef]) -> tuple[GpuRef, ...]:
        """The GPUs still held by allocations (whole, or by fractional tenants): a
        reservation waits for them."""
        return tuple(
            ref
            for ref in refs
            if self._slots[ref].status in (GpuStatus.ALLOCATED, GpuStatus.SHARED)
        )

    def share_unlendable(self, ref: GpuRef) -> str | None:
        """Why a GPU in sharing may not be lent to inference (None: it may, or it is not
        in sharing). Fractions of training alone may: their tenants are evicted together
        and the GPU goes to inference when the last has left; a MIG layout or an
        inference tenant stays where it is."""
        shared = self._shared.get(ref)
        if shared is None:
            return None
        if shared.mig:
            return "carries a MIG layout"
        if not all(tenant.training for tenant in shared.tenants):
            return "shared with an inference tenant"
        return None

    def _check_lendable(self, slot: GpuSlot) -> None:
        if slot.status is GpuStatus.SHARED and (why := self.share_unlendable(slot.ref)):
            raise GpuNotEligible(
                f"GPU {slot.ref} {why}; only whole GPUs and GPUs shared by training "
                "fractions alone are lent"
            )
        if slot.pool is not Pool.SHARED:
            raise GpuNotEligible(
                f"GPU {slot.ref} is in the {slot.pool} pool; only shared GPUs are lent to inference"
            )


def _require_unallocated(slot: GpuSlot) -> None:
    if slot.status is GpuStatus.ALLOCATED:
        raise GpuNotFree(f"GPU {slot.ref} is allocated to {slot.allocation_id!r}")


def _require_aware(now: datetime) -> None:
    if now.tzinfo is None or now.utcoffset() is None:
        raise InvalidRequest(f"time must be timezone-aware, got {now.isoformat()}")
