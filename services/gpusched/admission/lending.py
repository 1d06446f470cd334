"""Which shared GPUs to lend to inference, and which to give back first. Pure."""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import GpuSlot, GpuStatus, JobKind, Ledger


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
        assert slot.allocation_id is not None  # the only other status of a lent GPU
        holder = ledger.allocation(slot.allocation_id)
        return 1 if holder.kind is JobKind.TRAINING else 2

    ordered = sorted(slots, key=lambda slot: (stage(slot), -idle_on[slot.ref.node], slot.ref))
    return tuple(slot.ref for slot in ordered[: max(count, 0)])
