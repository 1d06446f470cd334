"""Admission under a submit load with a deep queue: submit latency and the pass's cost.

The admission service runs as its own process (as `gpusched up` runs it) on the run's
NATS and a fresh database. Before it starts, the bench stores ``BENCH_ADMISSION_QUEUED``
queued jobs straight into its database (as if submitted earlier): the first 8 ask one
GPU each and take the cluster's only node (8 GPUs), the others (4 teams, 3 priority
classes, 1-8 GPUs) cannot be placed, so the queue stays that deep for the whole run.
Once the service has examined them all, the bench submits open loop at
``BENCH_ADMISSION_RATE`` per second for ``BENCH_ADMISSION_SECONDS`` (jobs that do not
fit either, so every one is a queue change a pass must look at), each submit timed from
its scheduled send to its reply. Baseline: raw NATS request/reply to a responder that
only answers, at the same rate, on the same server, in the same run.

The scheduling-pass figures come from the service's /metrics: the time of the passes
that ran during the load over the queued jobs they found new or changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import nats
import yaml
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from bench.harness import Context, Figure, percentile
from gpusched.admission import store
from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA
from gpusched.admission.catalog import Catalog
from gpusched.admission.index import FairOrder, QueueIndex
from gpusched.admission.planning import Rules, plan
from gpusched.admission.queue import JobState, new_job_id
from gpusched.admission.store import JobRecord
from gpusched.cli.stack import Stack, prepare
from gpusched.contracts.messages import SubmitJob
from gpusched.contracts.subjects import Subjects
from gpusched.domain.inventory import parse_inventory
from gpusched.domain.ledger import Ledger
from gpusched.infra.db import UnitOfWorkFactory, create_engine
from gpusched.infra.settings import Settings

NAME = "admission"
QUEUED = int(os.environ.get("BENCH_ADMISSION_QUEUED", "50000"))
RATE = float(os.environ.get("BENCH_ADMISSION_RATE", "300"))
SECONDS = float(os.environ.get("BENCH_ADMISSION_SECONDS", "60"))
BASELINE_SECONDS = float(os.environ.get("BENCH_ADMISSION_BASELINE_SECONDS", "10"))
GOAL_P99_MS = 100.0
NODE_GPUS = 8
TEAMS = ("vision", "speech", "ranking", "research")
CLASSES = ("p0-urgent", "p1-normal", "p2-offline")
# The first pass after the start examines the whole queue (and audits every job as
# waiting): the load starts once it is done.
SETTLE_S = 600.0
REQUEST_TIMEOUT_S = 10.0
INSERT_BATCH = 5000
SEED = 11
PASS = "gpusched_admission_pass_seconds"
LAG = "gpusched_event_loop_lag_seconds"
LAG_CPU = "gpusched_event_loop_lag_cpu_seconds"
GC_PAUSE = "gpusched_gc_pause_seconds"
LAG_INTERVAL_S = 0.02
# Submits sent while the service takes in the stored queue at start, to see whether that
# first pass holds up the API.
PROBE_RATE = 10.0
# Outbox rows still unpublished that count as settled: the probes' own, in flight.
OUTBOX_SETTLED = 50


def _inventory() -> str:
    return (
        "nodes:\n  - {name: shared-00, pool: shared, gpu_model: A100-80GB, "
        f"gpus: {NODE_GPUS}, cpu_milli: 256000, memory_mib: 2097152}}\n"
    )


def _job(rng: random.Random, number: int) -> SubmitJob:
    """A job that waits behind the full cluster (the first NODE_GPUS fill it)."""
    gpus = 1 if number < NODE_GPUS else rng.randint(1, NODE_GPUS)
    return SubmitJob.model_validate(
        {
            "name": f"fill-{number}",
            "team": TEAMS[number % len(TEAMS)],
            "priority_class": CLASSES[number % len(CLASSES)],
            "gpus": {"count": gpus},
        }
    )


def full_pass_cpu(count: int) -> tuple[float, float]:
    """CPU seconds of one full plan over a queue like the stored one (every job tried,
    as after capacity grew), in this process, and of only walking that queue in the
    plan's order: the floor of any full pass."""
    inventory = parse_inventory(yaml.safe_load(_inventory()))
    rng = random.Random(SEED)
    start = datetime.now(UTC) - timedelta(seconds=count)
    queue = QueueIndex()
    for n in range(count):
        at = start + timedelta(seconds=n)
        record = JobRecord.of(new_job_id(), _job(rng, n), JobState.QUEUED, 0, None, None, at,
                              (), True, {})  # fmt: skip
        queue.put(record)
    ledger = Ledger.from_inventory(inventory)
    cpu = time.process_time()
    plan(queue, ledger, {}, {}, datetime.now(UTC), Rules(Catalog(inventory)))
    planned = time.process_time() - cpu
    cpu = time.process_time()
    for _ in FairOrder.of(queue, ledger, {}):
        pass
    return planned, time.process_time() - cpu


