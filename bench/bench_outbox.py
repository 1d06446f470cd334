"""The outbox relay against raw JetStream publishing, in one run on one machine.

Throughput: 20,000 events. The baseline publishes them straight from nats-py with
pipelined acks (publish_async, then gather the futures, batch by batch, as the relay
does). The relay publishes the same number of committed outbox rows (inserted before
the clock starts) to a fresh stream. Goal: relay >= 0.80 x raw.

Latency: a producer process commits events at a steady rate (2,000/s in transactions
of 10, for 5 s) while the relay runs, woken by NOTIFY; a subscriber notes when each
event arrives. Commit-to-publish latency = arrival - commit. The baseline is the
publish-to-arrival latency of raw publishing at the same rate. Goal: relay p99 < 50 ms.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import nats
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from bench.harness import Context, Figure, percentile
from bench.outbox_workload import EVENT_TYPE, SCHEMA, SOURCE, sample_envelope, sample_event
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.db import UnitOfWorkFactory, create_engine
from gpusched.infra.migrations import migrate
from gpusched.infra.outbox import OutboxRelay
from gpusched.infra.settings import OutboxSettings

NAME = "outbox"
EVENTS = int(os.environ.get("BENCH_OUTBOX_EVENTS", "20000"))
INSERT_TX = 100
ROUNDS = int(os.environ.get("BENCH_OUTBOX_ROUNDS", "3"))
LATENCY_RATE = float(os.environ.get("BENCH_OUTBOX_RATE", "2000"))
LATENCY_TX = 10
LATENCY_SECONDS = float(os.environ.get("BENCH_OUTBOX_SECONDS", "5"))
THROUGHPUT_GOAL = 0.80
P99_GOAL_MS = 50.0
MIGRATIONS = Path(__file__).resolve().parent / "migrations"
REPO = Path(__file__).resolve().parents[1]
OUTBOX = OutboxSettings()  # the relay's defaults, as a service runs it


@dataclass(frozen=True)
class Rate:
    per_s: float  # wall clock
    cpu_us: float  # this process's CPU per event: steadier than wall time on a busy machine


@dataclass(frozen=True)
class Latency:
    p50_ms: float
    p99_ms: float
    max_ms: float
    received: int
    sent: int


async def fresh_stream(js: JetStreamContext) -> tuple[Subjects, str]:
    """A new prefix with its own events stream (configured as the services' one)."""
    subjects = Subjects(f"bench{uuid.uuid4().hex[:8]}")
    events = subjects.stream("EVENTS")
    await bus.ensure_streams(js, [s for s in subjects.streams() if s.name == events])
    return subjects, events


async def stored(js: JetStreamContext, stream: str) -> int:
    info = await js.stream_info(stream)
    return int(info.state.messages)


async def raw_throughput(js: JetStreamContext, ctx: Context) -> Rate:
    subjects, stream = await fresh_stream(js)
    subject = subjects.event(SOURCE, EVENT_TYPE)
    messages = [(e.id, e.to_bytes()) for e in (sample_envelope(n) for n in range(EVENTS))]
    ctx.progress(f"{NAME}: raw JetStream publish of {EVENTS} events")
    started, cpu = time.perf_counter(), time.process_time()
    for i in range(0, EVENTS, OUTBOX.batch):
        futures = [
            await js.publish_async(subject, payload, headers={"Nats-Msg-Id": msg_id})
            for msg_id, payload in messages[i : i + OUTBOX.batch]
        ]
        await asyncio.gather(*futures)
    rate = _rate(started, cpu)
    assert await stored(js, stream) == EVENTS
    await js.delete_stream(stream)
    return rate


def _rate(started: float, cpu: float) -> Rate:
    elapsed, cpu_s = time.perf_counter() - started, time.process_time() - cpu
    return Rate(EVENTS / elapsed, cpu_s / EVENTS * 1e6)


async def relay_throughput(
    js: JetStreamContext,
    database_url: str,
    ctx: Context,
    relay_class: type[OutboxRelay] = OutboxRelay,
) -> tuple[float, Rate]:
    """(insert rate in events/s, relay publish rate); `relay_class` lets a candidate
    change to the relay be measured from a local copy."""
    subjects, stream = await fresh_stream(js)
    subject = subjects.event(SOURCE, EVENT_TYPE)
    engine = create_engine(database_url)
    uows = UnitOfWorkFactory(engine, SCHEMA, SOURCE, subjects)
    ctx.progress(f"{NAME}: inserting {EVENTS} outbox rows in transactions of {INSERT_TX}")
    started = time.perf_counter()
    for n in range(0, EVENTS, INSERT_TX):
        async with uows() as uow:
            for i in range(n, min(n + INSERT_TX, EVENTS)):
                await uow.emit(subject, EVENT_TYPE, sample_event(i))
            await uow.commit()
    insert_rate = EVENTS / (time.perf_counter() - started)
    await engine.dispose()

    ctx.progress(f"{NAME}: relaying {EVENTS} outbox rows")
    relay = relay_class(
        js, database_url, SCHEMA, service="bench", batch=OUTBOX.batch,
        poll_interval_s=OUTBOX.poll_interval_s,
    )  # fmt: skip
    clock: list[tuple[float, float]] = []
    done = asyncio.Event()
    drain_once = relay.drain_once

    async def timed_drain_once() -> int:
        # The clock starts at the first claim, after the relay connected to PostgreSQL
        # (the raw side is connected too), and stops at the last publish, with no
        # polling in between to steal the relay's CPU.
        if not clock:
            clock.append((time.perf_counter(), time.process_time()))
        published = await drain_once()
        if relay.published >= EVENTS:
            done.set()
        return published

    relay.drain_once = timed_drain_once  # type: ignore[method-assign]
    task = asyncio.create_task(relay.run())
    try:
        await asyncio.wait(
            [task, asyncio.create_task(done.wait())], return_when=asyncio.FIRST_COMPLETED
        )
        if not done.is_set():
            task.result()
            raise RuntimeError("the relay stopped before publishing everything")
        rate = _rate(*clock[0])
    finally:
        relay.stop()
        await asyncio.wait_for(task, 10)
    assert await stored(js, stream) == EVENTS
    await js.delete_stream(stream)
    return insert_rate, rate


async def latency(mode: str, js: JetStreamContext, database_url: str, ctx: Context) -> Latency:
    subjects, stream = await fresh_stream(js)
    subject = subjects.event(SOURCE, EVENT_TYPE)
    arrived: dict[str, float] = {}
    missing: set[str] | None = None  # known once the producer is done
    all_arrived = asyncio.Event()

    async def on_message(msg: Msg) -> None:
        msg_id = msg.headers["Nats-Msg-Id"] if msg.headers else ""
        arrived[msg_id] = time.monotonic()
        if missing is not None:
            missing.discard(msg_id)
            if not missing:
                all_arrived.set()

    listener = await bus.connect(ctx.nats_url, "bench-subscriber")
    await listener.subscribe(subject, cb=on_message)
    await listener.flush()
    relay: OutboxRelay | None = None
    relay_task: asyncio.Task[None] | None = None
    if mode == "relay":
        relay = OutboxRelay(
            js, database_url, SCHEMA, service="bench", batch=OUTBOX.batch,
            poll_interval_s=OUTBOX.poll_interval_s,
        )  # fmt: skip
        relay_task = asyncio.create_task(relay.run())
    out = ctx.scratch / f"outbox-latency-{mode}.txt"
    ctx.progress(
        f"{NAME}: {mode} latency, {LATENCY_RATE:.0f} events/s in transactions of "
        f"{LATENCY_TX} for {LATENCY_SECONDS:.0f} s"
    )
    try:
        summary = await run_producer(mode, subjects, database_url, out, ctx)
        ctx.progress(
            f"{NAME}: producer sent {summary['events']:.0f} events at {summary['rate']:.0f}/s"
        )
        sent = dict(
            (msg_id, float(at))
            for msg_id, at in (line.split() for line in out.read_text().splitlines())
        )
        missing = set(sent) - arrived.keys()
        if missing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_arrived.wait(), 15)
    finally:
        if relay is not None and relay_task is not None:
            relay.stop()
            await asyncio.wait_for(relay_task, 10)
        await listener.drain()
    latencies = [(arrived[i] - at) * 1000 for i, at in sent.items() if i in arrived]
    if len(latencies) < len(sent):
        ctx.progress(f"{NAME}: {len(sent) - len(latencies)} of {len(sent)} events never arrived")
    await js.delete_stream(stream)
    return Latency(
        p50_ms=percentile(latencies, 50),
        p99_ms=percentile(latencies, 99),
        max_ms=max(latencies, default=float("nan")),
        received=len(latencies),
        sent=len(sent),
    )


