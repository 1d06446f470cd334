"""Which GPUs a reservation for inference takes from its victims (admission.lending),
without I/O: whole GPUs, and GPUs shared by training fractions, which go only when every
tenant is a victim."""

from __future__ import annotations

from datetime import UTC, datetime

from gpusched.admission import lending
from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import JobKind, Ledger, PlacementRequest, PriorityClass
from gpusched.domain.sharing import ShareAsk

T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
GIB = 1024


def cluster() -> Ledger:
    specs = tuple(GpuSpec("n0", i, "A100-80GB", 80 * GIB) for i in range(4))
    return Ledger.from_inventory(Inventory((NodeSpec("n0", Pool.SHARED, specs, 64_000, 1 << 20),)))


def run(ledger: Ledger, job: str, gpus: int = 1, milli: int | None = None) -> GpuRef:
    share = None if milli is None else ShareAsk(milli, None)
    placement = ledger.place(PlacementRequest(job, JobKind.TRAINING, gpus, share=share))
    assert placement is not None
    ledger.allocate(f"a-{job}", placement, "lab", PriorityClass.P2_OFFLINE, T0)
    return placement.gpus[0]


def test_a_gpu_of_fractions_is_taken_only_with_every_tenant_a_victim() -> None:
    ledger = cluster()
    shared = run(ledger, "f1", milli=400)
    assert run(ledger, "f2", milli=400) == shared

    partly = lending.to_reserve(ledger, "r1", ["a-f1"], 0)
    assert partly.gpus == ()
    assert partly.not_lendable == {str(shared): "shared with tenants that are not evicted (a-f2)"}

    whole = lending.to_reserve(ledger, "r1", ["a-f1", "a-f2"], 0)
    assert whole.gpus == (shared,)  # once, though two victims hold it
    assert whole.not_lendable == {}
    ledger.reserve_for_inference("r1", whole.gpus)
    # Returned first among lent GPUs that training still holds, as a whole GPU's would be.
    assert lending.lent_to_return(ledger, "r1", 1) == (shared,)
    assert lending.waiting_for(ledger, "a-f1") == (shared,)


def test_whole_victims_and_idle_gpus_are_taken_as_before() -> None:
    ledger = cluster()
    held = run(ledger, "w1")
    chosen = lending.to_reserve(ledger, "r1", ["a-w1", "a-gone"], 1)
    assert chosen.gpus[0] == held and len(chosen.gpus) == 2
    assert chosen.unknown == ("a-gone",)
    assert len(chosen.free) == 1
