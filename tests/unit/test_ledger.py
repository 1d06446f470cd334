from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    AllocationExists,
    AllocationGranted,
    GpuNotEligible,
    GpuNotFree,
    GpuNotReserved,
    GpuSlot,
    GpuStatus,
    InvalidRequest,
    JobKind,
    Ledger,
    LedgerError,
    LedgerEvent,
    Placement,
    PlacementRequest,
    PoolCapacity,
    PriorityClass,
    UnknownAllocation,
    UnknownGpu,
    UnknownReservation,
    first_fit,
)

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)


def make_node(name: str, pool: Pool, gpus: int, model: str = "A100-80GB") -> NodeSpec:
    specs = tuple(GpuSpec(name, index, model, 81920) for index in range(gpus))
    return NodeSpec(name, pool, specs, 96000, 1048576)


def ledger_of(*nodes: NodeSpec) -> Ledger:
    return Ledger.from_inventory(Inventory(nodes))


def refs(node: str, *indices: int) -> tuple[GpuRef, ...]:
    return tuple(GpuRef(node, index) for index in indices)


def training(gpus: int, job_id: str = "job-1", model: str | None = None) -> PlacementRequest:
    return PlacementRequest(job_id, JobKind.TRAINING, gpus, model)


def inference(gpus: int, job_id: str = "svc-1") -> PlacementRequest:
    return PlacementRequest(job_id, JobKind.INFERENCE, gpus)


def grant(
    ledger: Ledger,
    allocation_id: str,
    request: PlacementRequest,
    priority_class: PriorityClass = PriorityClass.P1_NORMAL,
    now: datetime = T0,
) -> AllocationGranted:
    placement = ledger.place(request)
    assert placement is not None, f"no room for {request}"
    return ledger.allocate(allocation_id, placement, "team-a", priority_class, now)


def state_of(ledger: Ledger) -> tuple[tuple[GpuSlot, ...], dict[str, object]]:
    return ledger.gpus, dict(ledger.allocations)


# --- placement ------------------------------------------------------------------------


def test_a_gang_goes_on_the_first_node_in_name_order_that_fits_it_whole() -> None:
    ledger = ledger_of(
        make_node("n3", Pool.SHARED, 8),
        make_node("n1", Pool.SHARED, 4),
        make_node("n2", Pool.SHARED, 8),
    )

    small = ledger.place(training(4))
    large = ledger.place(training(6))

    assert small is not None and small.gpus == refs("n1", 0, 1, 2, 3)
    assert large is not None and large.gpus == refs("n2", 0, 1, 2, 3, 4, 5)
    assert not large.spans_nodes


def test_a_gang_that_fits_no_single_node_spans_nodes_in_order_and_says_so() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4), make_node("b", Pool.SHARED, 4))

    placement = ledger.place(training(6))

    assert placement is not None
    assert placement.gpus == refs("a", 0, 1, 2, 3) + refs("b", 0, 1)
    assert placement.spans_nodes
    assert placement.nodes == ("a", "b")


def test_a_gang_is_placed_whole_or_not_at_all() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4), make_node("b", Pool.SHARED, 4))
    grant(ledger, "alloc-1", training(3, "small"))
    before = state_of(ledger)

    assert ledger.place(training(6, "big")) is None
    assert state_of(ledger) == before


def test_placement_only_uses_gpus_of_the_requested_model() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8, "T4"), make_node("b", Pool.SHARED, 8))

    placement = ledger.place(training(2, model="A100-80GB"))

    assert placement is not None
    assert placement.gpus == refs("b", 0, 1)
    assert placement.model == "A100-80GB"


def test_a_spanning_gang_never_mixes_gpu_models() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4, "T4"), make_node("b", Pool.SHARED, 4))

    assert ledger.place(training(6)) is None


def test_training_uses_shared_and_dedicated_training_gpus_but_never_the_inference_pool() -> None:
    ledger = ledger_of(make_node("inf", Pool.INFERENCE, 8), make_node("trn", Pool.TRAINING, 2))

    assert ledger.place(training(4)) is None
    placement = ledger.place(training(2))
    assert placement is not None and placement.pool is Pool.TRAINING