async def run_producer(
    mode: str, subjects: Subjects, database_url: str, out: Path, ctx: Context
) -> dict[str, float]:
    # The producer imports `bench` like `python -m bench` did, whatever its cwd.
    path = [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "bench.outbox_workload",
        "--mode", mode, "--nats-url", ctx.nats_url, "--database-url", database_url,
        "--prefix", subjects.prefix, "--rate", str(LATENCY_RATE), "--tx", str(LATENCY_TX),
        "--seconds", str(LATENCY_SECONDS), "--out", str(out),
        stdout=asyncio.subprocess.PIPE, cwd=REPO, env=env,
    )  # fmt: skip
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), LATENCY_SECONDS + 60)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"the {mode} producer exited with code {proc.returncode}")
    summary: dict[str, float] = json.loads(stdout)
    return summary


async def run(ctx: Context) -> list[Figure]:
    database_url = await ctx.create_database("bench_outbox")
    engine = create_engine(database_url)
    await migrate(engine, SCHEMA, MIGRATIONS)
    await engine.dispose()
    nc = await nats.connect(ctx.nats_url, name="bench-outbox")
    js = nc.jetstream()  # as the service runtime makes it
    raws: list[Rate] = []
    relays: list[Rate] = []
    inserts: list[float] = []
    try:
        # Alternating rounds, best of each: a neighbour's burst of CPU on this machine
        # then hurts one round of one side, not the comparison.
        for round_no in range(1, ROUNDS + 1):
            raws.append(await raw_throughput(js, ctx))
            insert_rate, relay_rate = await relay_throughput(js, database_url, ctx)
            inserts.append(insert_rate)
            relays.append(relay_rate)
            ctx.progress(
                f"{NAME}: round {round_no}/{ROUNDS}: raw {raws[-1].per_s:.0f}/s, "
                f"relay {relay_rate.per_s:.0f}/s; CPU per event raw {raws[-1].cpu_us:.1f} us, "
                f"relay {relay_rate.cpu_us:.1f} us"
            )
        raw = max(r.per_s for r in raws)
        relayed = max(r.per_s for r in relays)
        ratio = relayed / raw
        verdict = "met" if ratio >= THROUGHPUT_GOAL else "MISSED"
        ctx.progress(
            f"{NAME}: relay {relayed:.0f} events/s = {ratio:.2f} x raw "
            f"(goal >= {THROUGHPUT_GOAL}: {verdict})"
        )
        raw_latency = await latency("raw", js, database_url, ctx)
        relay_latency = await latency("relay", js, database_url, ctx)
        verdict = "met" if relay_latency.p99_ms < P99_GOAL_MS else "MISSED"
        ctx.progress(
            f"{NAME}: latency p50/p99 relay {relay_latency.p50_ms:.1f}/{relay_latency.p99_ms:.1f}"
            f" ms, raw {raw_latency.p50_ms:.1f}/{raw_latency.p99_ms:.1f} ms "
            f"(goal p99 < {P99_GOAL_MS:.0f} ms: {verdict})"
        )
    finally:
        await nc.drain()
    return [
        Figure(NAME, "raw_publish_rate", raw, "events/s"),
        Figure(NAME, "outbox_insert_rate", max(inserts), "events/s"),
        Figure(NAME, "relay_publish_rate", relayed, "events/s", baseline=raw),
        Figure(
            NAME,
            "relay_cpu_per_event",
            min(r.cpu_us for r in relays),
            "us",
            baseline=min(r.cpu_us for r in raws),
        ),
        Figure(NAME, "relay_latency_p50", relay_latency.p50_ms, "ms", raw_latency.p50_ms),
        Figure(NAME, "relay_latency_p99", relay_latency.p99_ms, "ms", raw_latency.p99_ms),
        Figure(NAME, "relay_latency_max", relay_latency.max_ms, "ms", raw_latency.max_ms),
        Figure(
            NAME,
            "relay_latency_delivered",
            relay_latency.received / max(1, relay_latency.sent),
            "fraction",
        ),
    ]
