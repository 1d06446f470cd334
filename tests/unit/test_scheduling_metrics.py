"""The scheduling metrics counted at scrape time, from in-memory state, without I/O: the
GPU states partition every GPU, the queue gauges name the oldest job's wait per team
and class, a standby replica reports nothing, and one failing source costs only its
own metrics."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from tests.unit.test_admission_planning import job
from tests.unit.test_ledger import ledger_of, make_node

from gpusched.admission.index import QueueIndex
from gpusched.admission.metrics import (
    SCRAPED_FAMILIES,
    SchedulerView,
    gpu_counts,
    queue_families,
)
from gpusched.contracts.messages import (
    GpuReading,
    GpuSample,
    PoolSnapshot,
    PoolState,
    ServiceState,
)
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import JobKind, NodeCondition, PlacementRequest, PriorityClass
from gpusched.infra import metrics
from gpusched.ingest.metrics import SCRAPED_FAMILIES as INGEST_FAMILIES
from gpusched.ingest.metrics import GpuReadings, gpu_families, snapshot_families
from gpusched.ingest.reader import SampleView
from gpusched.ingest.window import TelemetryWindow

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)


def samples(families: list[Metric]) -> dict[tuple[str, tuple[str, ...]], float]:
    return {
        (s.name, tuple(s.labels.values())): s.value for family in families for s in family.samples
    }


def test_every_gpu_is_in_exactly_one_state_of_its_home_pool() -> None:
    ledger = ledger_of(
        make_node("inf-0", Pool.INFERENCE, 2),
        make_node("shared-0", Pool.SHARED, 4),
        make_node("shared-1", Pool.SHARED, 2),
        make_node("shared-2", Pool.SHARED, 2),
    )
    training = ledger.place(PlacementRequest("job-a", JobKind.TRAINING, 2))
    assert training is not None and training.nodes == ("shared-1",)
    ledger.allocate("alloc-a", training, "vision", PriorityClass.P1_NORMAL, T0)
    serving = ledger.place(PlacementRequest("svc-a", JobKind.INFERENCE, 1))
    assert serving is not None
    ledger.allocate("alloc-s", serving, "search", PriorityClass.INFERENCE, T0)
    # Lend a GPU training still holds and an idle one; drain an idle node.
    ledger.reserve_for_inference("r-1", [GpuRef("shared-1", 0), GpuRef("shared-0", 0)])
    ledger.set_condition("shared-2", NodeCondition.DRAINED)

    counts = gpu_counts(ledger)

    assert counts == {
        ("inference", "free"): 1,
        ("inference", "used"): 1,
        ("inference", "lent"): 0,
        ("inference", "reserved"): 0,
        ("inference", "shared"): 0,
        ("inference", "unavailable"): 0,
        ("shared", "free"): 3,
        ("shared", "used"): 1,
        ("shared", "lent"): 1,
        ("shared", "reserved"): 1,
        ("shared", "shared"): 0,
        ("shared", "unavailable"): 2,
    }
    assert sum(counts.values()) == len(ledger.gpus)


def test_the_queue_gauges_give_each_team_and_class_its_depth_and_oldest_wait() -> None:
    queue = QueueIndex(
        [
            job("job-1", 1, 0, team="vision", priority="p1-normal"),
            job("job-2", 1, 30, team="vision", priority="p1-normal"),
            job("job-3", 1, 60, team="nlp", priority="p2-offline"),
        ]
    )
    now = (T0 + timedelta(seconds=100)).timestamp()

    got = samples(queue_families(queue, now))

    assert got == {
        ("gpusched_queue_jobs", ("vision", "p1-normal")): 2,
        ("gpusched_queue_jobs", ("nlp", "p2-offline")): 1,
        ("gpusched_queue_wait_seconds", ("vision", "p1-normal")): 100,
        ("gpusched_queue_wait_seconds", ("nlp", "p2-offline")): 40,
    }


def test_only_the_replica_that_schedules_reports_the_queue_and_the_gpus() -> None:
    ledger = ledger_of(make_node("shared-0", Pool.SHARED, 2))
    view = SchedulerView(lambda: T0, leader_for_s=30.0)
    view.queue, view.ledger = QueueIndex([job("job-1", 1, 0)]), ledger
    assert list(view.families()) == []  # never ticked: a standby

    view.ticked_at = time.monotonic()
    assert {f.name for f in view.families()} == set(SCRAPED_FAMILIES)

    view.ticked_at = time.monotonic() - 31  # the lease moved to another replica
    assert list(view.families()) == []


def test_while_a_pass_plans_the_gpu_counts_taken_before_it_are_reported() -> None:
    ledger = ledger_of(make_node("shared-0", Pool.SHARED, 2))
    view = SchedulerView(lambda: T0, leader_for_s=30.0, ledger=ledger, ticked_at=time.monotonic())
    before = samples(list(view.families()))
    placement = ledger.place(PlacementRequest("job-a", JobKind.TRAINING, 2))
    assert placement is not None
    view.planning = True
    ledger.allocate("alloc-a", placement, "vision", PriorityClass.P1_NORMAL, T0)
    assert samples(list(view.families())) == before
    view.planning = False
    assert samples(list(view.families()))[("gpusched_gpus", ("shared", "used"))] == 2


def test_the_snapshot_gauges_carry_pool_utilization_and_each_services_p99() -> None:
    snapshot = PoolSnapshot(
        time=T0,
        window_s=30,
        pools=[PoolState(pool="inference", gpus=24, util=0.92, reporting_gpus=24)],
        services=[ServiceState(service="chat", p99_ms=310.0, queue_depth=7, requests=900)],
    )
    got = samples(snapshot_families(snapshot))
    assert got[("gpusched_pool_utilization", ("inference",))] == 0.92
    assert got[("gpusched_pool_gpus", ("inference",))] == 24
    assert got[("gpusched_inference_p99_ms", ("chat",))] == 310.0
    assert {name for name, _ in got} <= set(INGEST_FAMILIES)


def test_a_failing_scrape_source_costs_its_own_metrics_not_the_scrape() -> None:
    registry = CollectorRegistry()
    sources = metrics._ScrapeSources()
    registry.register(sources)

    def broken_copy() -> metrics.Build:
        raise RuntimeError("a bug in one service's gauges")

    def broken_build() -> metrics.Build:
        def build() -> list[Metric]:
            raise RuntimeError("a bug in building them")

        return build

    def fine() -> metrics.Build:
        family = metrics.gauge_family("gpusched_test_gauge", "a gauge", "pool")
        family.add_metric(["shared"], 3)
        return lambda: [family]

    sources.sources.update(copy=broken_copy, build=broken_build, fine=fine)
    sources.prepare()

    text = generate_latest(registry).decode()

    assert 'gpusched_test_gauge{pool="shared"} 3.0' in text


def test_the_gpu_gauges_read_the_window_means_and_the_newest_memory_of_nodes_in_it() -> None:
    window = TelemetryWindow(30.0)
    now = T0.timestamp()
    window.add("shared-0", 0, 2, now - 2, [(0, 0.2), (1, 0.9)], now)
    window.add("shared-0", 0, 2, now - 1, [(0, 0.4), (1, 0.7)], now)
    readings = GpuReadings(
        means=list(window.gpu_means()),
        serving={"shared-0": ("shared", None)},
        newest=[
            SampleView.of(
                GpuSample(
                    node="shared-0",
                    time=T0,
                    gpus=[
                        GpuReading(
                            index=0,
                            util=0.4,
                            mem_used_mib=72_000,
                            mem_total_mib=80_000,
                            temp_c=50.0,
                            power_w=200.0,
                        ),
                    ],
                )
            )
        ],
    )

    got = samples(gpu_families(readings))

    assert got[("gpusched_gpu_utilization", ("shared-0", "0", "shared"))] == pytest.approx(0.3)
    assert got[("gpusched_gpu_utilization", ("shared-0", "1", "none"))] == pytest.approx(0.8)
    assert got[("gpusched_gpu_memory_used_ratio", ("shared-0", "0"))] == 0.9