def test_a_training_request_naming_the_inference_pool_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="training may not use the inference pool"):
        PlacementRequest("job-1", JobKind.TRAINING, 1, pools=(Pool.INFERENCE,))


def test_inference_does_not_take_free_shared_gpus_that_were_not_lent_to_it() -> None:
    ledger = ledger_of(make_node("shared", Pool.SHARED, 8))

    assert ledger.place(inference(1)) is None


def test_a_replacement_strategy_chooses_among_the_eligible_gpus() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4), make_node("b", Pool.SHARED, 4))

    def last_fit(
        free_by_node: Mapping[str, Sequence[GpuSlot]], request: PlacementRequest
    ) -> tuple[GpuRef, ...]:
        slots = [slot for node in sorted(free_by_node) for slot in free_by_node[node]]
        return tuple(slot.ref for slot in slots[-request.gpus :])

    placement = ledger.place(training(2), strategy=last_fit)

    assert placement is not None and placement.gpus == refs("b", 2, 3)


def test_a_strategy_answer_that_breaks_the_gang_rules_is_refused() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))

    def too_few(
        free_by_node: Mapping[str, Sequence[GpuSlot]], request: PlacementRequest
    ) -> tuple[GpuRef, ...]:
        return refs("a", 0)

    with pytest.raises(InvalidRequest, match="must name 2 distinct GPUs"):
        ledger.place(training(2), strategy=too_few)


def test_first_fit_alone_needs_no_ledger() -> None:
    slots = [GpuSlot(GpuRef("x", i), "A100-80GB", 81920, Pool.SHARED) for i in range(3)]

    assert first_fit({"x": slots}, training(2)) == refs("x", 0, 1)
    assert first_fit({"x": slots}, training(4)) is None


# --- allocate and release ---------------------------------------------------------------


def test_allocating_a_placement_emits_a_grant_and_marks_its_gpus() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))
    placement = ledger.place(training(2, "job-7"))
    assert placement is not None

    event = ledger.allocate("alloc-7", placement, "vision", PriorityClass.P2_OFFLINE, T0)

    assert event == AllocationGranted(
        allocation_id="alloc-7",
        job_id="job-7",
        team="vision",
        kind=JobKind.TRAINING,
        priority_class=PriorityClass.P2_OFFLINE,
        gpus=refs("a", 0, 1),
        granted_at=T0,
        model="A100-80GB",
        pool=Pool.SHARED,
    )
    assert [ledger.gpu(ref).status for ref in refs("a", 0, 1, 2)] == [
        GpuStatus.ALLOCATED,
        GpuStatus.ALLOCATED,
        GpuStatus.FREE,
    ]
    assert ledger.allocation("alloc-7") == event.allocation


def test_a_placement_gone_stale_cannot_be_allocated_twice() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))
    placement = ledger.place(training(2))
    assert placement is not None
    ledger.allocate("alloc-1", placement, "team-a", PriorityClass.P1_NORMAL, T0)

    with pytest.raises(GpuNotFree, match=r"GPU a/0 is allocated to 'alloc-1'"):
        ledger.allocate("alloc-2", placement, "team-a", PriorityClass.P1_NORMAL, T0)


def test_an_allocation_id_cannot_be_reused_while_live() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))
    grant(ledger, "alloc-1", training(1))

    with pytest.raises(AllocationExists, match="'alloc-1' already exists"):
        grant(ledger, "alloc-1", training(1, "job-2"))


def test_the_priority_class_must_match_the_kind_of_job() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))

    with pytest.raises(InvalidRequest, match="priority class inference is for inference jobs"):
        grant(ledger, "alloc-1", training(1), PriorityClass.INFERENCE)


def test_times_must_be_timezone_aware() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))

    with pytest.raises(InvalidRequest, match="timezone-aware"):
        grant(ledger, "alloc-1", training(1), now=datetime(2025, 3, 1, 9, 0))


def test_releasing_frees_the_gpus_and_reports_the_allocation_lifetime() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))
    grant(ledger, "alloc-1", training(4))
    later = T0 + timedelta(hours=2)

    event = ledger.release("alloc-1", later)

    assert (event.job_id, event.team, event.gpus) == ("job-1", "team-a", refs("a", 0, 1, 2, 3))
    assert (event.granted_at, event.released_at) == (T0, later)
    assert event.kept_for_inference == ()
    assert ledger.free_gpus(Pool.SHARED) == refs("a", *range(8))
    assert "alloc-1" not in ledger.allocations


