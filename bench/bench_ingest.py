"""Ingest's telemetry fold: node samples per second per process, lag under a steady
load, and what a second replica adds, beside a raw nats-py reader of the same messages.

Every reader runs in its own process (as `gpusched up` runs ingest), on a fresh
database and prefix, against the same NATS and PostgreSQL. Each sample is a real
`gpu.sample` envelope of an 8-GPU node (about 1 KB).

- Throughput: `BENCH_INGEST_BACKLOG` node samples (default 120,000: 10,000 nodes x 12)
  are stored in the TELEMETRY stream first; then an ingest replica starts (the real
  service: app.build with its ledger and inference consumers and its snapshot loop)
  and the time from its start to the last sample folded gives samples/s. The same
  with two replicas (replica 0 and 1 of 2, each its half of the partitions) says what
  one more replica adds on this machine.
- Baseline: a raw nats-py reader of the same stored messages in its own process: an
  ack-free pull consumer, fetch(1000), `json.loads` of every message (parsing only, no
  validation, no state). Goal: ingest >= 0.5 of it, and >= 10,000 samples/s.
- Lag: a publisher process sends `BENCH_INGEST_RATE` node samples/s (default 10,000:
  10,000 nodes at 1 Hz) for `BENCH_INGEST_SECONDS` (60); one replica folds them; the
  lag of a sample is the time from its timestamp to its fold. Goal: p99 < 1 s. The
  replica's resident memory at the end says what a window of that many nodes costs.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import resource
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from typing import Any

import nats
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from tests.support.identity import harness_options

from bench.harness import Context, Figure, percentile
from gpusched.contracts.messages import InventoryNode
from gpusched.contracts.subjects import Subjects
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest import app, store

NAME = "ingest"
NODES = int(os.environ.get("BENCH_INGEST_NODES", "10000"))
BACKLOG = int(os.environ.get("BENCH_INGEST_BACKLOG", str(12 * NODES)))
RATE = float(os.environ.get("BENCH_INGEST_RATE", "10000"))
SECONDS = float(os.environ.get("BENCH_INGEST_SECONDS", "60"))
GPUS = 8
GOAL_RATE = 10_000.0
IDLE_S = 5.0
GOAL_LAG_S = 1.0
ACCEPTED = ("gpusched_ingest_samples_total", {"source": "bus", "outcome": "accepted"})


def node(i: int) -> str:
    return f"node-{i:05d}"


def sample_bytes(name: str, at: datetime, seed: int) -> bytes:
    """A `gpu.sample` envelope as an agent sends it (8 GPUs), built without pydantic so
    the publisher is never the bottleneck."""
    stamp = at.isoformat().replace("+00:00", "Z")
    gpus = ",".join(
        f'{{"index":{g},"util":{((seed + g) % 100) / 100},"mem_used_mib":{20000 + g},'
        f'"mem_total_mib":81920,"temp_c":{50 + g},"power_w":{250 + g}}}'
        for g in range(GPUS)
    )
    return (
        f'{{"id":"{uuid.uuid4()}","type":"gpu.sample","version":1,"source":"bench",'
        f'"time":"{stamp}","data":{{"node":"{name}","time":"{stamp}","gpus":[{gpus}]}}}}'
    ).encode()


def settings_for(ctx: Context, database_url: str, prefix: str) -> Settings:
    return Settings(
        nats_url=ctx.nats_url,
        database_url=database_url,
        subject_prefix=prefix,
        data_dir=ctx.scratch / f"ingest-{prefix}",
        log_level="WARNING",
    )


async def prepare(settings: Settings) -> None:
    """Streams, ingest's schema, and the inventory of NODES nodes in its membership
    (written directly: every replica then starts with every node known)."""
    rt = ServiceRuntime(app.NAME, app.SCHEMA, settings, migrations_dir(app.__file__))
    await rt.start()
    try:
        nodes = [
            InventoryNode(
                name=node(i),
                pool="shared" if i % 2 else "inference",
                gpu_model="A100-80GB",
                gpus=GPUS,
            )
            for i in range(NODES)
        ]
        async with rt.uow() as uow:
            await store.load_inventory(uow, nodes)
            await store.membership_changed(uow)
            await uow.commit()
    finally:
        await rt.close()


async def fill(settings: Settings, count: int) -> None:
    """Store `count` node samples (round-robin over the nodes, each its own time)."""
    nc = await nats.connect(
        str(settings.nats_url), name="bench-ingest-fill", **harness_options(settings)
    )
    try:
        s = Subjects(settings.subject_prefix)
        start = datetime.now(UTC)
        for i in range(count):
            n = i % NODES
            at = start.replace(microsecond=(i // NODES) % 1_000_000)
            await nc.publish(s.telemetry_gpu(node(n)), sample_bytes(node(n), at, i))
            if i % 5000 == 0:
                await nc.flush()
        await nc.flush()
        js = nc.jetstream()
        for _ in range(600):  # core publishes are stored asynchronously
            info = await js.stream_info(s.stream("TELEMETRY"))
            if info.state.messages >= count:
                break
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


# --- the processes -------------------------------------------------------------------
def _replica(settings_json: str, expect: int, record_lag: bool, out: Connection) -> None:
    """One ingest replica: start, fold until `expect` samples are in (or, once some
    came, none for IDLE_S: a publisher that sent fewer), report."""
    settings = Settings.model_validate_json(settings_json)

    async def main() -> dict[str, Any]:
        from prometheus_client import REGISTRY

        lags: list[float] = []
        rt = ServiceRuntime(app.NAME, app.SCHEMA, settings, migrations_dir(app.__file__))
        await rt.start()
        fold = await app.build(rt)
        if record_lag:
            fold.on_lag = lags.append
        # From a started process (imports, connections, migrations done): the fold.
        started = time.perf_counter()
        cpu = time.process_time()
        task = asyncio.create_task(rt.run())
        try:
            folded, last_change = 0.0, time.perf_counter()
            while folded < expect:
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
                now_folded = REGISTRY.get_sample_value(*ACCEPTED) or 0.0
                if now_folded != folded:
                    folded, last_change = now_folded, time.perf_counter()
                elif folded and time.perf_counter() - last_change > IDLE_S:
                    break
            elapsed = last_change - started
            return {
                "elapsed": elapsed,
                "cpu": time.process_time() - cpu,
                "folded": REGISTRY.get_sample_value(*ACCEPTED),
                "lags": lags,
                "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        finally:
            rt.request_stop()
            await asyncio.wait_for(task, 30)

    out.send(asyncio.run(main()))
    out.close()


def _raw_reader(
    settings_json: str, stream: str, subject: str, expect: int, out: Connection
) -> None:
    """The baseline: an ack-free pull consumer and json.loads, nothing else."""
    settings = Settings.model_validate_json(settings_json)

    async def main() -> dict[str, Any]:
        nc = await nats.connect(
            str(settings.nats_url), name="bench-ingest-raw", **harness_options(settings)
        )
        js = nc.jetstream()
        started = time.perf_counter()
        cpu = time.process_time()
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.ALL,
            filter_subject=subject,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        sub = await js.pull_subscribe(subject, stream=stream, config=config)
        got = 0
        while got < expect:
            try:
                msgs = await sub.fetch(1000, timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                json.loads(msg.data)
            got += len(msgs)
        elapsed = time.perf_counter() - started
        await sub.unsubscribe()
        await nc.close()
        return {"elapsed": elapsed, "cpu": time.process_time() - cpu, "folded": got}

    out.send(asyncio.run(main()))
    out.close()


def _publisher(settings_json: str, rate: float, seconds: float, out: Connection) -> None:
    """A steady publisher: `rate` node samples/s, each node in turn, stamped when sent."""
    settings = Settings.model_validate_json(settings_json)

    async def main() -> dict[str, Any]:
        nc = await nats.connect(
            str(settings.nats_url), name="bench-ingest-publisher", **harness_options(settings)
        )
        s = Subjects(settings.subject_prefix)
        tick = 0.01
        sent = 0
        start = time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            # What is due by now, not one tick's worth per pass: a pass that overshoots
            # its tick (sleep granularity, a slow flush) is made up in the next one.
            # (Counting passes sent 8,800-9,300 /s when 10,000 were asked.)
            due = rate * elapsed
            now = datetime.now(UTC)
            while sent < int(due):
                name = node(sent % NODES)
                await nc.publish(s.telemetry_gpu(name), sample_bytes(name, now, sent))
                sent += 1
            await nc.flush()
            await asyncio.sleep(max(0.0, start + elapsed + tick - time.perf_counter()))
        await nc.close()
        return {"sent": sent, "elapsed": time.perf_counter() - start}

    out.send(asyncio.run(main()))
    out.close()


def spawn(target: Callable[..., None], *args: Any) -> tuple[Any, Connection]:
    mine, theirs = multiprocessing.get_context("spawn").Pipe(duplex=False)
    process = multiprocessing.get_context("spawn").Process(
        target=target, args=(*args, theirs), daemon=True
    )
    process.start()
    theirs.close()
    return process, mine


async def results(*pipes: tuple[Any, Connection], within: float) -> list[dict[str, Any]]:
    """What each process reports; a process that fails or hangs fails the bench."""
    got: list[dict[str, Any]] = []
    for process, pipe in pipes:
        ready = await asyncio.to_thread(pipe.poll, within)
        if not ready:
            process.kill()
            raise RuntimeError(f"{NAME}: a bench process reported nothing in {within:.0f} s")
        got.append(pipe.recv())
        await asyncio.to_thread(process.join, 30)
    return got


# --- the run -----------------------------------------------------------------------
async def fresh(ctx: Context, label: str, **ingest: Any) -> Settings:
    prefix = f"bi{label}{uuid.uuid4().hex[:6]}"
    settings = settings_for(ctx, await ctx.create_database(f"bench_ingest_{label}"), prefix)
    settings = settings.model_copy(update={"ingest": IngestSettings(**ingest)})
    await prepare(settings)
    return settings


def share(replicas: int, replica: int, count: int) -> int:
    """How many of the backlog's samples replica `replica` of `replicas` folds."""
    from gpusched.contracts.subjects import telemetry_partition

    mine = sum(1 for n in range(NODES) if telemetry_partition(node(n)) % replicas == replica)
    rounds, extra = divmod(count, NODES)
    return mine * rounds + sum(
        1 for n in range(extra) if telemetry_partition(node(n)) % replicas == replica
    )


