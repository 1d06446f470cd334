"""Requests as a trace states them: several acceptable GPU models, host CPU and memory,
and jobs without GPUs (host CPU and memory alone, on a GPU node)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from gpusched.domain.inventory import GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    AllocationGranted,
    GpuNotEligible,
    InvalidRequest,
    JobKind,
    Ledger,
    NodeBusy,
    NodeCondition,
    PlacementRequest,
    PriorityClass,
)

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
GIB = 1024


def node(name: str, model: str, gpus: int, cpu: int = 64_000, pool: Pool = Pool.SHARED) -> NodeSpec:
    specs = tuple(GpuSpec(name, index, model, 16 * GIB) for index in range(gpus))
    return NodeSpec(name, pool, specs, cpu, 256 * GIB)


def ledger_of(*nodes: NodeSpec) -> Ledger:
    return Ledger.from_inventory(Inventory(nodes))


def grant(ledger: Ledger, allocation_id: str, request: PlacementRequest) -> AllocationGranted:
    placement = ledger.place(request)
    assert placement is not None, f"no room for {request}"
    priority = (
        PriorityClass.INFERENCE if request.kind is JobKind.INFERENCE else PriorityClass.P1_NORMAL
    )
    return ledger.allocate(allocation_id, placement, "team", priority, T0)


def cpu_only(job_id: str, cpu: int, memory: int = 4 * GIB) -> PlacementRequest:
    return PlacementRequest(job_id, JobKind.TRAINING, 0, cpu_milli=cpu, memory_mib=memory)


def test_a_request_accepting_several_models_gets_one_of_them_and_never_another() -> None:
    ledger = ledger_of(node("a", "P100", 2), node("b", "T4", 2), node("c", "V100M32", 2))
    request = PlacementRequest("j", JobKind.TRAINING, 2, models=("V100M16", "V100M32"))

    granted = grant(ledger, "a-1", request)

    assert granted.model == "V100M32"
    assert ledger.place(PlacementRequest("k", JobKind.TRAINING, 1, models=("V100M32",))) is None


def test_one_accepted_model_reads_as_the_model_of_the_request() -> None:
    request = PlacementRequest("j", JobKind.TRAINING, 1, models=("T4",))
    assert request.model == "T4"
    assert PlacementRequest("j", JobKind.TRAINING, 1, "T4", models=("T4", "P100")).models == (
        "P100",
        "T4",
    )


def test_a_model_outside_the_models_it_names_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="not among its models"):
        PlacementRequest("j", JobKind.TRAINING, 1, "A10", models=("T4",))


def test_a_job_without_gpus_holds_host_cpu_and_memory_on_one_node() -> None:
    ledger = ledger_of(node("a", "T4", 2, cpu=16_000))

    granted = grant(ledger, "cpu-1", cpu_only("j", 12_000))

    assert granted.gpus == () and granted.node == "a" and granted.model == ""
    room = ledger.host_room("a")
    assert room is not None and room.cpu_free == 4_000
    assert ledger.place(cpu_only("k", 8_000)) is None
    ledger.release("cpu-1", T0)
    room = ledger.host_room("a")
    assert room is not None and room.cpu_free == 16_000


def test_a_job_without_gpus_goes_where_no_free_gpu_would_be_stranded() -> None:
    # "busy" has its GPUs all allocated: CPU taken there strands nothing.
    ledger = ledger_of(node("busy", "T4", 2), node("idle", "T4", 2))
    grant(ledger, "gpus", PlacementRequest("g", JobKind.TRAINING, 2, cpu_milli=8_000))
    assert ledger.allocation("gpus").nodes == ("busy",)

    granted = grant(ledger, "cpu", cpu_only("c", 40_000))

    assert granted.node == "busy"


def test_a_job_asking_nothing_at_all_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="needs cpu_milli or memory_mib"):
        PlacementRequest("j", JobKind.TRAINING, 0)
    with pytest.raises(InvalidRequest, match="names no GPU model"):
        PlacementRequest("j", JobKind.TRAINING, 0, "T4", cpu_milli=1_000)
    with pytest.raises(InvalidRequest, match="not negative"):
        PlacementRequest("j", JobKind.TRAINING, -1, cpu_milli=1_000)


def test_a_job_without_gpus_stays_off_nodes_of_other_pools_and_down_nodes() -> None:
    ledger = ledger_of(
        node("inf", "T4", 2, pool=Pool.INFERENCE), node("drained", "T4", 2), node("ok", "T4", 2)
    )
    ledger.set_condition("drained", NodeCondition.DRAINED)

    assert grant(ledger, "c", cpu_only("c", 1_000)).node == "ok"
    inference = PlacementRequest("s", JobKind.INFERENCE, 0, cpu_milli=1_000)
    assert grant(ledger, "s", inference).node == "inf"


def test_a_node_with_a_job_of_its_host_alone_is_neither_failed_nor_removed() -> None:
    ledger = ledger_of(node("a", "T4", 2))
    grant(ledger, "cpu", cpu_only("c", 1_000))

    assert [a.allocation_id for a in ledger.allocations_on_node("a")] == ["cpu"]
    with pytest.raises(NodeBusy):
        ledger.set_condition("a", NodeCondition.FAILED)
    with pytest.raises(NodeBusy):
        ledger.remove_node("a")


def test_a_stale_placement_without_gpus_is_refused_on_allocate() -> None:
    ledger = ledger_of(node("a", "T4", 2, cpu=10_000))
    first = ledger.place(cpu_only("c", 8_000))
    second = ledger.place(cpu_only("d", 8_000))
    assert first is not None and second is not None
    ledger.allocate("c", first, "team", PriorityClass.P1_NORMAL, T0)

    with pytest.raises(GpuNotEligible):
        ledger.allocate("d", second, "team", PriorityClass.P1_NORMAL, T0)


def test_a_ledger_restored_with_jobs_without_gpus_equals_the_live_one() -> None:
    inventory = Inventory((node("a", "T4", 2), node("b", "P100", 2)))
    live = Ledger.from_inventory(inventory)
    grant(
        live, "gpu", PlacementRequest("g", JobKind.TRAINING, 2, models=("P100",), cpu_milli=8_000)
    )
    grant(live, "cpu", cpu_only("c", 30_000))

    restored = Ledger.restore(inventory, live.allocations.values(), {})

    assert restored.allocations == live.allocations
    assert [restored.host_room(n) for n in ("a", "b")] == [live.host_room(n) for n in ("a", "b")]
