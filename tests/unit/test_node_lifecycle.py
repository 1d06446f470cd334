"""Nodes added, drained, failed, recovered and removed, in the pure ledger and projections."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from gpusched.admission.nodes import newest_checkpoint
from gpusched.contracts.messages import CheckpointInfo, InventoryNode, NodeChange, StageName
from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    GpuNotEligible,
    InvalidRequest,
    JobKind,
    Ledger,
    NodeBusy,
    NodeCondition,
    PlacementRequest,
    PriorityClass,
    UnknownNode,
)
from gpusched.domain.lostwork import lost_gpu_seconds
from gpusched.simcluster.cluster import ClusterView

T0 = datetime(2026, 3, 1, 9, 0, tzinfo=UTC)


def node(name: str, gpus: int, pool: Pool = Pool.SHARED) -> NodeSpec:
    specs = tuple(GpuSpec(name, index, "A100-80GB", 81920) for index in range(gpus))
    return NodeSpec(name, pool, specs, 96000, 1048576)


def training(gpus: int, job_id: str = "job-1") -> PlacementRequest:
    return PlacementRequest(job_id, JobKind.TRAINING, gpus)


def run(ledger: Ledger, gpus: int, job_id: str) -> str:
    placement = ledger.place(training(gpus, job_id))
    assert placement is not None
    ledger.allocate(f"a-{job_id}", placement, "vision", PriorityClass.P1_NORMAL, T0)
    return f"a-{job_id}"


def test_a_drained_node_takes_no_new_placements_but_keeps_what_runs_there() -> None:
    ledger = Ledger.from_inventory(Inventory((node("a", 4), node("b", 2))))
    running = run(ledger, 2, "first")  # best fit: the 2-GPU node b
    assert ledger.allocation(running).nodes == ("b",)
    ledger.set_condition("a", NodeCondition.DRAINED)

    assert ledger.place(training(1, "second")) is None
    assert ledger.free_gpus(Pool.SHARED) == ()
    assert running in ledger.allocations
    ledger.set_condition("a", None)
    placed = ledger.place(training(4, "third"))
    assert placed is not None and placed.nodes == ("a",)


def test_a_placement_proposed_before_a_drain_is_refused_after_it() -> None:
    ledger = Ledger.from_inventory(Inventory((node("a", 2),)))
    placement = ledger.place(training(2))
    assert placement is not None
    ledger.set_condition("a", NodeCondition.DRAINED)
    with pytest.raises(GpuNotEligible, match="drained"):
        ledger.allocate("a-1", placement, "vision", PriorityClass.P1_NORMAL, T0)


def test_a_node_fails_only_once_its_allocations_are_released_and_recovers_empty() -> None:
    ledger = Ledger.from_inventory(Inventory((node("a", 2),)))
    running = run(ledger, 2, "job")
    with pytest.raises(NodeBusy, match=running):
        ledger.set_condition("a", NodeCondition.FAILED)
    ledger.release(running, T0 + timedelta(minutes=5))
    ledger.set_condition("a", NodeCondition.FAILED)

    assert ledger.node_condition("a") is NodeCondition.FAILED
    assert ledger.place(training(1)) is None
    ledger.set_condition("a", None)
    assert ledger.free_gpus(Pool.SHARED) == (GpuRef("a", 0), GpuRef("a", 1))


def test_an_added_node_is_placeable_at_once_and_kept_in_name_order() -> None:
    ledger = Ledger.from_inventory(Inventory((node("b", 1),)))
    added = ledger.add_node(node("a", 2))

    assert added == (GpuRef("a", 0), GpuRef("a", 1))
    assert [slot.ref for slot in ledger.gpus] == [GpuRef("a", 0), GpuRef("a", 1), GpuRef("b", 0)]
    placed = ledger.place(training(2))
    assert placed is not None and placed.nodes == ("a",)
    with pytest.raises(InvalidRequest, match="already exists"):
        ledger.add_node(node("a", 8))


def test_only_an_empty_node_is_removed() -> None:
    ledger = Ledger.from_inventory(Inventory((node("a", 2), node("b", 2))))
    running = run(ledger, 2, "job")
    busy = ledger.allocation(running).nodes[0]
    with pytest.raises(NodeBusy, match="not empty"):
        ledger.remove_node(busy)
    idle = "a" if busy == "b" else "b"

    assert ledger.remove_node(idle) == (GpuRef(idle, 0), GpuRef(idle, 1))
    assert ledger.nodes == (busy,)
    assert ledger.place(training(1, "next")) is None
    with pytest.raises(UnknownNode):
        ledger.node_condition(idle)


def test_a_lent_gpu_keeps_its_node_from_being_removed() -> None:
    ledger = Ledger.from_inventory(Inventory((node("a", 2),)))
    ledger.reserve_for_inference("res-1", [GpuRef("a", 0)])
    with pytest.raises(NodeBusy, match="lent to inference"):
        ledger.remove_node("a")


def test_a_restored_ledger_keeps_drained_and_failed_nodes_out() -> None:
    inventory = Inventory((node("a", 2), node("b", 2), node("c", 2)))
    ledger = Ledger.restore(
        inventory, [], {}, {"a": NodeCondition.DRAINED, "b": NodeCondition.FAILED}
    )
    assert ledger.free_gpus(Pool.SHARED) == (GpuRef("c", 0), GpuRef("c", 1))
    assert ledger.capacity()[Pool.SHARED].total == 6


@given(
    gpus=st.integers(1, 64),
    ran=st.integers(0, 10_000),
    checkpoint_after=st.one_of(st.none(), st.integers(-10_000, 20_000)),
)
def test_lost_work_counts_gpu_seconds_since_the_later_of_grant_and_checkpoint(
    gpus: int, ran: int, checkpoint_after: int | None
) -> None:
    failed_at = T0 + timedelta(seconds=ran)
    checkpoint_at = None if checkpoint_after is None else T0 + timedelta(seconds=checkpoint_after)
    lost = lost_gpu_seconds(gpus, T0, checkpoint_at, failed_at)

    assert 0 <= lost <= gpus * ran
    if checkpoint_after is None or checkpoint_after <= 0:
        assert lost == gpus * ran
    elif checkpoint_after < ran:
        assert lost == gpus * (ran - checkpoint_after)


def test_the_newest_checkpoint_is_the_one_with_the_highest_step() -> None:
    def checkpoint(step: int) -> CheckpointInfo:
        return CheckpointInfo(
            checkpoint_id=f"c{step}", step=step, uri="u", bytes=1, sha256="0" * 64,
            stage=StageName.PERSISTED,
        )  # fmt: skip

    assert newest_checkpoint(None, None) is None
    assert newest_checkpoint(checkpoint(5), None) == checkpoint(5)
    assert newest_checkpoint(checkpoint(5), checkpoint(9)) == checkpoint(9)


def test_the_simulated_cluster_drops_a_failed_node_and_takes_it_back_on_recovery() -> None:
    view = ClusterView()
    inf = InventoryNode(name="inf", pool="inference", gpu_model="A100-80GB", gpus=2)
    shared = InventoryNode(name="sh", pool="shared", gpu_model="A100-80GB", gpus=2)
    view.apply_inventory([inf, shared])
    view.apply_reserved("res-1", [GpuRef("sh", 0)], [])
    assert len(view.serving_gpus()) == 3

    view.apply_node_change(NodeChange.FAILED, shared)
    assert view.serving_gpus() == {GpuRef("inf", 0), GpuRef("inf", 1)}
    assert set(view.nodes) == {"inf"}
    view.apply_node_change(NodeChange.DRAINED, inf)
    assert len(view.serving_gpus()) == 2
    view.apply_node_change(NodeChange.RECOVERED, shared)
    assert set(view.nodes) == {"inf", "sh"}


class NodeLifecycle(RuleBasedStateMachine):
    """Random drains, failures, recoveries, additions, removals, placements and releases:
    no placement lands on a node that is down, and the placement index always agrees
    with a ledger rebuilt from scratch (what a replica restoring from the tables sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.specs = {name: node(name, gpus) for name, gpus in (("n0", 2), ("n1", 4))}
        self.ledger = Ledger.from_inventory(Inventory(tuple(self.specs.values())))
        self.added = 2
        self.jobs = 0
        self.now = T0

    def _names(self) -> list[str]:
        return sorted(self.specs)

    @rule(gpus=st.integers(1, 4))
    def place(self, gpus: int) -> None:
        self.jobs += 1
        placement = self.ledger.place(training(gpus, f"j{self.jobs}"))
        if placement is None:
            return
        assert all(self.ledger.node_condition(n) is None for n in placement.nodes)
        self.ledger.allocate(f"a{self.jobs}", placement, "t", PriorityClass.P1_NORMAL, self.now)

    @rule(pick=st.integers(0, 100))
    def release(self, pick: int) -> None:
        live = sorted(self.ledger.allocations)
        if live:
            self.now += timedelta(seconds=1)
            self.ledger.release(live[pick % len(live)], self.now)

    @rule(pick=st.integers(0, 100), condition=st.sampled_from([None, *NodeCondition]))
    def set_condition(self, pick: int, condition: NodeCondition | None) -> None:
        names = self._names()
        if not names:
            return
        name = names[pick % len(names)]
        if condition is NodeCondition.FAILED:
            self.now += timedelta(seconds=1)
            for allocation in self.ledger.allocations_on_node(name):
                self.ledger.release(allocation.allocation_id, self.now)
        self.ledger.set_condition(name, condition)

    @rule(gpus=st.integers(1, 8))
    def add(self, gpus: int) -> None:
        name = f"n{self.added}"
        self.added += 1
        self.specs[name] = node(name, gpus)
        self.ledger.add_node(self.specs[name])

    @rule(pick=st.integers(0, 100))
    def remove(self, pick: int) -> None:
        names = self._names()
        if not names:
            return
        name = names[pick % len(names)]
        if self.ledger.allocations_on_node(name):
            with pytest.raises(NodeBusy):
                self.ledger.remove_node(name)
            return
        self.ledger.remove_node(name)
        del self.specs[name]

    @invariant()
    def index_agrees_with_a_rebuilt_ledger(self) -> None:
        conditions = {
            name: c for name in self._names() if (c := self.ledger.node_condition(name)) is not None
        }
        rebuilt = Ledger.restore(
            Inventory(tuple(self.specs[name] for name in self._names())),
            self.ledger.allocations.values(),
            {},
            conditions,
        )
        assert self.ledger.free_gpus(Pool.SHARED) == rebuilt.free_gpus(Pool.SHARED)
        assert self.ledger.nodes_free() == rebuilt.nodes_free()
        assert self.ledger.capacity() == rebuilt.capacity()
        down = set(conditions)
        assert not any(ref.node in down for ref in self.ledger.free_gpus(Pool.SHARED))


TestNodeLifecycle = NodeLifecycle.TestCase
TestNodeLifecycle.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