async def fill(settings: Settings, count: int) -> None:
    """Store ``count`` queued jobs, oldest first, in a few large transactions."""
    engine = create_engine(settings.database_url or "")
    uow = UnitOfWorkFactory(engine, SCHEMA, "bench", Subjects(settings.subject_prefix))
    rng = random.Random(SEED)
    start = datetime.now(UTC) - timedelta(seconds=count)
    try:
        for first in range(0, count, INSERT_BATCH):
            jobs = [
                store.NewJob(
                    new_job_id(),
                    _job(rng, n),
                    (),
                    start + timedelta(seconds=n),
                    JobState.QUEUED,
                    {},
                )
                for n in range(first, min(first + INSERT_BATCH, count))
            ]
            async with uow() as unit:
                await store.insert_jobs(unit, jobs)
                await unit.commit()
    finally:
        await engine.dispose()


async def unexamined(settings: Settings) -> int:
    """Stored jobs no pass has looked at yet, and outbox rows not yet published (a few
    are the probes' own, sent all along)."""
    engine = create_engine(settings.database_url or "")
    uow = UnitOfWorkFactory(engine, SCHEMA, "bench", Subjects(settings.subject_prefix))
    try:
        async with uow() as unit:
            result = await unit.execute(
                f"SELECT (SELECT count(*) FROM {SCHEMA}.jobs WHERE state = 'queued' "
                f"AND NOT wait_audited AND name LIKE 'fill-%') + greatest(0, "
                f"(SELECT count(*) FROM {SCHEMA}.outbox) - {OUTBOX_SETTLED})"
            )
            return int(result.scalar_one())
    finally:
        await engine.dispose()


