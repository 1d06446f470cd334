"""The placement score's measures, without I/O: FGD's fragment of a node over GPU, CPU
and memory (Weng et al., ATC'23), the growth a placement causes, and model scarcity."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.domain.fragmentation import (
    WHOLE,
    Fragmentation,
    ModelDemand,
    NodeTable,
    PodType,
    PodTypes,
    model_pressure,
)

GIB = 1024
WHOLE_POD = PodType(1, WHOLE, 8_000, 16 * GIB)
HALF_POD = PodType(1, 500, 4_000, 8 * GIB)
EVERYONE = np.arange(1)


def table_of(
    lefts: Sequence[int], cpu: int = 64_000, memory: int = 64 * GIB, model: str = "A100-80GB"
) -> NodeTable:
    """One node whose GPUs have ``lefts`` compute left."""
    table = NodeTable([("n0", model, len(lefts))])
    table.left[0, : len(lefts)] = lefts
    table.set_host(0, cpu, memory)
    return table


def fragment(table: NodeTable, mix: Sequence[tuple[PodType, float]]) -> float:
    return float(Fragmentation(table, PodTypes(mix)).value[0])


def test_a_node_whose_host_lacks_the_pods_cpu_loses_all_its_free_gpu_capacity() -> None:
    assert fragment(table_of([WHOLE, WHOLE, 300], cpu=7_000), [(WHOLE_POD, 1.0)]) == 2_300


def test_a_node_whose_host_lacks_the_pods_memory_loses_all_its_free_gpu_capacity() -> None:
    assert fragment(table_of([WHOLE, 300], memory=8 * GIB), [(WHOLE_POD, 1.0)]) == 1_300


def test_for_a_whole_gpu_pod_every_partly_used_gpu_is_a_fragment() -> None:
    assert fragment(table_of([WHOLE, WHOLE, 300, 600]), [(WHOLE_POD, 1.0)]) == 900


def test_for_a_fraction_only_gpus_with_less_left_than_it_asks_are_fragments() -> None:
    table = table_of([300, 600])
    assert fragment(table, [(HALF_POD, 1.0)]) == 300
    # No GPU holds 700: the pod cannot run here, so all that is free is lost to it.
    assert fragment(table, [(PodType(1, 700, 0, 0), 1.0)]) == 900


def test_a_gang_larger_than_the_free_whole_gpus_loses_the_whole_node() -> None:
    table = table_of([WHOLE] * 3)
    assert fragment(table, [(PodType(4, WHOLE, 0, 0), 1.0)]) == 3_000
    assert fragment(table, [(PodType(2, WHOLE, 0, 0), 1.0)]) == 0


def test_a_pod_that_accepts_none_of_the_nodes_models_loses_the_whole_node() -> None:
    table = table_of([WHOLE, 400], model="T4")
    assert fragment(table, [(PodType(1, WHOLE, 0, 0, ("V100M16", "V100M32")), 1.0)]) == 1_400
    assert fragment(table, [(PodType(1, WHOLE, 0, 0, ("T4",)), 1.0)]) == 400


def test_the_fragment_is_the_expectation_over_the_workload_mix() -> None:
    mix = [(WHOLE_POD, 0.5), (HALF_POD, 0.5)]
    assert fragment(table_of([WHOLE, 300]), mix) == 0.5 * 300 + 0.5 * 300


def test_a_node_with_nothing_free_has_no_fragment() -> None:
    assert fragment(table_of([0, 0], cpu=0, memory=0), [(WHOLE_POD, 1.0)]) == 0


SHAPES = st.lists(
    st.tuples(st.integers(1, 8), st.integers(1, WHOLE), st.integers(0, 64_000)),
    min_size=1,
    max_size=6,
)


def mix_of(shapes: list[tuple[int, int, int]]) -> list[tuple[PodType, float]]:
    return [
        (PodType(gpus if milli == WHOLE else 1, milli, cpu, 0), 1 / len(shapes))
        for gpus, milli, cpu in shapes
    ]


@given(lefts=st.lists(st.integers(0, WHOLE), min_size=1, max_size=8), cpu=st.integers(0, 128_000),
       shapes=SHAPES)  # fmt: skip
def test_a_fragment_is_never_more_than_what_the_node_has_free(
    lefts: list[int], cpu: int, shapes: list[tuple[int, int, int]]
) -> None:
    value = fragment(table_of(lefts, cpu=cpu), mix_of(shapes))
    assert 0 <= value <= sum(lefts) + 1e-6


@given(
    lefts=st.lists(st.integers(0, WHOLE), min_size=1, max_size=8),
    cpu=st.integers(0, 128_000),
    shapes=SHAPES,
    pod=st.tuples(st.integers(1, WHOLE), st.integers(0, 32_000)),
)
def test_the_growth_of_taking_a_share_is_the_fragment_after_minus_before(
    lefts: list[int], cpu: int, shapes: list[tuple[int, int, int]], pod: tuple[int, int]
) -> None:
    milli, pod_cpu = pod
    gpu = next((i for i, left in enumerate(lefts) if left >= milli), None)
    if gpu is None or pod_cpu > cpu:
        return
    mix = mix_of(shapes)
    table = table_of(lefts, cpu=cpu)
    growth = Fragmentation(table, PodTypes(mix)).growth_share(
        EVERYONE, np.array([lefts[gpu]]), milli, pod_cpu, 0
    )
    after = list(lefts)
    after[gpu] -= milli
    expected = fragment(table_of(after, cpu=cpu - pod_cpu), mix) - fragment(table, mix)
    assert abs(float(growth[0]) - expected) < 1e-6


@given(
    free=st.integers(0, 8), used=st.integers(0, 8), cpu=st.integers(0, 128_000), shapes=SHAPES,
    pod=st.tuples(st.integers(0, 8), st.integers(0, 32_000)),
)  # fmt: skip
def test_the_growth_of_taking_whole_gpus_is_the_fragment_after_minus_before(
    free: int, used: int, cpu: int, shapes: list[tuple[int, int, int]], pod: tuple[int, int]
) -> None:
    gpus, pod_cpu = pod
    if gpus > free or pod_cpu > cpu or not free + used:
        return
    mix = mix_of(shapes)
    table = table_of([WHOLE] * free + [0] * used, cpu=cpu)
    growth = Fragmentation(table, PodTypes(mix)).growth_whole(EVERYONE, gpus, pod_cpu, 0)
    after = table_of([WHOLE] * (free - gpus) + [0] * (used + gpus), cpu=cpu - pod_cpu)
    assert abs(float(growth[0]) - (fragment(after, mix) - fragment(table, mix))) < 1e-6


@given(
    nodes=st.lists(
        st.tuples(st.lists(st.integers(0, WHOLE), min_size=1, max_size=8),
                  st.integers(0, 128_000)),
        min_size=1, max_size=5,
    ),
    shapes=SHAPES,
    pod=st.tuples(st.integers(0, 8), st.integers(0, 32_000)),
)  # fmt: skip
def test_one_node_in_plain_python_scores_as_every_node_at_once(
    nodes: list[tuple[list[int], int]], shapes: list[tuple[int, int, int]], pod: tuple[int, int]
) -> None:
    table = NodeTable([(f"n{i}", "T4", len(lefts)) for i, (lefts, _) in enumerate(nodes)])
    for row, (lefts, cpu) in enumerate(nodes):
        table.left[row, : len(lefts)] = lefts
        table.set_host(row, cpu, 64 * GIB)
    frag = Fragmentation(table, PodTypes(mix_of(shapes)))
    every = np.arange(len(nodes))
    fresh = frag.value.copy()
    frag.refresh([0])  # one node: the plain Python path
    assert np.allclose(frag.value, fresh)
    gpus, cpu = pod
    at_once = frag.growth_whole(every, gpus, cpu, 0)
    one_by_one = [frag.growth_whole_one(row, gpus, cpu, 0) for row in range(len(nodes))]
    assert np.allclose(at_once, one_by_one)


def test_refreshing_a_changed_node_gives_the_fragment_computed_afresh() -> None:
    mix = [(WHOLE_POD, 0.5), (HALF_POD, 0.5)]
    table = NodeTable([("a", "T4", 2), ("b", "T4", 2)])
    for row in (0, 1):
        table.set_host(row, 64_000, 64 * GIB)
    frag = Fragmentation(table, PodTypes(mix))
    table.left[1] = [WHOLE, 300]
    table.set_host(1, 2_000, 64 * GIB)
    frag.refresh([1])
    assert frag.value.tolist() == Fragmentation(table, PodTypes(mix)).value.tolist()


# --- model scarcity ---------------------------------------------------------------------------


def cluster(*nodes: tuple[str, str, int]) -> tuple[NodeTable, np.typing.NDArray[np.float64]]:
    """The table of ``nodes`` and its unallocated compute per GPU model."""
    table = NodeTable(list(nodes))
    return table, Fragmentation(table, PodTypes([(WHOLE_POD, 1.0)])).free_by_model


@pytest.mark.parametrize("changed", [[2], [0, 2, 3, 5, 6, 7]], ids=["one-node", "many-nodes"])
def test_the_free_compute_per_model_follows_the_nodes_a_refresh_recomputes(
    changed: list[int],
) -> None:
    table = NodeTable([(f"n{i}", ("T4", "P100", "V100M16")[i % 3], 4) for i in range(8)])
    frag = Fragmentation(table, PodTypes([(WHOLE_POD, 0.5), (HALF_POD, 0.5)]))
    before = frag.free_by_model.tolist()
    for row in changed:
        table.left[row] = [0, 250, WHOLE, 999] if row % 2 else [-1, -1, 0, 0]
    frag.refresh(changed)

    by_model = np.bincount(table.model, weights=np.maximum(table.left, 0).sum(axis=1))
    assert frag.free_by_model.tolist() == by_model.tolist()
    assert frag.free_by_model.tolist() != before


def test_without_constrained_demand_every_model_is_as_pressed_as_the_average() -> None:
    table, free = cluster(("a", "P100", 2), ("b", "G2", 8))
    assert model_pressure(table, [((), 1.0)], free).tolist() == [1.0, 1.0]


def test_a_small_model_that_constrained_pods_need_is_under_more_pressure() -> None:
    table, free = cluster(("a", "P100", 2), ("b", "G2", 8), ("c", "G2", 8))
    pressure = model_pressure(table, [((), 0.8), (("P100",), 0.2)], free)
    # 20 % of the demand can only use the P100's 2 of 18 GPUs.
    assert pressure[0] > 1.0 > pressure[1] == pressure[2]


def test_a_model_nobody_needs_alone_is_under_less_pressure_than_the_average() -> None:
    table, free = cluster(("a", "T4", 2), ("b", "V100M16", 2))
    pressure = model_pressure(table, [((), 0.5), (("V100M16", "V100M32"), 0.5)], free)
    assert pressure[0] < 1.0 < pressure[1]


def test_model_demand_weighs_requests_by_the_gpu_compute_they_ask_and_forgets_slowly() -> None:
    demand = ModelDemand(halve_every=4)
    assert not demand.constrained and demand.shares() == ()
    demand.observe((), 3 * WHOLE)
    demand.observe(("T4",), WHOLE)
    assert demand.constrained
    assert dict(demand.shares()) == {(): 0.75, ("T4",): 0.25}
    for _ in range(2):
        demand.observe(("T4",), WHOLE)
    # Halved at the fourth observation: the shares stay those of what was asked.
    assert dict(demand.shares()) == {(): 0.5, ("T4",): 0.5}
