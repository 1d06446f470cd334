"""The ledger with GPU sharing, without I/O: fractional packing, MIG slices and layout
changes, whole GPUs kept apart from shared ones, restore, and invariants under random
workloads."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    GpuNotEligible,
    GpuNotFree,
    GpuStatus,
    JobKind,
    LayoutChangeRefused,
    Ledger,
    Placement,
    PlacementRequest,
    PriorityClass,
)
from gpusched.domain.sharing import GpuShare, Overcommit, ShareAsk

GIB = 1024
HOUR = timedelta(hours=1)
T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def node(name: str, pool: Pool, gpus: int, model: str = "A100-80GB", mig: bool | None = None):
    return NodeSpec(
        name,
        pool,
        tuple(GpuSpec(name, i, model, 80 * GIB) for i in range(gpus)),
        64_000,
        512 * GIB,
        mig=mig,
    )


def ledger_of(*nodes: NodeSpec) -> Ledger:
    return Ledger.from_inventory(Inventory(nodes))


def fraction(
    job: str, milli: int, memory_gib: int | None = None, kind: JobKind = JobKind.TRAINING
) -> PlacementRequest:
    memory = None if memory_gib is None else memory_gib * GIB
    return PlacementRequest(job, kind, 1, share=ShareAsk(milli, memory))


def mig_slice(job: str, memory_gib: float, now: datetime | None = T0) -> PlacementRequest:
    ask = ShareAsk(None, int(memory_gib * GIB), now=now, change_interval=HOUR)
    return PlacementRequest(job, JobKind.INFERENCE, 1, share=ask)


def grant(ledger: Ledger, request: PlacementRequest, now: datetime = T0) -> Placement:
    placement = ledger.place(request)
    assert placement is not None, f"{request.job_id} found no room"
    if placement.layout is not None:
        ledger.change_layout(placement.gpus[0], placement.layout, now, HOUR)
        ledger.apply_layout(placement.gpus[0], placement.layout)  # the agent's report
    pc = PriorityClass.INFERENCE if request.kind is JobKind.INFERENCE else PriorityClass.P1_NORMAL
    ledger.allocate(f"a-{request.job_id}", placement, "team", pc, now)
    return placement


def test_a_second_fractional_tenant_lands_on_the_gpu_the_first_one_shares() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 4))
    first = grant(ledger, fraction("j1", 400))
    second = grant(ledger, fraction("j2", 500))
    assert first.gpus == second.gpus
    assert second.share == GpuShare(500, 40 * GIB)  # half of the GPU's memory by default
    assert ledger.gpu(first.gpus[0]).status is GpuStatus.SHARED
    assert len(ledger.free_gpus(Pool.SHARED)) == 3


def test_a_fraction_that_does_not_fit_the_shared_gpu_starts_sharing_another() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 4))
    first = grant(ledger, fraction("j1", 700))
    second = grant(ledger, fraction("j2", 400))
    assert first.gpus != second.gpus
    third = grant(ledger, fraction("j3", 300))
    assert third.gpus == first.gpus  # best fit: 300 left there, 600 on the other


def test_a_whole_gpu_placement_never_takes_a_shared_gpu() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 2))
    grant(ledger, fraction("j1", 100))
    assert ledger.place(PlacementRequest("whole", JobKind.TRAINING, 2)) is None
    one = ledger.place(PlacementRequest("whole", JobKind.TRAINING, 1))
    assert one is not None and one.gpus == (GpuRef("n0", 1),)


def test_a_gpu_leaves_sharing_when_its_last_tenant_ends() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 1))
    grant(ledger, fraction("j1", 300))
    grant(ledger, fraction("j2", 300))
    ledger.release("a-j1", T0)
    assert ledger.gpu(GpuRef("n0", 0)).status is GpuStatus.SHARED
    ledger.release("a-j2", T0)
    assert ledger.gpu(GpuRef("n0", 0)).status is GpuStatus.FREE
    assert ledger.place(PlacementRequest("whole", JobKind.TRAINING, 1)) is not None


def test_a_gpu_of_training_fractions_is_lent_pending_and_goes_to_inference_after_the_last() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 2))
    ref = grant(ledger, fraction("j1", 400)).gpus[0]
    assert grant(ledger, fraction("j2", 500)).gpus[0] == ref

    reserved = ledger.reserve_for_inference("r1", [ref])

    assert reserved.pending == (ref,)  # its tenants still hold it
    assert ledger.gpu(ref).status is GpuStatus.SHARED
    # No new tenant joins a GPU on its way to inference.
    assert grant(ledger, fraction("j3", 100)).gpus[0] != ref
    first = ledger.release("a-j1", T0 + HOUR)
    assert first.kept_for_inference == ()  # j2 still trains there
    assert ledger.gpu(ref).status is GpuStatus.SHARED
    # Restored from its store (allocations, then reservations), it is the same ledger.
    inventory = Inventory((node("n0", Pool.SHARED, 2),))
    restored = Ledger.restore(inventory, ledger.allocations.values(), {ref: "r1"})
    assert [(g.status, g.reserved_for) for g in restored.gpus] == [
        (g.status, g.reserved_for) for g in ledger.gpus
    ]
    last = ledger.release("a-j2", T0 + HOUR)
    assert last.kept_for_inference == (ref,)
    assert ledger.gpu(ref).status is GpuStatus.RESERVED_INFERENCE
    assert ledger.gpu(ref).reserved_for == "r1"


def test_a_gpu_with_a_mig_layout_or_an_inference_tenant_is_not_lent() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 2))
    # Inference asked for the shared pool itself (as a lent GPU's replicas are not).
    serve = replace(fraction("serve", 300, kind=JobKind.INFERENCE), pools=(Pool.SHARED,))
    served = grant(ledger, serve).gpus[0]
    with pytest.raises(GpuNotEligible, match="inference tenant"):
        ledger.reserve_for_inference("r1", [served])
    sliced = grant(ledger, replace(mig_slice("replica", 15), pools=(Pool.SHARED,))).gpus[0]
    assert sliced != served
    with pytest.raises(GpuNotEligible, match="MIG layout"):
        ledger.reserve_for_inference("r1", [sliced])
    assert ledger.lent_gpus() == ()


def test_a_training_tenant_refuses_memory_overcommit_that_inference_accepts() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 2))
    first = grant(ledger, fraction("i1", 300, 50, JobKind.INFERENCE))
    second = grant(ledger, fraction("i2", 300, 40, JobKind.INFERENCE))  # 90 of 96 GiB
    assert second.gpus == first.gpus
    ledger2 = ledger_of(node("n0", Pool.SHARED, 2))
    t1 = grant(ledger2, fraction("t1", 300, 50))
    t2 = grant(ledger2, fraction("t2", 300, 40))  # 90 of 80 GiB: not with training
    assert t2.gpus != t1.gpus


def test_memory_beyond_what_one_gpu_gives_finds_no_gpu() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 2))
    assert ledger.place(fraction("big", 300, 97, JobKind.INFERENCE)) is None


def test_the_ledger_rechecks_a_share_against_the_overcommit_when_it_allocates() -> None:
    ledger = ledger_of(node("n0", Pool.SHARED, 1))
    placement = ledger.place(fraction("t1", 500, 60))
    grant(ledger, fraction("t0", 400, 30))
    assert placement is not None
    with pytest.raises(GpuNotFree):
        ledger.allocate("late", placement, "team", PriorityClass.P1_NORMAL, T0)


def test_a_15_gib_replica_gets_a_2g_20gb_slice_after_a_layout_change() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 2))
    placement = ledger.place(mig_slice("r1", 15))
    assert placement is not None and placement.share is not None
    assert placement.share.profile == "2g.20gb"
    assert placement.layout == ("2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb")
    grant(ledger, mig_slice("r1", 15))
    ref = placement.gpus[0]
    assert ledger.layout_of(ref) == placement.layout
    assert ledger.layout_changed_at(ref) == T0
    second = grant(ledger, mig_slice("r2", 15))
    assert second.gpus == (ref,) and second.layout is None
    assert second.share == GpuShare(285, 20 * GIB, "2g.20gb", 1)


def test_slices_of_a_new_layout_wait_for_the_agent_and_nobody_relays_out_meanwhile() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 2))
    placement = ledger.place(mig_slice("r1", 15))
    assert placement is not None and placement.layout is not None
    ref = placement.gpus[0]
    ledger.change_layout(ref, placement.layout, T0, HOUR)
    assert ledger.layout_pending(ref)
    with pytest.raises(GpuNotFree):
        ledger.allocate("early", placement, "team", PriorityClass.INFERENCE, T0)
    # Another 15 GiB replica waits for those slices instead of re-laying out GPU 1.
    assert ledger.place(mig_slice("r2", 15)) is None
    assert ledger.apply_layout(ref, placement.layout) is not None
    assert ledger.apply_layout(ref, placement.layout) is None  # a repeated report
    again = ledger.place(mig_slice("r2", 15))
    assert again is not None and again.gpus == (ref,) and again.layout is None


def test_a_second_layout_change_within_the_hour_is_refused() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 1))
    grant(ledger, mig_slice("r1", 15))
    ledger.release("a-r1", T0)
    ref = GpuRef("inf", 0)
    with pytest.raises(LayoutChangeRefused, match="next change is allowed"):
        ledger.change_layout(ref, ("7g.80gb",), T0 + timedelta(minutes=30), HOUR)
    # A 40 GiB replica needs a 3g.40gb the layout lacks: it waits instead of changing it.
    assert ledger.place(mig_slice("r2", 40, now=T0 + timedelta(minutes=30))) is None
    later = ledger.place(mig_slice("r2", 40, now=T0 + HOUR))
    assert later is not None and later.layout == ("3g.40gb", "3g.40gb")


def test_a_layout_changes_only_on_an_empty_mig_gpu() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 1), node("t4", Pool.INFERENCE, 1, "T4"))
    grant(ledger, mig_slice("r1", 15))
    with pytest.raises(GpuNotFree):
        ledger.change_layout(GpuRef("inf", 0), (), T0 + 2 * HOUR, HOUR)
    with pytest.raises(GpuNotEligible, match="not MIG-capable"):
        ledger.change_layout(GpuRef("t4", 0), ("1g.10gb",), T0, HOUR)


def test_the_inventory_may_turn_mig_off_for_a_mig_capable_model() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 1, mig=False))
    assert ledger.place(mig_slice("r1", 15)) is None


def test_a_gpu_with_a_mig_layout_is_not_whole_and_its_tenants_are_its_allocations() -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 1))
    grant(ledger, mig_slice("r1", 15))
    assert ledger.place(PlacementRequest("whole", JobKind.INFERENCE, 1)) is None
    assert [a.allocation_id for a in ledger.allocations_on([GpuRef("inf", 0)])] == ["a-r1"]
    assert ledger.capacity()[Pool.INFERENCE].allocated == 1


def test_restore_keeps_layouts_change_times_and_tenants() -> None:
    inventory = Inventory((node("inf", Pool.INFERENCE, 2), node("n0", Pool.SHARED, 1)))
    ledger = Ledger.from_inventory(inventory)
    grant(ledger, mig_slice("r1", 15))
    grant(ledger, fraction("t1", 300))
    # A GPU back to whole keeps the time of its change too.
    ledger.change_layout(GpuRef("inf", 1), ("7g.80gb",), T0, HOUR)
    ledger.change_layout(GpuRef("inf", 1), (), T0 + HOUR, HOUR)
    layouts = {
        slot.ref: (ledger.layout_of(slot.ref), ledger.layout_changed_at(slot.ref))
        for slot in ledger.gpus
        if ledger.layout_changed_at(slot.ref) is not None
    }
    restored = Ledger.restore(inventory, ledger.allocations.values(), {}, layouts=layouts)
    assert restored.shared == ledger.shared
    assert restored.layout_changed_at(GpuRef("inf", 1)) == T0 + HOUR
    assert [s.status for s in restored.gpus] == [s.status for s in ledger.gpus]
    again = grant(restored, mig_slice("r2", 15))
    assert again.gpus == (GpuRef("inf", 0),) and again.share is not None
    assert again.share.slice == 1


# --- invariants under random workloads ----------------------------------------------------

_steps = st.lists(
    st.one_of(
        st.tuples(
            st.just("place"),
            st.integers(min_value=1, max_value=999),
            st.one_of(st.none(), st.integers(min_value=1, max_value=100)),
            st.booleans(),
        ),
        st.tuples(st.just("release"), st.integers(min_value=0, max_value=50), st.none(), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(steps=_steps)
def test_no_shared_gpu_passes_1000_milli_or_its_memory_factor(steps: list[tuple]) -> None:
    ledger = ledger_of(node("inf", Pool.INFERENCE, 2), node("n0", Pool.SHARED, 2))
    factors = Overcommit()
    live: list[str] = []
    for number, (op, a, b, inference) in enumerate(steps):
        if op == "place":
            kind = JobKind.INFERENCE if inference else JobKind.TRAINING
            memory = None if b is None else b * GIB
            request = PlacementRequest(f"j{number}", kind, 1, share=ShareAsk(a, memory, factors))
            placement = ledger.place(request)
            if placement is not None:
                pc = PriorityClass.INFERENCE if inference else PriorityClass.P2_OFFLINE
                ledger.allocate(f"a{number}", placement, "team", pc, T0)
                live.append(f"a{number}")
        elif live:
            ledger.release(live.pop(a % len(live)), T0)
        for ref, shared in ledger.shared.items():
            assert shared.milli_used <= 1000
            limit = factors.limit_mib(shared.memory_mib, shared.any_training)
            assert shared.memory_used <= limit
            assert ledger.gpu(ref).status is GpuStatus.SHARED
            assert shared.tenants  # an empty fractional GPU leaves sharing
    for allocation_id in live:
        ledger.release(allocation_id, T0)
    assert not ledger.shared
    assert all(slot.status is GpuStatus.FREE for slot in ledger.gpus)