def test_releasing_an_unknown_allocation_is_refused_by_name() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))

    with pytest.raises(UnknownAllocation) as raised:
        ledger.release("alloc-404", T0)

    assert str(raised.value) == "unknown allocation 'alloc-404'"


def test_an_allocation_cannot_be_released_before_it_was_granted() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))
    grant(ledger, "alloc-1", training(1))

    with pytest.raises(InvalidRequest, match="before it was granted"):
        ledger.release("alloc-1", T0 - timedelta(seconds=1))


# --- lending to inference ----------------------------------------------------------------


def test_reserving_a_free_shared_gpu_lends_it_to_inference_at_once() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))

    event = ledger.reserve_for_inference("resv-1", refs("a", 0, 1))

    assert event.gpus == refs("a", 0, 1) and event.pending == ()
    assert ledger.gpu(GpuRef("a", 0)).status is GpuStatus.RESERVED_INFERENCE
    assert ledger.free_gpus(Pool.INFERENCE) == refs("a", 0, 1)
    assert ledger.free_gpus(Pool.SHARED) == refs("a", 2, 3)
    assert ledger.place(training(3)) is None
    placement = ledger.place(inference(2))
    assert placement is not None and placement.gpus == refs("a", 0, 1)


def test_a_gpu_reserved_while_training_holds_it_goes_to_inference_on_release() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))
    grant(ledger, "victim", training(2))

    reserved = ledger.reserve_for_inference("resv-1", refs("a", 0, 1, 2))

    assert reserved.pending == refs("a", 0, 1)
    assert ledger.gpu(GpuRef("a", 0)).status is GpuStatus.ALLOCATED
    assert ledger.gpu(GpuRef("a", 0)).reserved_for == "resv-1"
    released = ledger.release("victim", T0 + timedelta(minutes=5))
    assert released.kept_for_inference == refs("a", 0, 1)
    assert [ledger.gpu(ref).status for ref in refs("a", 0, 1, 2)] == [
        GpuStatus.RESERVED_INFERENCE
    ] * 3
    # The whole point: training queued meanwhile cannot grab the freed GPUs.
    assert ledger.place(training(2, "queued")) is None


def test_inference_uses_its_own_gpus_before_lent_ones_and_never_mixes_them_in_a_gang() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4), make_node("inf", Pool.INFERENCE, 2))
    ledger.reserve_for_inference("resv-1", refs("a", 0, 1))

    own = ledger.place(inference(2))
    mixed = ledger.place(inference(3))

    assert own is not None and own.gpus == refs("inf", 0, 1)
    assert mixed is None


def test_training_prefers_the_first_pool_it_names() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4), make_node("b", Pool.TRAINING, 4))
    request = PlacementRequest("job-1", JobKind.TRAINING, 2, pools=(Pool.TRAINING, Pool.SHARED))

    placement = ledger.place(request)

    assert placement is not None and placement.gpus == refs("b", 0, 1)


def test_inference_released_from_a_lent_gpu_leaves_it_lent() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))
    ledger.reserve_for_inference("resv-1", refs("a", 0))
    granted = grant(ledger, "replica-1", inference(1), PriorityClass.INFERENCE)
    assert granted.pool is Pool.INFERENCE

    ledger.release("replica-1", T0 + timedelta(minutes=1))

    assert ledger.gpu(GpuRef("a", 0)).status is GpuStatus.RESERVED_INFERENCE


def test_returning_a_reservation_makes_its_gpus_free_shared_gpus_again() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))
    ledger.reserve_for_inference("resv-1", refs("a", 0, 1))

    event = ledger.return_to_shared(reservation_id="resv-1")

    assert event.reservation_ids == ("resv-1",)
    assert event.gpus == event.freed == refs("a", 0, 1)
    assert ledger.free_gpus(Pool.SHARED) == refs("a", 0, 1, 2, 3)
    assert ledger.lent_gpus() == ()


