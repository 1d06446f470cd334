"""Ingest's pure half: the in-memory telemetry window, the partials it yields per
partition, and the pools summed from them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.contracts.subjects import TELEMETRY_PARTITIONS, telemetry_partition
from gpusched.domain.inventory import GpuRef
from gpusched.ingest.rollup import (
    GpuMember,
    PoolUtilization,
    ServiceReading,
    live_services,
    membership,
    pool_utilization,
    usable_partials,
)
from gpusched.ingest.window import Added, Membership, Partial, TelemetryWindow

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
T0 = NOW.timestamp()
A, B, C = GpuRef("n1", 0), GpuRef("n1", 1), GpuRef("n2", 0)
ALL = range(TELEMETRY_PARTITIONS)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def members_of(members: Sequence[GpuMember], nodes: dict[str, int] | None = None) -> Membership:
    if nodes is None:
        nodes = {}
        for m in members:
            nodes[m.ref.node] = max(nodes.get(m.ref.node, 0), m.ref.index + 1)
    return membership(1, nodes, members)


def pools(
    window: TelemetryWindow, members: Sequence[GpuMember], at: float = T0
) -> tuple[PoolUtilization, ...]:
    sizes = Counter(m.serving_pool for m in members)
    return pool_utilization(dict(sizes), window.partials(at, members_of(members), ALL))


def fill(
    window: TelemetryWindow,
    samples: Iterable[tuple[str, float, dict[int, float]]],
    nodes: dict[str, int],
    now: float = T0,
) -> list[Added]:
    return [
        window.add(node, telemetry_partition(node), nodes[node], now - back, list(u.items()), now)
        for node, back, u in samples
    ]


def by_pool(result: tuple[PoolUtilization, ...]) -> dict[str, PoolUtilization]:
    return {p.pool: p for p in result}


NODES = {"n1": 2, "n2": 1}
MEMBERS = [GpuMember(A, "inference"), GpuMember(B, "inference"), GpuMember(C, "shared")]


def test_a_gpu_utilization_is_the_mean_of_its_samples_inside_the_window() -> None:
    window = TelemetryWindow(30)
    fill(window, [("n1", 1, {0: 0.2}), ("n1", 10, {0: 0.6, 1: 0.5})], NODES)
    inference = by_pool(pools(window, MEMBERS))["inference"]
    assert (inference.reporting_gpus, inference.util) == (2, pytest.approx((0.4 + 0.5) / 2))


def test_samples_at_or_before_the_window_start_are_late_and_left_out() -> None:
    window = TelemetryWindow(30)
    added = fill(window, [("n2", 30, {0: 1.0}), ("n2", 31, {0: 1.0}), ("n2", 29, {0: 0.1})], NODES)
    assert added == [Added.LATE, Added.LATE, Added.ACCEPTED]
    assert by_pool(pools(window, MEMBERS))["shared"].util == pytest.approx(0.1)


def test_samples_leave_the_window_as_time_passes() -> None:
    window = TelemetryWindow(30)
    fill(window, [("n2", 0, {0: 0.9})], NODES)
    assert by_pool(pools(window, MEMBERS, at=T0 + 29))["shared"].reporting_gpus == 1
    assert by_pool(pools(window, MEMBERS, at=T0 + 30))["shared"].reporting_gpus == 0
    assert len(window) == 0 and window.nodes == 0


def test_a_sample_from_a_clock_slightly_ahead_still_counts() -> None:
    window = TelemetryWindow(30)
    fill(window, [("n2", -2, {0: 0.7})], NODES)
    assert by_pool(pools(window, MEMBERS))["shared"].util == pytest.approx(0.7)


def test_a_node_sample_is_identified_by_node_and_time() -> None:
    """A second sample of a node with a time already held is a duplicate, whatever it
    says; one that comes late but inside the window takes its place in time order."""
    window = TelemetryWindow(30)
    added = fill(
        window,
        [("n2", 5, {0: 0.2}), ("n2", 5, {0: 1.0}), ("n2", 1, {0: 0.4}), ("n2", 3, {0: 0.6})],
        NODES,
    )
    assert added == [Added.ACCEPTED, Added.DUPLICATE, Added.ACCEPTED, Added.ACCEPTED]
    assert by_pool(pools(window, MEMBERS))["shared"].util == pytest.approx(0.4)
    assert len(window) == 3


def test_a_pool_utilization_is_the_mean_over_the_gpus_that_reported() -> None:
    window = TelemetryWindow(30)
    fill(window, [("n1", 1, {0: 0.9}), ("n2", 1, {0: 0.4})], NODES)
    assert pools(window, MEMBERS) == (
        PoolUtilization("inference", gpus=2, util=pytest.approx(0.9), reporting_gpus=1),
        PoolUtilization("shared", gpus=1, util=pytest.approx(0.4), reporting_gpus=1),
    )


def test_a_lent_gpu_serves_inference_unless_training_still_holds_it() -> None:
    members = [
        GpuMember(A, "inference"),
        GpuMember(B, "shared", lent=True),
        GpuMember(C, "shared", lent=True, pending=True),
    ]
    window = TelemetryWindow(30)
    fill(window, [("n1", 1, {0: 0.8, 1: 0.6}), ("n2", 1, {0: 0.1})], NODES)
    result = by_pool(pools(window, members))
    assert (result["inference"].gpus, result["inference"].util) == (2, pytest.approx(0.7))
    assert (result["shared"].gpus, result["shared"].util) == (1, pytest.approx(0.1))


def test_inference_and_shared_are_always_reported_and_other_pools_when_present() -> None:
    window = TelemetryWindow(30)
    fill(window, [("n1", 1, {0: 0.5})], NODES)
    assert pools(window, [GpuMember(A, "training")]) == (
        PoolUtilization("inference", 0, 0.0, 0),
        PoolUtilization("shared", 0, 0.0, 0),
        PoolUtilization("training", 1, pytest.approx(0.5), 1),
    )


def test_gpus_of_a_node_without_pool_gpus_keep_their_samples_but_do_not_count() -> None:
    """A failed node stays in the inventory (its samples are accepted) while its GPUs
    are in no pool; they count again once it is back."""
    window = TelemetryWindow(30)
    fill(window, [("n2", 1, {0: 0.2})], NODES)
    failed = membership(1, NODES, [GpuMember(A, "shared")])
    assert pool_utilization({"shared": 1}, window.partials(T0, failed, ALL))[1].reporting_gpus == 0
    back = by_pool(pools(window, MEMBERS))["shared"]
    assert (back.reporting_gpus, back.util) == (1, pytest.approx(0.2))


def test_partials_cover_every_owned_partition_and_pool_and_only_those() -> None:
    window = TelemetryWindow(30)
    fill(window, [("n1", 1, {0: 0.5}), ("n2", 1, {0: 0.3})], NODES)
    mine = [telemetry_partition("n1")]
    partials = window.partials(T0, members_of(MEMBERS), mine)
    assert {(p.partition, p.pool) for p in partials} == {
        (mine[0], "inference"),
        (mine[0], "shared"),
    }
    assert sum(p.reporting for p in partials) == (2 if telemetry_partition("n2") == mine[0] else 1)


def test_unusable_partials_are_set_aside_and_counted() -> None:
    good = Partial(0, "shared", 1.5, 2)
    bad = [
        Partial(1, "shared", math.nan, 1),
        Partial(2, "shared", math.inf, 1),
        Partial(3, "shared", -0.1, 1),
        Partial(4, "shared", 3.0, 2),
        Partial(5, "shared", 0.0, -1),
    ]
    assert usable_partials([good, *bad]) == ([good], len(bad))


def test_a_pool_never_reports_more_gpus_than_it_has() -> None:
    [_, shared] = pool_utilization({"shared": 1}, [Partial(0, "shared", 0.5, 1)] * 2)
    assert (shared.gpus, shared.reporting_gpus, shared.util) == (1, 1, pytest.approx(0.5))


def test_nats_partition_mapping_is_fnv1a_of_the_node_name() -> None:
    # FNV-1a 32 test vectors ("a", "foobar"); the stream's transform takes it modulo 16
    # (tests/service/test_ingest_service.py checks the server agrees).
    assert telemetry_partition("a") == 0xE40C292C % TELEMETRY_PARTITIONS
    assert telemetry_partition("foobar") == 0xBF9CF968 % TELEMETRY_PARTITIONS
    assert {telemetry_partition(f"n{i}") for i in range(200)} == set(ALL)


samples = st.lists(
    st.tuples(
        st.sampled_from(["n1", "n2", "n3", "n4"]),
        st.integers(min_value=0, max_value=40),
        st.integers(min_value=0, max_value=3),
        st.floats(min_value=0.0, max_value=1.0),
    ),
    max_size=60,
)


@given(samples, st.integers(min_value=0, max_value=40))
def test_the_running_window_equals_the_mean_of_the_samples_in_it(
    drawn: list[tuple[str, int, int, float]], later: int
) -> None:
    """Whatever the order, duplicates and expiry, each GPU's figure is the plain mean of
    the first sample of each (node, time) still inside the window."""
    nodes = dict.fromkeys(["n1", "n2", "n3", "n4"], 4)
    members = [GpuMember(GpuRef(n, i), "shared") for n in nodes for i in range(4)]
    window = TelemetryWindow(30)
    kept: dict[tuple[str, float], tuple[int, float]] = {}
    for node, back, index, util in drawn:
        at = T0 - back
        if window.add(node, 0, 4, at, [(index, util)], T0) is Added.ACCEPTED:
            kept[node, at] = (index, util)
    flush_at = T0 + later
    per_gpu: dict[tuple[str, int], list[float]] = {}
    for (node, at), (index, util) in kept.items():
        if at > flush_at - 30:
            per_gpu.setdefault((node, index), []).append(util)
    [_, shared] = pools(window, members, at=flush_at)
    assert shared.reporting_gpus == len(per_gpu)
    expected = sum(sum(v) / len(v) for v in per_gpu.values()) / len(per_gpu) if per_gpu else 0.0
    assert shared.util == pytest.approx(expected, abs=1e-9)
    assert 0.0 <= shared.util <= 1.0


@given(samples, st.integers(min_value=1, max_value=16))
def test_replicas_splitting_the_partitions_sum_to_one_replica_holding_them_all(
    drawn: list[tuple[str, int, int, float]], replicas: int
) -> None:
    nodes = dict.fromkeys(["n1", "n2", "n3", "n4"], 4)
    members = [GpuMember(GpuRef(n, i), "shared") for n in nodes for i in range(4)]
    m = membership(1, nodes, members)
    whole = TelemetryWindow(30)
    parts = [TelemetryWindow(30) for _ in range(replicas)]
    for node, back, index, util in drawn:
        partition = telemetry_partition(node)
        for w in (whole, parts[partition % replicas]):
            w.add(node, partition, 4, T0 - back, [(index, util)], T0)
    split = [
        p
        for r, w in enumerate(parts)
        for p in w.partials(T0, m, [q for q in ALL if q % replicas == r])
    ]
    [_, together] = pool_utilization({"shared": 16}, whole.partials(T0, m, ALL))
    [_, apart] = pool_utilization({"shared": 16}, split)
    assert apart.reporting_gpus == together.reporting_gpus
    assert apart.util == pytest.approx(together.util, abs=1e-12)


def test_each_service_shows_its_latest_stats_and_stale_services_drop_out() -> None:
    latest = [
        ServiceReading("chat", ago(5), 100.0, 3, 50),
        ServiceReading("chat", ago(1), 120.0, 4, 60),
        ServiceReading("embed", ago(90), 10.0, 0, 5),
    ]
    assert live_services(latest, NOW, stale_after_s=60) == (
        ServiceReading("chat", ago(1), 120.0, 4, 60),
    )
