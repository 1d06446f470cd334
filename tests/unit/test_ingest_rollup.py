from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.domain.inventory import GpuRef
from gpusched.ingest.rollup import (
    GpuMember,
    PoolUtilization,
    Reading,
    ServiceReading,
    gpu_means,
    live_services,
    pool_utilization,
)

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)
A, B, C = GpuRef("n1", 0), GpuRef("n1", 1), GpuRef("n2", 0)


def ago(seconds: float) -> datetime:
    return NOW - timedelta(seconds=seconds)


def test_a_gpu_utilization_is_the_mean_of_its_samples_inside_the_window() -> None:
    readings = [Reading(A, ago(1), 0.2), Reading(A, ago(10), 0.6), Reading(B, ago(5), 0.5)]
    assert gpu_means(readings, NOW, 30) == {A: pytest.approx(0.4), B: 0.5}


def test_samples_at_or_before_the_window_start_are_left_out() -> None:
    readings = [Reading(A, ago(30), 1.0), Reading(A, ago(31), 1.0), Reading(A, ago(29), 0.1)]
    assert gpu_means(readings, NOW, 30) == {A: 0.1}


def test_a_sample_from_a_clock_slightly_ahead_still_counts() -> None:
    assert gpu_means([Reading(A, NOW + timedelta(seconds=2), 0.7)], NOW, 30) == {A: 0.7}


def test_a_pool_utilization_is_the_mean_over_the_gpus_that_reported() -> None:
    members = [GpuMember(A, "inference"), GpuMember(B, "inference"), GpuMember(C, "shared")]
    result = pool_utilization(members, {A: 0.9, C: 0.4})
    assert result == (
        PoolUtilization("inference", gpus=2, util=0.9, reporting_gpus=1),
        PoolUtilization("shared", gpus=1, util=0.4, reporting_gpus=1),
    )


def test_a_lent_gpu_serves_inference_unless_training_still_holds_it() -> None:
    members = [
        GpuMember(A, "inference"),
        GpuMember(B, "shared", lent=True),
        GpuMember(C, "shared", lent=True, pending=True),
    ]
    by_pool = {p.pool: p for p in pool_utilization(members, {A: 0.8, B: 0.6, C: 0.1})}
    assert (by_pool["inference"].gpus, by_pool["inference"].util) == (2, pytest.approx(0.7))
    assert (by_pool["shared"].gpus, by_pool["shared"].util) == (1, pytest.approx(0.1))


def test_inference_and_shared_are_always_reported_and_other_pools_when_present() -> None:
    result = pool_utilization([GpuMember(A, "training")], {A: 0.5})
    assert result == (
        PoolUtilization("inference", 0, 0.0, 0),
        PoolUtilization("shared", 0, 0.0, 0),
        PoolUtilization("training", 1, 0.5, 1),
    )


def test_gpus_outside_the_inventory_are_ignored() -> None:
    result = pool_utilization([GpuMember(A, "shared")], {A: 0.2, C: 1.0})
    assert result[1] == PoolUtilization("shared", 1, 0.2, 1)


@given(st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=50))
def test_a_pool_utilization_stays_within_zero_and_one(utils: list[float]) -> None:
    refs = [GpuRef("n", i) for i in range(len(utils))]
    members = [GpuMember(ref, "shared") for ref in refs]
    readings = [Reading(ref, ago(1), u) for ref, u in zip(refs, utils, strict=True)]
    [_, shared] = pool_utilization(members, gpu_means(readings, NOW, 30))
    assert 0.0 <= shared.util <= 1.0
    assert shared.reporting_gpus == len(utils)


def test_each_service_shows_its_latest_stats_and_stale_services_drop_out() -> None:
    latest = [
        ServiceReading("chat", ago(5), 100.0, 3, 50),
        ServiceReading("chat", ago(1), 120.0, 4, 60),
        ServiceReading("embed", ago(90), 10.0, 0, 5),
    ]
    assert live_services(latest, NOW, stale_after_s=60) == (
        ServiceReading("chat", ago(1), 120.0, 4, 60),
    )