def test_returning_a_busy_lent_gpu_frees_it_for_training_only_after_release() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))
    grant(ledger, "victim", training(1))
    ledger.reserve_for_inference("resv-1", refs("a", 0, 1))

    event = ledger.return_to_shared(gpus=refs("a", 0, 1))

    assert event.freed == refs("a", 1)
    assert ledger.gpu(GpuRef("a", 0)).status is GpuStatus.ALLOCATED
    ledger.release("victim", T0 + timedelta(minutes=1))
    assert ledger.gpu(GpuRef("a", 0)).status is GpuStatus.FREE


def test_reserving_again_under_the_same_id_only_adds_the_new_gpus() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))
    ledger.reserve_for_inference("resv-1", refs("a", 0))

    event = ledger.reserve_for_inference("resv-1", refs("a", 0, 1))

    assert event.gpus == refs("a", 1)
    assert ledger.reservation("resv-1") == refs("a", 0, 1)


@pytest.mark.parametrize(
    ("gpus", "error", "message"),
    [
        (refs("inf", 0), GpuNotEligible, "GPU inf/0 is in the inference pool"),
        (refs("trn", 0), GpuNotEligible, "GPU trn/0 is in the training pool"),
        (refs("a", 0), GpuNotFree, "GPU a/0 is already reserved for 'resv-0'"),
        (refs("ghost", 0), UnknownGpu, "unknown GPU ghost/0"),
    ],
)
def test_reserving_what_cannot_be_lent_is_refused_and_changes_nothing(
    gpus: tuple[GpuRef, ...], error: type[LedgerError], message: str
) -> None:
    ledger = ledger_of(
        make_node("a", Pool.SHARED, 4),
        make_node("inf", Pool.INFERENCE, 2),
        make_node("trn", Pool.TRAINING, 2),
    )
    ledger.reserve_for_inference("resv-0", refs("a", 0))
    before = state_of(ledger)

    with pytest.raises(error) as raised:
        # A lendable GPU first: the refusal must not keep it half-reserved.
        ledger.reserve_for_inference("resv-1", (GpuRef("a", 3), *gpus))

    assert message in str(raised.value)
    assert state_of(ledger) == before


def test_returning_what_is_not_lent_is_refused() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 4))

    with pytest.raises(UnknownReservation, match="no GPUs are reserved for 'resv-9'"):
        ledger.return_to_shared(reservation_id="resv-9")
    with pytest.raises(GpuNotReserved, match="GPU a/2 is not reserved"):
        ledger.return_to_shared(gpus=refs("a", 2))
    with pytest.raises(InvalidRequest, match="exactly one"):
        ledger.return_to_shared()
    with pytest.raises(InvalidRequest, match="no GPUs given"):
        ledger.reserve_for_inference("resv-1", ())


# --- queries and rebuilding -----------------------------------------------------------------


def test_capacity_counts_each_home_pool_by_status() -> None:
    ledger = ledger_of(make_node("inf", Pool.INFERENCE, 4), make_node("a", Pool.SHARED, 8))
    grant(ledger, "train-1", training(3))
    ledger.reserve_for_inference("resv-1", refs("a", 2, 3, 4))
    grant(ledger, "replica-1", inference(2), PriorityClass.INFERENCE)

    capacity = ledger.capacity()

    assert capacity[Pool.SHARED] == PoolCapacity(
        Pool.SHARED, total=8, allocated=3, reserved=2, free=3, lent=3
    )
    assert capacity[Pool.INFERENCE] == PoolCapacity(
        Pool.INFERENCE, total=4, allocated=2, reserved=0, free=2, lent=0
    )
    assert capacity[Pool.TRAINING].total == 0
    # Idle lent GPUs (a/3, a/4) are free capacity for inference, not for training.
    assert ledger.free_counts() == {Pool.INFERENCE: 4, Pool.SHARED: 3, Pool.TRAINING: 0}


def test_allocations_on_lists_each_holder_once_in_order_of_mention() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 8))
    first = grant(ledger, "alloc-1", training(2, "j1"))
    second = grant(ledger, "alloc-2", training(2, "j2"))

    holders = ledger.allocations_on(refs("a", 3, 0, 1, 2, 7))

    assert [h.allocation_id for h in holders] == [second.allocation_id, first.allocation_id]
    with pytest.raises(UnknownGpu):
        ledger.allocations_on(refs("b", 0))


