"""The stall measures: the event loop's lag and the collector's pauses, on /metrics."""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from gpusched.infra import stalls


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def _hold_the_loop(seconds: float) -> None:
    """A synchronous step, as a long computation on the loop would be."""
    time.sleep(seconds)


def _compute_on_the_loop(seconds: float) -> None:
    """A synchronous computation of ``seconds`` of this thread's CPU."""
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        sum(range(1000))


async def test_a_step_that_holds_the_loop_is_recorded_as_that_much_lag() -> None:
    service = "test-stalls-lag"
    late = "gpusched_event_loop_lag_seconds_bucket"
    count = "gpusched_event_loop_lag_seconds_count"
    stopping = asyncio.Event()
    watcher = asyncio.create_task(stalls.watch_event_loop(service, stopping, interval_s=0.01))
    await asyncio.sleep(0.05)
    before = _sample(count, service=service) - _sample(late, service=service, le="0.25")
    _hold_the_loop(0.3)
    await asyncio.sleep(0.05)
    stopping.set()
    await asyncio.wait_for(watcher, 1)
    after = _sample(count, service=service) - _sample(late, service=service, le="0.25")
    assert before == 0
    assert after >= 1  # the wake-up due during the held step came over 250 ms late
    assert _sample("gpusched_event_loop_lag_seconds_sum", service=service) >= 0.25
    # A sleeping step holds the loop without running: none of that lag was CPU.
    assert _sample("gpusched_event_loop_lag_cpu_seconds_sum", service=service) < 0.25


async def test_a_step_that_computes_on_the_loop_is_recorded_as_lag_spent_running() -> None:
    service = "test-stalls-cpu"
    stopping = asyncio.Event()
    watcher = asyncio.create_task(stalls.watch_event_loop(service, stopping, interval_s=0.01))
    await asyncio.sleep(0.05)
    _compute_on_the_loop(0.3)
    await asyncio.sleep(0.05)
    stopping.set()
    await asyncio.wait_for(watcher, 1)
    assert _sample("gpusched_event_loop_lag_cpu_seconds_sum", service=service) >= 0.25


@pytest.fixture
def gc_timed() -> Iterator[None]:
    """Collections timed for this test only (a signal landing in a collector callback is
    lost: the rest of the session keeps none)."""
    before = list(gc.callbacks)
    yield
    gc.callbacks[:] = before


@pytest.mark.usefixtures("gc_timed")
def test_every_collection_is_timed_by_generation_and_timing_is_installed_once() -> None:
    stalls.time_gc_pauses()
    stalls.time_gc_pauses()
    assert sum(isinstance(c, stalls._GcTimer) for c in gc.callbacks) == 1
    full = _sample("gpusched_gc_pause_seconds_count", generation="2")
    young = _sample("gpusched_gc_pause_seconds_count", generation="0")
    gc.collect()
    gc.collect(0)
    assert _sample("gpusched_gc_pause_seconds_count", generation="2") == full + 1
    assert _sample("gpusched_gc_pause_seconds_count", generation="0") >= young + 1
