"""Which shared GPUs to lend to inference, and which to give back first. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import GpuSlot, GpuStatus, JobKind, Ledger, UnknownAllocation


def idle_shared(slot: GpuSlot) -> bool:
    return slot.pool is Pool.SHARED and slot.status is GpuStatus.FREE and slot.reserved_for is None


def free_to_lend(ledger: Ledger, count: int, taken: Collection[GpuRef]) -> tuple[GpuRef, ...]:
    """Up to ``count`` idle shared GPUs not in ``taken``.

    Nodes with the fewest idle GPUs go first, so lending nibbles at fragments and keeps
    whole nodes free for training gangs; among equals, a node already giving GPUs to
    inference goes first, which keeps inference on few nodes.
    """
    if count <= 0:
        return ()
    # A drained or failed node lends nothing: inference could not be placed there.
    candidates = [
        slot
        for slot in ledger.gpus
        if idle_shared(slot)
        and slot.ref not in taken
        and ledger.node_condition(slot.ref.node) is None
    ]
    idle_on = Counter(slot.ref.node for slot in candidates)
    lent_on = Counter(ref.node for ref in (*ledger.lent_gpus(), *taken))
    ordered = sorted(
        candidates, key=lambda slot: (idle_on[slot.ref.node], -lent_on[slot.ref.node], slot.ref)
    )
    return tuple(slot.ref for slot in ordered[:count])


def lent_to_return(ledger: Ledger, reservation_id: str, count: int) -> tuple[GpuRef, ...]:
    """Up to ``count`` GPUs of the reservation, those that become free at once first.

    Order: idle lent GPUs; then pending ones (training still holds them, so lifting the
    reservation just lets the job keep them); last, GPUs inference is running on (they
    turn shared when inference releases them). Within each, nodes with the most idle
    shared GPUs first, so returned GPUs complete whole nodes for training gangs.
    """
    slots = [ledger.gpu(ref) for ref in ledger.reservation(reservation_id)]
    idle_on = Counter(slot.ref.node for slot in ledger.gpus if idle_shared(slot))

    def stage(slot: GpuSlot) -> int:
        if slot.status is GpuStatus.RESERVED_INFERENCE:
            return 0
        if slot.status is GpuStatus.SHARED:
            return 1  # training fractions still hold it
        assert slot.allocation_id is not None  # the only other status of a lent GPU
        holder = ledger.allocation(slot.allocation_id)
        return 1 if holder.kind is JobKind.TRAINING else 2

    ordered = sorted(slots, key=lambda slot: (stage(slot), -idle_on[slot.ref.node], slot.ref))
    return tuple(slot.ref for slot in ordered[: max(count, 0)])


@dataclass(frozen=True, slots=True)
class ToReserve:
    """What a reservation for inference takes: the victims' GPUs and idle ones."""

    gpus: tuple[GpuRef, ...]
    free: tuple[GpuRef, ...]  # the idle shared GPUs among them
    unknown: tuple[str, ...] = ()  # allocations the ledger does not hold (ended meanwhile)
    # A victim's GPU that cannot be lent, and why.
    not_lendable: dict[str, str] = field(default_factory=dict)


def to_reserve(
    ledger: Ledger, reservation_id: str, allocation_ids: Iterable[str], free_gpus: int
) -> ToReserve:
    """The GPUs of the victims' allocations that may be lent, then ``free_gpus`` idle
    shared GPUs (``free_to_lend``): what ``Ledger.reserve_for_inference`` is given."""
    chosen: list[GpuRef] = []
    unknown: list[str] = []
    not_lendable: dict[str, str] = {}
    victims = dict.fromkeys(allocation_ids)
    for allocation_id in victims:
        try:
            allocation = ledger.allocation(allocation_id)
        except UnknownAllocation:
            unknown.append(allocation_id)
            continue
        for ref in allocation.gpus:
            slot = ledger.gpu(ref)
            if ref in chosen:
                continue  # another tenant of the same GPU named it already
            shared = (
                _unlendable_share(ledger, ref, victims) if slot.status is GpuStatus.SHARED else None
            )
            if slot.pool is not Pool.SHARED:
                not_lendable[str(ref)] = f"{slot.pool} pool"
            elif shared is not None:
                not_lendable[str(ref)] = shared
            elif slot.reserved_for not in (None, reservation_id):
                not_lendable[str(ref)] = f"already reserved for {slot.reserved_for}"
            else:
                chosen.append(ref)
    free = free_to_lend(ledger, free_gpus, chosen)
    return ToReserve((*chosen, *free), free, tuple(unknown), not_lendable)


def _unlendable_share(ledger: Ledger, ref: GpuRef, victims: Collection[str]) -> str | None:
    """Why a GPU in sharing cannot go to inference with these victims (None: it can):
    only training fractions, every one of them evicted, free it."""
    shared = ledger.shared.get(ref)
    if shared is None:
        return None
    if (why := ledger.share_unlendable(ref)) is not None:
        return why
    staying = [t.allocation_id for t in shared.tenants if t.allocation_id not in victims]
    if staying:
        return f"shared with tenants that are not evicted ({', '.join(sorted(staying))})"
    return None


def waiting_for(ledger: Ledger, allocation_id: str) -> tuple[GpuRef, ...]:
    """The GPUs of a live allocation that a reservation waits for (none if it ended):
    when its eviction is called off they must go back to training, not to inference."""
    if allocation_id not in ledger.allocations:
        return ()
    return tuple(
        ref
        for ref in ledger.allocation(allocation_id).gpus
        if ledger.gpu(ref).reserved_for is not None
    )