def test_a_ledger_restored_from_stored_rows_equals_the_live_one() -> None:
    inventory = Inventory((make_node("inf", Pool.INFERENCE, 2), make_node("a", Pool.SHARED, 8)))
    live = Ledger.from_inventory(inventory)
    grant(live, "train-1", training(4))
    live.reserve_for_inference("resv-1", refs("a", 3, 4, 5))
    grant(live, "replica-1", inference(2, "svc-1"), PriorityClass.INFERENCE)
    grant(live, "replica-2", inference(2, "svc-2"), PriorityClass.INFERENCE)
    # a/3 is still training's (a pending reservation); the idle lent a/4 and a/5 serve.
    assert live.allocation("replica-2").gpus == refs("a", 4, 5)

    rows = {slot.ref: slot.reserved_for for slot in live.gpus if slot.reserved_for is not None}
    restored = Ledger.restore(inventory, live.allocations.values(), rows)

    assert state_of(restored) == state_of(live)


def test_an_event_that_does_not_fit_the_ledger_is_refused_on_apply() -> None:
    ledger = ledger_of(make_node("a", Pool.SHARED, 2))
    granted = grant(ledger, "alloc-1", training(2))

    with pytest.raises(AllocationExists):
        ledger.apply(granted)


# --- property: any sequence of commands keeps the books balanced ----------------------------

