"""The ledger's state and its evolution: ``evolve(state, event)`` without the checks.

``LedgerState`` holds the GPU slots, the live allocations, each node's host room, the
nodes that are down, the GPUs in sharing, and the placement indexes, and applies an
event that has already been validated (``Ledger`` validates: see ``aggregate``). Every
slot change goes through ``_put``, which keeps the indexes in step. It also answers
the read-only queries.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from datetime import datetime
from types import MappingProxyType

from gpusched.domain.fragmentation import Fragmentation, ModelDemand, ScoreWeights
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.placement import HostRoom, NodeFree, stranded
from gpusched.domain.sharing import PodShape, SharedGpu, Tenant

from .errors import InvalidRequest, UnknownAllocation, UnknownGpu
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
from .index import FreeIndex
from .model import Allocation, GpuSlot, GpuStatus, JobKind, NodeCondition, PoolCapacity
from .requests import PlacementRequest, host_per_gpu
from .scores import Scores

__all__ = ["LedgerState"]

_LAYOUT_EVENTS = (LayoutChanged, LayoutApplied, LayoutFailed)


class LedgerState:
    __slots__ = (
        "_allocations",
        "_changed",
        "_demand",
        "_down",
        "_groups",
        "_hosts",
        "_index",
        "_layout_at",
        "_layout_before",
        "_node_gpus",
        "_node_pool",
        "_scores",
        "_shared",
        "_slots",
        "_weights",
    )

    def __init__(
        self,
        gpus: Iterable[GpuSlot],
        hosts: Mapping[str, tuple[int, int]] | None = None,
        groups: Mapping[str, tuple[tuple[int, ...], ...]] | None = None,
        weights: ScoreWeights | None = None,
    ) -> None:
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
        # A node's pool: its GPUs' home pool (a job without GPUs runs on a node of its pools).
        self._node_pool: dict[str, Pool] = {}
        for slot in ordered:
            self._node_gpus[slot.ref.node] = self._node_gpus.get(slot.ref.node, 0) + 1
            self._node_pool.setdefault(slot.ref.node, slot.pool)
        self._index = FreeIndex()
        self._index.shapes.update(
            (
                node,
                (room.cpu_total, room.memory_total) if (room := self._hosts.get(node)) else (0, 0),
            )
            for node in self._node_gpus
        )
        # Drained and failed nodes: their GPUs stay in the slots (and counts) but out
        # of the placement index, so no decision ever sees them.
        self._down: dict[str, NodeCondition] = {}
        # GPU sharing: the GPUs with tenants or a MIG layout, the time of each GPU's
        # last layout change, and the fractional ones in their own index.
        self._shared: dict[GpuRef, SharedGpu] = {}
        self._layout_at: dict[GpuRef, datetime] = {}
        # While a layout change is pending: the layout the agent still has (it is the
        # GPU's layout again if the change fails).
        self._layout_before: dict[GpuRef, tuple[str, ...]] = {}
        for slot in ordered:
            self._index.add(slot)
        # The cluster as the placement score reads it, kept in step node by node.
        self._weights = weights or ScoreWeights()
        self._scores = Scores(self._slots, self._hosts, self._weights)
        # The GPU compute recent requests asked, by the models they accept: what model
        # scarcity reads.
        self._demand = ModelDemand()
        # GPUs the events since the last take_changed() touched: what a store writes.
        self._changed: dict[GpuRef, None] = {}

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
        for by_node in self._index.free.values():
            for node, slots in by_node.items():
                free[node] += len(slots)
        return tuple(NodeFree(node, free[node], self._node_gpus[node]) for node in sorted(free))

    def stranded_gpus(self) -> int:
        """Free GPUs whose node has no CPU or memory left to feed them."""
        return sum(
            stranded(node.free, self._hosts.get(node.node), node.total)
            for node in self.nodes_free()
        )

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

    def layout_before(self, ref: GpuRef) -> tuple[str, ...]:
        """The layout the agent still has while a change of ``ref`` is pending."""
        return self._layout_before.get(ref, ())

    def _host_eligible(self, node: str, request: PlacementRequest) -> bool:
        """Whether a job without GPUs may run on ``node``: a node of its pools, up, not
        held, with the host CPU and memory it asks left."""
        return (
            self._node_pool.get(node) in request.pools
            and node not in self._down
            and node not in request.exclude_nodes
            and self._host_feeds(node, request.cpu_milli, request.memory_mib, 1) == 1
        )

    def _share_eligible(self, slot: GpuSlot, request: PlacementRequest) -> bool:
        """Whether ``slot`` may take part of itself for ``request`` (pool, model, host)."""
        cpu, memory = host_per_gpu(request)
        node = slot.ref.node
        return (
            slot.reserved_for is None
            and slot.status is not GpuStatus.ALLOCATED
            and slot.pool in request.pools
            and request.accepts(slot.model)
            and node not in request.exclude_nodes
            and node not in self._down
            and self._host_feeds(node, cpu, memory, 1) == 1
        )

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

    def take_changed(self) -> tuple[GpuRef, ...]:
        """The GPUs (still in the ledger) that events changed since the last call, in
        (node, index) order; a store writes their slots, layouts and reservations."""
        changed, self._changed = self._changed, {}
        return tuple(sorted(ref for ref in changed if ref in self._slots))

    # --- evolve ---

    def _evolve(self, event: LedgerEvent) -> None:
        # Callers have validated the whole event first, so a refused command never
        # leaves the ledger half-changed.
        touched = (event.gpu,) if isinstance(event, _LAYOUT_EVENTS) else event.gpus
        self._changed.update(dict.fromkeys(touched))
        match event:
            case AllocationGranted():
                self._granted(event)
            case AllocationReleased():
                self._released(event)
            case GpusReserved():
                self._reserved(event)
            case GpusReturned():
                self._returned(event)
            case LayoutChanged():
                self._layout_changed(event)
            case LayoutApplied():
                if (applied := self._shared.get(event.gpu)) is not None:
                    self._set_shared(event.gpu, replace(applied, pending=False))
                self._layout_before.pop(event.gpu, None)
            case LayoutFailed():
                self._layout_before.pop(event.gpu, None)
                # No tenant uses a pending layout's slices: nothing else to undo.
                failed = self._shared[event.gpu]
                self._set_shared(event.gpu, replace(failed, layout=event.restored, pending=False))

    def _granted(self, event: AllocationGranted) -> None:
        if event.share is not None:
            self._add_tenant(event)
        else:
            for ref in event.gpus:
                self._put(
                    replace(
                        self._slots[ref],
                        status=GpuStatus.ALLOCATED,
                        allocation_id=event.allocation_id,
                    )
                )
        allocation = event.allocation
        self._allocations[event.allocation_id] = allocation
        self._hold_hosts(allocation, -1)

    def _released(self, event: AllocationReleased) -> None:
        allocation = self._allocations.pop(event.allocation_id)
        self._hold_hosts(allocation, +1)
        if allocation.share is not None:
            self._drop_tenant(allocation)
            return
        for ref in allocation.gpus:
            slot = self._slots[ref]
            status = GpuStatus.FREE if slot.reserved_for is None else GpuStatus.RESERVED_INFERENCE
            self._put(replace(slot, status=status, allocation_id=None))

    def _reserved(self, event: GpusReserved) -> None:
        for ref in event.gpus:
            slot = self._slots[ref]
            status = GpuStatus.RESERVED_INFERENCE if slot.status is GpuStatus.FREE else slot.status
            self._put(replace(slot, status=status, reserved_for=event.reservation_id))

    def _returned(self, event: GpusReturned) -> None:
        for ref in event.gpus:
            slot = self._slots[ref]
            status = GpuStatus.FREE if slot.status is GpuStatus.RESERVED_INFERENCE else slot.status
            self._put(replace(slot, status=status, reserved_for=None))

    def _layout_changed(self, event: LayoutChanged) -> None:
        shared = self._shared.get(event.gpu) or SharedGpu(self._slots[event.gpu].memory_mib)
        # Slices wait for the agent's word; going back to whole needs no slice.
        changed = replace(shared, layout=event.layout, pending=bool(event.layout))
        self._set_shared(event.gpu, changed)
        self._layout_at[event.gpu] = event.at
        if changed.pending:
            self._layout_before[event.gpu] = event.before
        else:
            self._layout_before.pop(event.gpu, None)

    def _put(self, slot: GpuSlot) -> None:
        self._scores.touch(slot.ref.node)
        old = self._slots[slot.ref]
        if self._indexed(old):
            self._index.remove(old)
        self._slots[slot.ref] = slot
        if self._indexed(slot):
            self._index.add(slot)

    def _indexed(self, slot: GpuSlot) -> bool:
        return slot.placeable and slot.ref.node not in self._down

    def _hold_hosts(self, allocation: Allocation, sign: int) -> None:
        if not (allocation.cpu_per_gpu or allocation.memory_per_gpu):
            return
        for node, (cpu, memory) in allocation.host_held().items():
            room = self._hosts.get(node)
            if room is None:
                continue
            self._scores.touch(node)
            self._hosts[node] = replace(
                room,
                cpu_free=room.cpu_free + sign * cpu,
                memory_free=room.memory_free + sign * memory,
            )

    # --- sharing ---

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
        """Keep the sharing state and the slot's status in step; a GPU without tenants
        or layout leaves sharing."""
        self._scores.touch(ref.node)
        slot = self._slots[ref]
        if shared.tenants or shared.layout:
            self._shared[ref] = shared
            if slot.status is not GpuStatus.SHARED:
                self._put(replace(slot, status=GpuStatus.SHARED))
        else:
            self._shared.pop(ref, None)
            if slot.status is GpuStatus.SHARED:
                # Lent while its fractions ran: the last one gone, it is inference's.
                reserved = slot.reserved_for is not None
                free = GpuStatus.RESERVED_INFERENCE if reserved else GpuStatus.FREE
                self._put(replace(slot, status=free))

    def _fragmentation(self, mix: tuple[tuple[PodShape, float], ...]) -> Fragmentation:
        """The placement score's view, up to date with every change so far."""
        return self._scores.refresh(self._slots, self._shared, self._hosts, self._down, mix)
