"""What stalls a service: how late its event loop runs, and how long the collector pauses.

A service answers requests and messages on one event loop, so anything that holds the
loop (a long synchronous step, a full garbage collection over a large heap) delays
every reply by as long. Two measures, both on /metrics:

- ``gpusched_event_loop_lag_seconds{service}``: a watcher sleeps a short interval
  and records how much later than asked it woke up. The lag is what a request arriving
  at that moment waited before the loop could look at it.
- ``gpusched_event_loop_lag_cpu_seconds{service}``: the part of that lag the loop's
  thread spent running (its own work, collections included), as opposed to waiting for
  a CPU the machine gave to other processes: on a busy machine, the part the service's
  own code can change.
- ``gpusched_gc_pause_seconds{generation}``: every collection of the cyclic garbage
  collector, timed through ``gc.callbacks``. A full collection (generation 2) walks
  every container object the process holds, so its pause grows with the heap.
"""

from __future__ import annotations

import asyncio
import gc
import time
from typing import Any

from prometheus_client import Histogram

# A request/reply API answers in a few milliseconds: the buckets resolve stalls from
# one millisecond up to the seconds that mean an outage of the loop.
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

EVENT_LOOP_LAG = Histogram(
    "gpusched_event_loop_lag_seconds",
    "How much later than asked the event loop woke a short timer (the wait a request "
    "arriving then had before the loop could look at it)",
    ["service"],
    buckets=_BUCKETS,
)
EVENT_LOOP_LAG_CPU = Histogram(
    "gpusched_event_loop_lag_cpu_seconds",
    "The part of each event-loop lag the loop's thread spent running its own work (the "
    "rest it waited for a CPU)",
    ["service"],
    buckets=_BUCKETS,
)
GC_PAUSE = Histogram(
    "gpusched_gc_pause_seconds",
    "Time of one collection of the cyclic garbage collector, by generation (2: full)",
    ["generation"],
    buckets=_BUCKETS,
)

# Often enough to see a stall of a few ms; each wake-up costs a few microseconds.
WATCH_INTERVAL_S = 0.02


async def watch_event_loop(
    service: str, stopping: asyncio.Event, interval_s: float = WATCH_INTERVAL_S
) -> None:
    """Record the loop's lag every ``interval_s`` until ``stopping`` is set."""
    loop = asyncio.get_running_loop()
    lag_of, cpu_of = EVENT_LOOP_LAG.labels(service), EVENT_LOOP_LAG_CPU.labels(service)
    while not stopping.is_set():
        due = loop.time() + interval_s
        ran = time.thread_time()
        await asyncio.sleep(interval_s)
        lag = max(0.0, loop.time() - due)
        lag_of.observe(lag)
        # The loop's CPU over the whole wait bounds what of the lag was its own work.
        cpu_of.observe(min(lag, time.thread_time() - ran))


class _GcTimer:
    """Times each collection; the collector never runs two at once, so one start time
    is enough, whichever thread triggered it."""

    def __init__(self) -> None:
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            GC_PAUSE.labels(str(info["generation"])).observe(time.perf_counter() - self._started)


def time_gc_pauses() -> None:
    """Time every collection from now on (once per process; later calls do nothing)."""
    if not any(isinstance(callback, _GcTimer) for callback in gc.callbacks):
        gc.callbacks.append(_GcTimer())