MACHINE_INVENTORY = Inventory(
    (
        make_node("inf-0", Pool.INFERENCE, 4),
        make_node("sh-0", Pool.SHARED, 4),
        make_node("sh-1", Pool.SHARED, 4),
        make_node("sh-2", Pool.SHARED, 2, "T4"),
        make_node("trn-0", Pool.TRAINING, 2),
    )
)
ALL_REFS = tuple(gpu.ref for gpu in MACHINE_INVENTORY.gpus)
SHARED_REFS = tuple(
    gpu.ref for node in MACHINE_INVENTORY.nodes if node.pool is Pool.SHARED for gpu in node.gpus
)
TRAINING_CLASSES = [PriorityClass.P0_URGENT, PriorityClass.P1_NORMAL, PriorityClass.P2_OFFLINE]
RESERVATION_IDS = ["resv-a", "resv-b", "resv-c"]


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ledger = Ledger.from_inventory(MACHINE_INVENTORY)
        self.events: list[LedgerEvent] = []
        self.now = T0
        self.next_id = 0
        # A store that writes only the GPUs the ledger names as changed (as admission's).
        self.stored = {slot.ref: slot for slot in self.ledger.gpus}

    def tick(self) -> datetime:
        self.now += timedelta(minutes=1)
        return self.now

    def attempt(self, command: object) -> None:
        """Run a command that may be refused; a refusal must leave no trace."""
        assert callable(command)
        before = state_of(self.ledger)
        try:
            event = command()
        except LedgerError:
            assert state_of(self.ledger) == before
        else:
            self.events.append(event)

    @rule(
        kind=st.sampled_from(JobKind),
        gpus=st.integers(min_value=1, max_value=7),
        model=st.sampled_from([None, "A100-80GB", "T4"]),
        training_class=st.sampled_from(TRAINING_CLASSES),
    )
    def place_and_allocate(
        self, kind: JobKind, gpus: int, model: str | None, training_class: PriorityClass
    ) -> None:
        self.next_id += 1
        request = PlacementRequest(f"job-{self.next_id}", kind, gpus, model)
        placement: Placement | None = self.ledger.place(request)
        if placement is None:
            return
        assert len(placement.gpus) == gpus
        priority = PriorityClass.INFERENCE if kind is JobKind.INFERENCE else training_class
        allocation_id = f"alloc-{self.next_id}"
        self.events.append(
            self.ledger.allocate(allocation_id, placement, "team", priority, self.tick())
        )

    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        live = sorted(self.ledger.allocations)
        if live:
            allocation_id = data.draw(st.sampled_from(live))
            self.events.append(self.ledger.release(allocation_id, self.tick()))

    @rule(
        reservation_id=st.sampled_from(RESERVATION_IDS),
        gpus=st.lists(st.sampled_from(SHARED_REFS), min_size=1, max_size=5),
    )
    def reserve_shared(self, reservation_id: str, gpus: list[GpuRef]) -> None:
        self.attempt(lambda: self.ledger.reserve_for_inference(reservation_id, gpus))

    @rule(
        reservation_id=st.sampled_from(RESERVATION_IDS),
        gpus=st.lists(st.sampled_from(ALL_REFS), min_size=1, max_size=3),
    )
    def reserve_any(self, reservation_id: str, gpus: list[GpuRef]) -> None:
        self.attempt(lambda: self.ledger.reserve_for_inference(reservation_id, gpus))

    @rule(reservation_id=st.sampled_from(RESERVATION_IDS))
    def return_reservation(self, reservation_id: str) -> None:
        self.attempt(lambda: self.ledger.return_to_shared(reservation_id=reservation_id))

    @rule(gpus=st.lists(st.sampled_from(ALL_REFS), min_size=1, max_size=4))
    def return_gpus(self, gpus: list[GpuRef]) -> None:
        self.attempt(lambda: self.ledger.return_to_shared(gpus=gpus))

    @invariant()
    def no_gpu_is_in_two_allocations(self) -> None:
        held = [ref for a in self.ledger.allocations.values() for ref in a.gpus]
        assert len(held) == len(set(held))
        for allocation in self.ledger.allocations.values():
            for ref in allocation.gpus:
                slot = self.ledger.gpu(ref)
                assert slot.status is GpuStatus.ALLOCATED
                assert slot.allocation_id == allocation.allocation_id
        allocated = [s for s in self.ledger.gpus if s.status is GpuStatus.ALLOCATED]
        assert len(allocated) == len(held)

    @invariant()
    def per_pool_counts_add_up(self) -> None:
        capacity = self.ledger.capacity()
        for pool, counts in capacity.items():
            assert counts.total == counts.allocated + counts.reserved + counts.free
            assert counts.total == MACHINE_INVENTORY.gpus_in(pool)
            assert counts.reserved <= counts.lent <= counts.total
        assert capacity[Pool.INFERENCE].lent == capacity[Pool.TRAINING].lent == 0
        held = sum(len(a.gpus) for a in self.ledger.allocations.values())
        assert sum(c.allocated for c in capacity.values()) == held
        assert sum(self.ledger.free_counts().values()) == len(ALL_REFS) - held

    @invariant()
    def the_placement_index_matches_the_gpus(self) -> None:
        placeable: dict[str, int] = {}
        for slot in self.ledger.gpus:
            placeable.setdefault(slot.ref.node, 0)
            placeable[slot.ref.node] += slot.placeable
        assert {node.node: node.free for node in self.ledger.nodes_free()} == placeable

    @rule(
        kind=st.sampled_from(JobKind),
        gpus=st.integers(min_value=1, max_value=12),
        model=st.sampled_from([None, "A100-80GB", "T4"]),
    )
    def packing_finds_room_exactly_when_first_fit_does(
        self, kind: JobKind, gpus: int, model: str | None
    ) -> None:
        request = PlacementRequest("probe", kind, gpus, model)
        packed = self.ledger.place(request)
        assert (packed is None) == (self.ledger.place(request, strategy=first_fit) is None)

    @invariant()
    def training_never_holds_an_inference_gpu(self) -> None:
        for allocation in self.ledger.allocations.values():
            if allocation.kind is JobKind.TRAINING:
                pools = {self.ledger.gpu(ref).pool for ref in allocation.gpus}
                assert Pool.INFERENCE not in pools

    @invariant()
    def a_store_writing_only_what_changed_stays_equal_to_the_ledger(self) -> None:
        for ref in self.ledger.take_changed():
            self.stored[ref] = self.ledger.gpu(ref)
        assert self.stored == {slot.ref: slot for slot in self.ledger.gpus}

    @invariant()
    def replaying_the_events_rebuilds_the_same_ledger(self) -> None:
        replica = Ledger.from_inventory(MACHINE_INVENTORY)
        for event in self.events:
            replica.apply(event)
        assert state_of(replica) == state_of(self.ledger)


LedgerMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAnySequenceOfLedgerCommandsKeepsTheBooksBalanced = LedgerMachine.TestCase
