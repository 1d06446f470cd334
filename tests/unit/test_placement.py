"""gpusched's packing: best fit, NVLink islands, host CPU/memory, fragmentation."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    GpuNotEligible,
    JobKind,
    Ledger,
    PlacementRequest,
    PriorityClass,
    first_fit,
)
from gpusched.domain.placement import (
    HostRoom,
    NodeFree,
    choose_in_node,
    fragmented_gpus,
    per_gpu,
    stranded,
)

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)


def node(
    name: str,
    gpus: int,
    *,
    cpu_milli: int = 96_000,
    memory_mib: int = 1_048_576,
    islands: tuple[tuple[int, ...], ...] = (),
    model: str = "A100-80GB",
) -> NodeSpec:
    specs = tuple(GpuSpec(name, index, model, 81920) for index in range(gpus))
    return NodeSpec(name, Pool.SHARED, specs, cpu_milli, memory_mib, islands)


def ledger_of(*nodes: NodeSpec) -> Ledger:
    return Ledger.from_inventory(Inventory(nodes))


def training(
    gpus: int, job_id: str = "job", *, cpu: int = 0, memory: int = 0, span: bool = True
) -> PlacementRequest:
    return PlacementRequest(
        job_id, JobKind.TRAINING, gpus, cpu_milli=cpu, memory_mib=memory, may_span_nodes=span
    )


def take(ledger: Ledger, request: PlacementRequest, allocation_id: str) -> tuple[GpuRef, ...]:
    placement = ledger.place(request)
    assert placement is not None, f"no room for {request}"
    ledger.allocate(allocation_id, placement, "team", PriorityClass.P1_NORMAL, T0)
    return placement.gpus


def test_a_small_job_fills_a_partly_used_node_and_leaves_the_empty_one_whole() -> None:
    ledger = ledger_of(node("a", 8), node("b", 8))
    take(ledger, training(6, "big"), "alloc-big")  # best fit: a (both empty, name order)

    small = take(ledger, training(2, "small"), "alloc-small")

    assert {ref.node for ref in small} == {"a"}
    assert [n.free for n in ledger.nodes_free()] == [0, 8]


def test_first_fit_would_have_broken_the_empty_node_where_packing_does_not() -> None:
    ledger = ledger_of(node("a", 4), node("b", 8), node("c", 2))

    packed = ledger.place(training(2))
    first = ledger.place(training(2), strategy=first_fit)

    assert packed is not None and {ref.node for ref in packed.gpus} == {"c"}
    assert first is not None and {ref.node for ref in first.gpus} == {"a"}


def test_a_gang_stays_inside_one_nvlink_island_even_on_a_looser_node() -> None:
    split = node("a", 4, islands=((0, 1), (2, 3)))
    whole = node("b", 8, islands=((0, 1, 2, 3), (4, 5, 6, 7)))
    ledger = ledger_of(split, whole)

    placement = ledger.place(training(3))

    assert placement is not None and placement.gpus == tuple(GpuRef("b", i) for i in (0, 1, 2))


def test_inside_a_node_the_fullest_island_that_still_fits_is_used() -> None:
    ledger = ledger_of(node("a", 8, islands=((0, 1, 2, 3), (4, 5, 6, 7))))
    take(ledger, training(2, "first"), "alloc-1")  # island 0 keeps 2 free

    second = take(ledger, training(2, "second"), "alloc-2")

    assert second == (GpuRef("a", 2), GpuRef("a", 3))


def test_a_gang_that_fits_no_node_spans_the_fewest_nodes() -> None:
    ledger = ledger_of(node("a", 2), node("b", 8), node("c", 4), node("d", 4))
    take(ledger, training(4, "half"), "alloc-half")  # best fit: c (exactly 4)

    placement = ledger.place(training(10))

    assert placement is not None and placement.spans_nodes
    assert placement.nodes == ("a", "b")


def test_a_job_that_may_not_span_nodes_waits_instead() -> None:
    ledger = ledger_of(node("a", 4), node("b", 4))

    assert ledger.place(training(6, span=False)) is None
    assert ledger.place(training(6, span=False), strategy=first_fit) is None


def test_a_node_without_host_cpu_left_is_skipped_and_the_cpu_comes_back_on_release() -> None:
    ledger = ledger_of(node("a", 8, cpu_milli=16_000), node("b", 8, cpu_milli=96_000))
    hog = ledger.place(training(1, "hog", cpu=16_000), strategy=first_fit)
    assert hog is not None and hog.nodes == ("a",)
    ledger.allocate("alloc-hog", hog, "team", PriorityClass.P1_NORMAL, T0)
    room = ledger.host_room("a")
    assert room is not None and room.cpu_free == 0

    placement = ledger.place(training(1, cpu=1_000))

    assert placement is not None and placement.nodes == ("b",)
    assert ledger.stranded_gpus() == 7
    ledger.release("alloc-hog", T0)
    room = ledger.host_room("a")
    assert room is not None and room.cpu_free == 16_000 and ledger.stranded_gpus() == 0


def test_a_placement_the_host_cannot_feed_is_refused() -> None:
    ledger = ledger_of(node("a", 8, cpu_milli=8_000))

    def on_a(free_by_node: object, request: PlacementRequest) -> tuple[GpuRef, ...]:
        return (GpuRef("a", 0),)

    with pytest.raises(GpuNotEligible, match="host CPU or memory"):
        ledger.place(training(1, cpu=9_000), strategy=on_a)


def test_among_equally_tight_nodes_the_one_it_strands_nothing_on_wins() -> None:
    # Both nodes have 2 free GPUs; on "a" a CPU-heavy job would leave its last GPU
    # without CPU, on "b" there is CPU to spare.
    ledger = ledger_of(node("a", 2, cpu_milli=16_000), node("b", 2, cpu_milli=64_000))

    placement = ledger.place(training(1, cpu=15_000))

    assert placement is not None and placement.nodes == ("b",)


def test_choose_in_node_crosses_as_few_island_boundaries_as_it_can() -> None:
    groups = ((0, 1), (2, 3, 4), (5,))

    assert choose_in_node([0, 1, 2, 3, 4, 5], 2, groups) == ((0, 1), True)
    assert choose_in_node([0, 2, 3, 4, 5], 4, groups) == ((0, 2, 3, 4), False)
    assert choose_in_node([3, 7], 2, ()) == ((3, 7), True)


def test_fragmented_gpus_count_only_partly_used_nodes_that_lost_the_typical_gang() -> None:
    nodes = [
        NodeFree("empty", 8, 8),
        NodeFree("broken", 5, 8),
        NodeFree("small-half", 1, 2),
        NodeFree("small-empty", 2, 2),
        NodeFree("full", 0, 8),
    ]

    assert fragmented_gpus(nodes, typical_gang=8) == 5 + 1


def test_stranded_gpus_are_those_the_leftover_cpu_cannot_feed() -> None:
    room = HostRoom(cpu_total=96_000, memory_total=1024, cpu_free=6_000, memory_free=1024)

    # 6 cores feed 2 GPUs at a quarter of the node's 12 cores per GPU.
    assert stranded(4, room, gpus_total=8) == 2
    assert stranded(4, None, gpus_total=8) == 0
    assert per_gpu(10_000, 3) == 3_334


@given(
    sizes=st.lists(st.sampled_from([1, 2, 4, 8]), min_size=1, max_size=6),
    jobs=st.lists(st.integers(min_value=1, max_value=8), max_size=12),
    wanted=st.integers(min_value=1, max_value=8),
)
def test_a_gang_that_fits_one_node_stays_on_one_node_and_takes_an_exact_fit_if_there_is_one(
    sizes: list[int], jobs: list[int], wanted: int
) -> None:
    ledger = Ledger.from_inventory(
        Inventory(tuple(node(f"n{i}", size) for i, size in enumerate(sizes)))
    )
    for number, gpus in enumerate(jobs):
        placement = ledger.place(training(gpus, f"job-{number}"))
        if placement is not None:
            ledger.allocate(f"a-{number}", placement, "t", PriorityClass.P1_NORMAL, T0)
    free = {n.node: n.free for n in ledger.nodes_free()}
    fitting = [count for count in free.values() if count >= wanted]

    placement = ledger.place(training(wanted))

    if fitting:
        assert placement is not None and not placement.spans_nodes
        # Filling a node leaves nothing to fragment: no other node scores better.
        if wanted in fitting:
            assert free[placement.nodes[0]] == wanted
    else:
        assert (placement is None) == (sum(free.values()) < wanted)
