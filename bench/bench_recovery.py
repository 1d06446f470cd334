"""Recovery time after each kind of fault, on a whole stack of processes under load.

The stack runs with its own nats-server and PostgreSQL in the scratch directory (the
run's shared servers are not the ones to kill), the fast settings of the e2e tests,
and a client submitting small simulated jobs continuously. The baseline is the same
probe on the same stack with no fault: a 1-GPU job submitted -> placed, and submitted
-> finished (its job events applied by admission). Then, one fault at a time, a probe
job is submitted the moment the fault is injected (again with the same idempotency key
until acknowledged) and the bench records:

- `<fault>.back`: the killed process running again (a server: answering again);
- `<fault>.placed`: fault -> that probe placed;
- `<fault>.finished`: fault -> that probe finished (its job events applied);
- `faults_recovered`: how many faults the stack came back from (baseline: how many were
  injected); the bench stops at the first it does not come back from within the bound.

A pause (the server frozen with SIGSTOP, unreachable with its sockets open) counts from
the end of the pause, since its length is the bench's choice.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid

from tests.support.faults import (
    Fault,
    Load,
    WatchedStack,
    back,
    finished,
    kill,
    own_servers_settings,
    pause,
    placed,
    within,
)

from bench.harness import Context, Figure

BENCH = "recovery"
SERVICES = ("admission", "ingest", "preemption", "checkpoint", "billing", "agent")
PAUSE_S = float(os.environ.get("BENCH_RECOVERY_PAUSE_S", "10"))
RATE = float(os.environ.get("BENCH_RECOVERY_RATE", "1"))
BASELINE_PROBES = int(os.environ.get("BENCH_RECOVERY_BASELINE", "5"))
BOUND_S = 180.0  # a fault not recovered from in this long fails the bench
FAULTS = (
    *(Fault(service, "kill") for service in SERVICES),
    Fault("nats", "kill"),
    Fault("postgres", "kill"),
    Fault("nats", "pause", PAUSE_S),
    Fault("postgres", "pause", PAUSE_S),
)


async def _probe(load: Load, since: float) -> tuple[float, float]:
    """Submit a tiny job now; seconds from `since` to it placed, and to it finished."""
    job_id = await load.submit_until_acked(f"probe-{uuid.uuid4().hex[:12]}", BOUND_S, steps=1)
    await within(f"probe {job_id} placed", lambda: placed(load, job_id), BOUND_S)
    placed_at = time.monotonic()
    await within(f"probe {job_id} finished", lambda: finished(load, job_id), BOUND_S)
    return placed_at - since, time.monotonic() - since


async def _inject(watched: WatchedStack, load: Load, fault: Fault) -> list[Figure]:
    stack = watched.stack
    if fault.kind == "pause":
        await pause(stack, fault.target, fault.seconds)
        since = time.monotonic()
        took_placed, took_finished = await _probe(load, since)
        came_back = None
    else:
        since = time.monotonic()
        old = kill(stack, fault.target)
        probe = asyncio.create_task(_probe(load, since))
        try:
            came_back = await back(stack, fault.target, old, BOUND_S)
            took_placed, took_finished = await probe
        finally:
            probe.cancel()
    figures = [
        Figure(BENCH, f"{fault.name}.placed", took_placed, "s", _baseline.placed),
        Figure(BENCH, f"{fault.name}.finished", took_finished, "s", _baseline.finished),
    ]
    if came_back is not None:
        figures.insert(0, Figure(BENCH, f"{fault.name}.back", came_back, "s"))
    return figures


class _Baseline:
    placed: float | None = None
    finished: float | None = None


_baseline = _Baseline()


async def run(ctx: Context) -> list[Figure]:
    prefix = f"bench{uuid.uuid4().hex[:6]}"
    watched = WatchedStack(
        own_servers_settings(ctx.scratch / "recovery" / "data", prefix),
        ctx.scratch / "recovery" / "logs",
        env={},
    )
    await asyncio.to_thread(watched.start)
    try:
        assert watched.settings.nats_url
        # Probes resent every half second: the figures' resolution, not a 3 s timeout's.
        async with Load(
            watched.settings.nats_url,
            prefix,
            rate=RATE,
            timeout_s=0.5,
            credentials=watched.settings.nats_credentials,
        ) as load:
            stop = asyncio.Event()
            background = asyncio.create_task(load.run(stop))
            try:
                return await _measure(ctx, watched, load)
            finally:
                stop.set()
                await background
    finally:
        await asyncio.to_thread(watched.stop)


async def _measure(ctx: Context, watched: WatchedStack, load: Load) -> list[Figure]:
    await _probe(load, time.monotonic())  # the first placement warms every service up
    samples = [await _probe(load, time.monotonic()) for _ in range(BASELINE_PROBES)]
    _baseline.placed = statistics.median(s[0] for s in samples)
    _baseline.finished = statistics.median(s[1] for s in samples)
    figures = [
        Figure(BENCH, "no_fault.placed", _baseline.placed, "s"),
        Figure(BENCH, "no_fault.finished", _baseline.finished, "s"),
    ]
    ctx.progress(
        f"recovery: no fault: placed {_baseline.placed:.2f}s, finished {_baseline.finished:.2f}s"
    )
    recovered = 0
    for fault in FAULTS:
        await asyncio.sleep(3)  # let the stack settle after the last fault
        try:
            got = await _inject(watched, load, fault)
        except AssertionError as exc:
            # The stack did not come back: later faults would measure nothing.
            ctx.progress(f"recovery: {fault.name} NOT recovered from: {exc}")
            break
        recovered += 1
        figures += got
        ctx.progress("recovery: " + ", ".join(f"{f.metric} {f.value:.2f}s" for f in got))
    figures.append(Figure(BENCH, "faults_recovered", recovered, "faults", len(FAULTS)))
    return figures
