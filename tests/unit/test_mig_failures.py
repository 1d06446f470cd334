"""A MIG layout change that fails, without I/O: the ledger gives the GPU back its previous
layout, the attempt still rations the next change, the waiting replica goes elsewhere,
restore keeps what a failure needs, and the ids and deadlines of pending changes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.admission.mig import change_id_of, overdue, pending_change_id
from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    InvalidRequest,
    JobKind,
    LayoutChangeRefused,
    LayoutFailed,
    Ledger,
    PlacementRequest,
)
from gpusched.domain.sharing import ShareAsk

GIB = 1024
HOUR = timedelta(hours=1)
T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def inference_node(gpus: int) -> NodeSpec:
    specs = tuple(GpuSpec("inf", i, "A100-80GB", 80 * GIB) for i in range(gpus))
    return NodeSpec("inf", Pool.INFERENCE, specs, 64_000, 512 * GIB)


def ledger_of(gpus: int) -> Ledger:
    return Ledger.from_inventory(Inventory((inference_node(gpus),)))


def mig_slice(job: str, memory_gib: float, now: datetime = T0) -> PlacementRequest:
    ask = ShareAsk(None, int(memory_gib * GIB), now=now, change_interval=HOUR)
    return PlacementRequest(job, JobKind.INFERENCE, 1, share=ask)


def relaid_out(ledger: Ledger, memory_gib: float = 15) -> tuple[GpuRef, tuple[str, ...]]:
    """Place a replica that needs a new layout and change it (pending, not yet applied)."""
    placement = ledger.place(mig_slice("r1", memory_gib))
    assert placement is not None and placement.layout is not None
    ref = placement.gpus[0]
    ledger.change_layout(ref, placement.layout, T0, HOUR)
    return ref, placement.layout


def test_a_failed_change_gives_the_gpu_back_its_whole_layout_and_keeps_its_change_time() -> None:
    ledger = ledger_of(1)
    ref, layout = relaid_out(ledger)
    event = ledger.fail_layout(ref)
    assert event == LayoutFailed(ref, layout, ())
    assert ledger.layout_of(ref) == ()
    assert not ledger.layout_pending(ref)
    assert ref not in ledger.shared  # a whole GPU again
    assert ledger.layout_changed_at(ref) == T0
    # The attempt may have reset the GPU: it counts against the once-an-hour limit.
    with pytest.raises(LayoutChangeRefused):
        ledger.change_layout(ref, layout, T0 + timedelta(minutes=10), HOUR)


def test_a_failed_change_from_one_layout_to_another_restores_the_slices_for_use() -> None:
    ledger = ledger_of(1)
    ref = GpuRef("inf", 0)
    ledger.change_layout(ref, ("7g.80gb",), T0 - 2 * HOUR, HOUR)
    ledger.apply_layout(ref, ("7g.80gb",))
    ledger.change_layout(ref, ("3g.40gb", "3g.40gb"), T0, HOUR)
    assert ledger.layout_before(ref) == ("7g.80gb",)
    ledger.fail_layout(ref)
    assert ledger.layout_of(ref) == ("7g.80gb",)
    assert not ledger.layout_pending(ref)
    # The restored slice is usable at once (the agent still has it).
    placed = ledger.place(mig_slice("r2", 60, now=T0))
    assert placed is not None and placed.gpus == (ref,) and placed.layout is None


def test_the_replica_waiting_for_failed_slices_is_placed_on_another_gpu() -> None:
    ledger = ledger_of(2)
    ref, _ = relaid_out(ledger)
    # While the slices are on their way, a second replica waits for them.
    assert ledger.place(mig_slice("r2", 15)) is None
    ledger.fail_layout(ref)
    elsewhere = ledger.place(mig_slice("r2", 15))
    assert elsewhere is not None and elsewhere.gpus != (ref,)
    assert elsewhere.layout is not None  # the other GPU is re-laid out instead


def test_with_no_other_gpu_the_waiting_replica_waits_until_the_interval_has_passed() -> None:
    ledger = ledger_of(1)
    ref, _ = relaid_out(ledger)
    ledger.fail_layout(ref)
    assert ledger.place(mig_slice("r2", 15, now=T0 + timedelta(minutes=5))) is None
    later = ledger.place(mig_slice("r2", 15, now=T0 + HOUR))
    assert later is not None and later.gpus == (ref,)


def test_only_a_pending_change_can_fail() -> None:
    ledger = ledger_of(1)
    ref, layout = relaid_out(ledger)
    ledger.apply_layout(ref, layout)
    with pytest.raises(InvalidRequest, match="no MIG layout change pending"):
        ledger.fail_layout(ref)
    with pytest.raises(InvalidRequest):
        ledger.fail_layout(GpuRef("inf", 0) if ref.index else GpuRef("inf", 1))


def test_restore_keeps_the_layout_a_pending_change_would_fall_back_to() -> None:
    inventory = Inventory((inference_node(1),))
    ref = GpuRef("inf", 0)
    ledger = Ledger.restore(
        inventory,
        [],
        {},
        layouts={ref: (("3g.40gb", "3g.40gb"), T0)},
        pending_layouts={ref},
        layouts_before={ref: ("7g.80gb",)},
    )
    assert ledger.layout_pending(ref)
    assert ledger.fail_layout(ref).restored == ("7g.80gb",)
    assert ledger.layout_of(ref) == ("7g.80gb",)


def test_a_pending_change_is_overdue_only_once_the_timeout_has_passed() -> None:
    ledger = ledger_of(2)
    ref, layout = relaid_out(ledger)
    timeout = timedelta(seconds=300)
    assert overdue(ledger, T0 + timeout - timedelta(microseconds=1), timeout) == []
    assert overdue(ledger, T0 + timeout, timeout) == [ref]
    ledger.apply_layout(ref, layout)
    assert overdue(ledger, T0 + HOUR, timeout) == []


def test_the_pending_change_id_names_the_current_change_only() -> None:
    ledger = ledger_of(1)
    ref, layout = relaid_out(ledger)
    assert pending_change_id(ledger, ref) == change_id_of(ref, T0)
    ledger.apply_layout(ref, layout)
    assert pending_change_id(ledger, ref) is None


@given(
    st.datetimes(max_value=datetime(3000, 1, 1), timezones=st.just(UTC)),
    st.integers(min_value=1, max_value=10**9),
    st.integers(min_value=0, max_value=7),
)
def test_change_ids_differ_between_changes_and_survive_a_round_trip(
    at: datetime, later_us: int, index: int
) -> None:
    ref = GpuRef("inf", index)
    assert change_id_of(ref, at) == change_id_of(ref, at.astimezone(UTC))
    assert change_id_of(ref, at) != change_id_of(ref, at + timedelta(microseconds=later_us))
    assert change_id_of(ref, at) != change_id_of(GpuRef("inf", index + 1), at)