@dataclass
class Load:
    latencies_ms: list[float]
    failed: int
    elapsed_s: float
    # (seconds into the load, latency in ms) of each answered request, in answer order.
    timeline: list[tuple[float, float]]

    def windows(self, seconds: float = 10.0) -> str:
        """p99 per window of the load, to tell a steady tail from a few stalls."""
        by_window: dict[int, list[float]] = {}
        for at, ms in self.timeline:
            by_window.setdefault(int(at // seconds), []).append(ms)
        return ", ".join(
            f"{int(w * seconds)}s: {percentile(values, 99):.0f}"
            for w, values in sorted(by_window.items())
        )


async def paced(
    nc: NatsClient, subject: str, body: Callable[[int], bytes], rate: float, seconds: float
) -> Load:
    """Requests sent on a fixed schedule (open loop: a slow reply does not delay the next
    send), each timed from its scheduled send to its reply. Each request's task is made
    when it is due, so the client holds only the requests in flight (thousands of
    sleeping tasks made up front would cost this process's own collector pauses)."""
    count = max(1, int(rate * seconds))
    latencies: list[float] = []
    timeline: list[tuple[float, float]] = []
    failed = 0
    start = time.perf_counter() + 0.05

    async def one(at: float, number: int) -> None:
        nonlocal failed
        try:
            reply = await nc.request(subject, body(number), timeout=REQUEST_TIMEOUT_S)
        except Exception:
            failed += 1
            return
        if not json.loads(reply.data).get("ok"):
            failed += 1
            return
        latencies.append((time.perf_counter() - at) * 1000)
        timeline.append((at - start, latencies[-1]))

    in_flight: set[asyncio.Task[None]] = set()
    for number in range(count):
        at = start + number / rate
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        task = asyncio.create_task(one(at, number))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
    await asyncio.gather(*in_flight)
    return Load(latencies, failed, time.perf_counter() - start, timeline)


def run_queue_wait_s(pid: int | str) -> float:
    """Seconds the process's main thread (its event loop) has spent runnable but waiting
    for a CPU (Linux schedstat; NaN where there is none). On a machine shared with
    other work this is the part of a stall no code change removes."""
    try:
        with open(f"/proc/{pid}/schedstat", encoding="ascii") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return math.nan


class LoopLag:
    """This process's own event-loop lag while it runs: a late client would show up as
    submit latency the service did not cause."""

    def __init__(self) -> None:
        self.lags_ms: list[float] = []
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def __enter__(self) -> LoopLag:
        self._task = asyncio.create_task(self._watch())
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            due = loop.time() + LAG_INTERVAL_S
            await asyncio.sleep(LAG_INTERVAL_S)
            self.lags_ms.append(max(0.0, loop.time() - due) * 1000)


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    """The service's Prometheus samples: (name, labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@dataclass(frozen=True)
class Growth:
    """What the service's metrics grew by between two scrapes."""

    before: Samples
    after: Samples

    def total(self, name: str, **labels: str) -> float:
        """The growth of ``name``, summed over the samples that carry ``labels``."""
        wanted = set(labels.items())

        def at(samples: Samples) -> float:
            return sum(v for (n, ls), v in samples.items() if n == name and wanted <= ls)

        return at(self.after) - at(self.before)

    def over(self, histogram: str, bound: float, **labels: str) -> float:
        """Observations of ``histogram`` above ``bound`` (one of its bucket bounds)."""
        le = {"le": repr(float(bound))}
        return self.total(f"{histogram}_count", **labels) - self.total(
            f"{histogram}_bucket", **labels, **le
        )

    def quantile_bound(self, histogram: str, q: float, **labels: str) -> float:
        """The smallest bucket bound that holds the ``q`` quantile of the observations."""
        count = self.total(f"{histogram}_count", **labels)
        bounds = sorted(
            float(dict(ls)["le"])
            for (n, ls) in self.after
            if n == f"{histogram}_bucket" and set(labels.items()) <= ls
        )
        for bound in bounds:
            if self.total(f"{histogram}_bucket", **labels, le=repr(bound)) >= q * count:
                return bound
        return math.inf


async def _until(check: Callable[[], Awaitable[bool]], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{NAME}: {what} within {within:.0f} s")
        await asyncio.sleep(0.5)


async def probing(nc: NatsClient, subject: str, stop: asyncio.Event) -> Load:
    """Submits at PROBE_RATE until ``stop``, timed like ``paced``'s, counted from the
    first one the service answers (before that it is still starting)."""
    latencies: list[float] = []
    timeline: list[tuple[float, float]] = []
    failed = 0
    start = time.perf_counter()
    in_flight: set[asyncio.Task[None]] = set()

    async def one(at: float, number: int) -> None:
        nonlocal failed
        body = json.dumps(
            {"name": f"probe-{number}", "team": TEAMS[0], "gpus": {"count": NODE_GPUS}}
        ).encode()
        try:
            reply = await nc.request(subject, body, timeout=REQUEST_TIMEOUT_S)
            ok = bool(json.loads(reply.data).get("ok"))
        except Exception:
            ok = False
        if ok:
            latencies.append((time.perf_counter() - at) * 1000)
            timeline.append((at - start, latencies[-1]))
        elif latencies:
            failed += 1

    number = 0
    while not stop.is_set():
        at = start + number / PROBE_RATE
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), max(0.0, at - time.perf_counter()))
        task = asyncio.create_task(one(at, number))
        in_flight.add(task)
        task.add_done_callback(in_flight.discard)
        number += 1
    await asyncio.gather(*in_flight)
    return Load(latencies, failed, time.perf_counter() - start, timeline)


async def run(ctx: Context) -> list[Figure]:
    inventory = ctx.scratch / "admission-inventory.yaml"
    inventory.write_text(_inventory())
    settings = Settings(
        nats_url=ctx.nats_url,
        database_url=await ctx.create_database("bench_admission"),
        subject_prefix=f"bench{uuid.uuid4().hex[:8]}",
        data_dir=ctx.scratch / "admission",
    )
    await prepare(settings, (ADMISSION,))
    ctx.progress(f"{NAME}: storing {QUEUED} queued jobs")
    await fill(settings, QUEUED)
    stack = Stack(
        settings,
        services=(ADMISSION,),
        env={
            "GPUSCHED_LOG_LEVEL": "WARNING",
            "GPUSCHED_ADMISSION__INVENTORY_PATH": str(inventory),
        },
        log_dir=ctx.scratch / "admission-logs",
    )
    ctx.progress(f"{NAME}: starting the admission service")
    await asyncio.to_thread(stack.start)
    # The stack gives each service a metrics port of its own.
    port = stack.metrics_ports[ADMISSION]
    nc = await nats.connect(ctx.nats_url, name="bench-admission")
    s = Subjects(settings.subject_prefix)
    try:
        # Probe submits while the service takes in the stored queue: its first pass
        # should not hold up the API.
        probes_done = asyncio.Event()
        probes = asyncio.create_task(probing(nc, s.api_jobs_submit, probes_done))
        try:

            async def settled() -> bool:
                return await unexamined(settings) == 0

            await _until(settled, SETTLE_S, "the service did not examine the stored queue")
        finally:
            probes_done.set()
            startup = await probes
        ctx.progress(
            f"{NAME}: the service took in the stored queue {startup.elapsed_s:.1f} s after it "
            f"started; {len(startup.latencies_ms)} probe submits meanwhile, p99 ms by 10 s: "
            f"{startup.windows()}"
        )

        ctx.progress(f"{NAME}: raw request/reply at {RATE:g}/s for {BASELINE_SECONDS:g} s")
        echo_subject = f"{s.prefix}.bench.echo"

        async def echo(msg: Msg) -> None:
            await msg.respond(b'{"ok": true}')

        sub = await nc.subscribe(echo_subject, cb=echo)
        cpu = time.process_time()
        baseline = await paced(nc, echo_subject, lambda _: b"{}", RATE, BASELINE_SECONDS)
        echo_cpu_ms = (time.process_time() - cpu) * 1000 / max(1, len(baseline.latencies_ms))
        await sub.unsubscribe()

        rng = random.Random(SEED + 1)
        bodies = [
            json.dumps(
                {
                    "name": f"load-{n}",
                    "team": rng.choice(TEAMS),
                    "priority_class": rng.choice(CLASSES),
                    "gpus": {"count": rng.randint(1, NODE_GPUS)},
                }
            ).encode()
            for n in range(int(RATE * SECONDS) + 1)
        ]
        before = scrape(port)
        service = stack.pid(ADMISSION) or 0
        waited = (run_queue_wait_s(service), run_queue_wait_s("self"))
        ctx.progress(f"{NAME}: submits at {RATE:g}/s for {SECONDS:g} s, {QUEUED} queued")
        with LoopLag() as client:
            load = await paced(nc, s.api_jobs_submit, bodies.__getitem__, RATE, SECONDS)
        grew = Growth(before, scrape(port))
        service_waited = run_queue_wait_s(service) - waited[0]
        client_waited = run_queue_wait_s("self") - waited[1]
    finally:
        await nc.close()
        await asyncio.to_thread(stack.stop)

    ctx.progress(f"{NAME}: one full pass over {QUEUED} queued jobs, in this process")
    full_plan_s, walk_s = full_pass_cpu(QUEUED)
    passes = grew.total(f"{PASS}_count")
    pass_s = grew.total(f"{PASS}_sum")
    changed = grew.total("gpusched_admission_pass_changed_jobs_total")
    lat = load.latencies_ms
    answered = max(1, len(lat))
    lag_samples = grew.total(f"{LAG}_count")
    full_gcs = grew.total(f"{GC_PAUSE}_count", generation="2")
    ctx.progress(
        f"{NAME}: {len(lat)} submits answered, {load.failed} failed; {passes:.0f} passes "
        f"took {pass_s:.1f} s for {changed:.0f} changed jobs; p99 ms by 10 s: {load.windows()}"
    )
    bounds = (0.01, 0.025, 0.05, 0.1, 0.25)
    ctx.progress(
        f"{NAME}: event loop late > 10 / 25 / 50 / 100 / 250 ms: "
        + " / ".join(f"{grew.over(LAG, bound):.0f}" for bound in bounds)
        + " (of that, its own work: "
        + " / ".join(f"{grew.over(LAG_CPU, bound):.0f}" for bound in bounds)
        + f") of {lag_samples:.0f} wake-ups; {full_gcs:.0f} full collections, "
        f"{grew.total(f'{GC_PAUSE}_sum', generation='2') * 1000:.0f} ms in all"
    )
    base = baseline.latencies_ms
    return [
        Figure(NAME, "queued_jobs", QUEUED, "jobs"),
        Figure(NAME, "offered_rate", RATE, "submits/s"),
        Figure(NAME, "sustained_rate", len(lat) / load.elapsed_s, "submits/s",
               len(base) / baseline.elapsed_s),
        Figure(NAME, "submit_p50", percentile(lat, 50), "ms", percentile(base, 50)),
        Figure(NAME, "submit_p99", percentile(lat, 99), "ms", percentile(base, 99)),
        Figure(NAME, "submit_max", max(lat, default=math.nan), "ms",
               max(base, default=math.nan)),
        Figure(NAME, "submits_failed", load.failed, "submits", baseline.failed),
        Figure(NAME, "cpu_per_submit",
               grew.total("process_cpu_seconds_total") * 1000 / answered, "ms", echo_cpu_ms),
        Figure(NAME, "loop_lag_p99", grew.quantile_bound(LAG, 0.99) * 1000, "ms"),
        Figure(NAME, "loop_stalls_over_50ms", grew.over(LAG, 0.05), "stalls"),
        Figure(NAME, "loop_stalls_over_100ms", grew.over(LAG, 0.1), "stalls"),
        Figure(NAME, "loop_late_per_submit", grew.total(f"{LAG}_sum") * 1000 / answered, "ms"),
        Figure(NAME, "loop_lag_cpu_p99", grew.quantile_bound(LAG_CPU, 0.99) * 1000, "ms"),
        Figure(NAME, "loop_stalls_cpu_over_50ms", grew.over(LAG_CPU, 0.05), "stalls"),
        Figure(NAME, "full_gc_collections", full_gcs, "collections"),
        Figure(NAME, "full_gc_pause_mean",
               grew.total(f"{GC_PAUSE}_sum", generation="2") * 1000 / full_gcs
               if full_gcs else 0.0, "ms"),
        Figure(NAME, "client_loop_lag_max", max(client.lags_ms, default=math.nan), "ms"),
        Figure(NAME, "service_cpu_wait_share", service_waited / load.elapsed_s, "fraction"),
        Figure(NAME, "client_cpu_wait_share", client_waited / load.elapsed_s, "fraction"),
        Figure(NAME, "machine_load_1m", os.getloadavg()[0], "runnable tasks"),
        Figure(NAME, "passes", passes, "passes"),
        Figure(NAME, "pass_time_per_changed_job", pass_s / changed * 1000 if changed else 0.0,
               "ms"),
        Figure(NAME, "pass_mean", pass_s / passes * 1000 if passes else 0.0, "ms"),
        Figure(NAME, "full_passes", grew.total(f"{PASS}_count", kind="full"), "passes"),
        Figure(NAME, "full_pass_cpu", full_plan_s, "s", walk_s),
        Figure(NAME, "startup_s", startup.elapsed_s, "s"),
        Figure(NAME, "startup_submit_p99", percentile(startup.latencies_ms, 99), "ms",
               percentile(base, 99)),
        Figure(NAME, "startup_submit_max", max(startup.latencies_ms, default=math.nan), "ms",
               max(base, default=math.nan)),
        Figure(NAME, "startup_submits_failed", startup.failed, "submits", baseline.failed),
    ]  # fmt: skip