async def run(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    # A window long enough that the stored backlog is inside it when the replica starts.
    backlog = await fresh(ctx, "t", window_s=3000.0, stale_after_s=3000.0)
    ctx.progress(f"{NAME}: storing {BACKLOG:,} node samples of {NODES:,} nodes")
    await fill(backlog, BACKLOG)

    s = Subjects(backlog.subject_prefix)
    ctx.progress(f"{NAME}: baseline: a raw nats-py reader of the same messages")
    [raw] = await results(
        spawn(
            _raw_reader,
            backlog.model_dump_json(),
            s.stream("TELEMETRY"),
            f"{s.prefix}.telemetry.gpu.>",
            BACKLOG,
        ),
        within=600,
    )
    raw_rate = BACKLOG / raw["elapsed"]

    ctx.progress(f"{NAME}: one ingest replica folds the backlog")
    [one] = await results(spawn(_replica, backlog.model_dump_json(), BACKLOG, False), within=600)
    one_rate = BACKLOG / one["elapsed"]
    figures += [
        Figure(NAME, "node samples/s, one replica (8 GPUs each)", one_rate, "1/s", raw_rate),
        Figure(NAME, "CPU per node sample, one replica", one["cpu"] / BACKLOG * 1e6, "us",
               raw["cpu"] / BACKLOG * 1e6),
    ]  # fmt: skip

    two_settings = [
        backlog.model_copy(
            update={"ingest": backlog.ingest.model_copy(update={"replicas": 2, "replica": i})}
        )
        for i in range(2)
    ]
    # A fresh database for the pair (its partials), the same stored stream.
    pair_db = await ctx.create_database("bench_ingest_pair")
    two_settings = [x.model_copy(update={"database_url": pair_db}) for x in two_settings]
    await prepare(two_settings[0])
    ctx.progress(f"{NAME}: two replicas fold the backlog, each its half of the partitions")
    pair = await results(
        *(
            spawn(_replica, x.model_dump_json(), share(2, i, BACKLOG), False)
            for i, x in enumerate(two_settings)
        ),
        within=600,
    )
    two_rate = BACKLOG / max(r["elapsed"] for r in pair)
    figures.append(Figure(NAME, "node samples/s, two replicas (vs one)", two_rate, "1/s", one_rate))

    steady = await fresh(ctx, "l")
    expect = int(RATE * SECONDS * 0.98)
    ctx.progress(f"{NAME}: {RATE:,.0f} node samples/s for {SECONDS:.0f} s into one replica")
    replica = spawn(_replica, steady.model_dump_json(), expect, True)
    await asyncio.sleep(3.0)  # the replica is up before the load starts
    publisher = spawn(_publisher, steady.model_dump_json(), RATE, SECONDS)
    sent, lagged = await results(publisher, replica, within=SECONDS + 600)
    lags = lagged["lags"]
    figures += [
        Figure(NAME, "lag p50 at the steady load", percentile(lags, 50), "s"),
        Figure(NAME, "lag p99 at the steady load", percentile(lags, 99), "s"),
        Figure(NAME, "steady load sent", sent["sent"] / sent["elapsed"], "1/s"),
        Figure(NAME, "steady load folded", lagged["folded"] / SECONDS, "1/s"),
        Figure(NAME, "replica memory with the window full", lagged["rss_mb"], "MB"),
    ]
    ctx.progress(
        f"{NAME}: one replica {one_rate:,.0f}/s (raw reader {raw_rate:,.0f}/s, "
        f"goal {GOAL_RATE:,.0f}/s and >= 0.5 of raw); two {two_rate:,.0f}/s; "
        f"lag p99 {percentile(lags, 99):.3f} s at {RATE:,.0f}/s (goal < {GOAL_LAG_S:g} s)"
    )
    return figures
