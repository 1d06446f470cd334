"""The eviction saga's control-plane overhead, against the raw NATS round trip.

The checkpoint service runs as its own process (as `gpusched up` runs it) on a fresh
database and prefix. This bench plays preemption, 1,000 jobs that confirm instantly
(with a real file, so the service's sha256 verification is part of the figure) and a
cluster agent that stops a workload the moment it is told to. Up to 200 sagas are in
flight at once. Per saga:

- request-to-evict: from publishing eviction.requested to receiving the evict command,
  minus the job's own time (checkpoint.requested received -> checkpoint.confirmed
  published), i.e. what the control plane spends in both of its hops;
- stopped-to-completed: from publishing workload.stopped to receiving eviction.completed.

Phases: 200 sagas one at a time (the overhead without queueing); sagas arriving at a
steady rate the service sustains (`BENCH_SAGAS_RATE` per second, open loop); then the
goal's shape, 1,000 sagas with up to 200 in flight, launched as fast as slots free up,
with the CPU each process spent per saga in that phase (from /proc, Linux only; the
servers' figures only when this run started them).

Baseline: the raw NATS request/reply round trip (a responder in this process), 1,000
requests one after the other, in the same run. Goal: p99 < 50 ms for both figures.

The CPU per saga has a baseline of its own, the transport floor: what this process
spends, with the same client libraries and nothing else, on the messages and round
trips one saga needs at least: 3 messages fetched (in batches of 16) and acked, 9
published to JetStream with their acks awaited (pipelined), and 4 PostgreSQL round
trips (`FLOOR_ROUND_TRIPS`: the statements the service sends per saga in this bench,
counted with PostgreSQL's log_statement = all: 3,828 for 1,000 sagas, its batches'
BEGIN and COMMIT, inbox claims, batch locks, saga updates and outbox writes shared by
a batch's sagas included; it was 6 before the consumers' prepare hook). No parsing,
validation or logic.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import BaseModel
from tests.support.identity import harness_options

from bench.harness import Context, Figure, percentile
from gpusched.checkpoint.handlers import saga_id_for
from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointConfirmed,
    EvictionRequested,
    PriorityClassName,
    StageName,
    StopReason,
    T,
    WorkloadStopped,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra.settings import Settings

NAME = "sagas"
SAGAS = int(os.environ.get("BENCH_SAGAS", "1000"))
CONCURRENCY = int(os.environ.get("BENCH_SAGAS_CONCURRENCY", "200"))
ROUND_TRIPS = 1000
# Enough sagas that the p99 is not simply the slowest one (with 50 it would be).
UNLOADED = int(os.environ.get("BENCH_SAGAS_UNLOADED", "200"))
RATE = float(os.environ.get("BENCH_SAGAS_RATE", "40"))
PACED = int(os.environ.get("BENCH_SAGAS_PACED", "400"))
P99_GOAL_MS = 50.0
# What a saga costs the service at least: messages in, events and audit records out,
# and its PostgreSQL round trips (see the module's docstring).
FLOOR_IN, FLOOR_OUT, FLOOR_ROUND_TRIPS = 3, 9, 4
FLOOR_SAGAS = min(SAGAS, 1000)


class Sim:
    """The jobs and the agent, answering at once; every time is time.perf_counter()."""

    def __init__(self, nc: NatsClient, s: Subjects, checkpoint: Path) -> None:
        self.nc, self.js, self.s = nc, nc.jetstream(), s
        data = checkpoint.read_bytes()
        self.uri, self.size = checkpoint.as_uri(), len(data)
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.requested: dict[str, float] = {}  # request id -> eviction.requested published
        self.asked: dict[str, float] = {}  # request id -> checkpoint.requested received
        self.confirmed: dict[str, float] = {}  # request id -> checkpoint.confirmed published
        self.evicted: dict[str, float] = {}  # saga id -> evict command received
        self.stopped: dict[str, float] = {}  # saga id -> workload.stopped published
        self.completed: dict[str, float] = {}  # saga id -> eviction.completed received
        self.done: dict[str, asyncio.Event] = {}
        self.refused: dict[str, str] = {}  # saga id -> why the service refused its claim
        self._tasks: set[asyncio.Task[None]] = set()

    async def publish(
        self, subject: str, kind: str, data: BaseModel, correlation_id: str | None = None
    ) -> None:
        env = make_envelope(kind, data, source="bench", correlation_id=correlation_id)
        await self.js.publish(subject, env.to_bytes(), headers={"Nats-Msg-Id": env.id})

    def _spawn(self, coro: object) -> None:
        # Callbacks of one subscription run one after another: answering in a task keeps
        # a slow publish from queueing the next message (and inflating its timestamp).
        task = asyncio.ensure_future(coro)  # type: ignore[call-overload]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_control(self, msg: Msg) -> None:
        now = time.perf_counter()
        env = Envelope.from_bytes(msg.data)
        if env.type == T.CHECKPOINT_REQUESTED:
            self.asked[env.data["request_id"]] = now
            self._spawn(self._confirm(env.data["request_id"], env.data["job_id"]))

    async def _confirm(self, request_id: str, job_id: str) -> None:
        payload = CheckpointConfirmed(
            request_id=request_id,
            checkpoint_id=f"{job_id}-1",
            step=1,
            uri=self.uri,
            bytes=self.size,
            sha256=self.sha256,
            stage=StageName.PERSISTED,
        )
        self.confirmed[request_id] = time.perf_counter()
        await self.publish(self.s.job_events(job_id), T.CHECKPOINT_CONFIRMED, payload, job_id)

    async def on_evict(self, msg: Msg) -> None:
        now = time.perf_counter()
        env = Envelope.from_bytes(msg.data)
        self.evicted.setdefault(env.data["saga_id"], now)
        self._spawn(self._stop(env.data))

    async def _stop(self, data: dict[str, object]) -> None:
        saga_id = str(data["saga_id"])
        payload = WorkloadStopped(
            allocation_id=str(data["allocation_id"]),
            job_id=str(data["job_id"]),
            reason=StopReason.EVICTED,
            stopped_at=datetime.now(UTC),
            saga_id=saga_id,
        )
        self.stopped.setdefault(saga_id, time.perf_counter())
        await self.publish(self.s.event("agent", T.WORKLOAD_STOPPED), T.WORKLOAD_STOPPED, payload)

    async def on_completed(self, msg: Msg) -> None:
        now = time.perf_counter()
        env = Envelope.from_bytes(msg.data)
        saga_id = env.data["saga_id"]
        self.completed.setdefault(saga_id, now)
        if (event := self.done.get(saga_id)) is not None:
            event.set()

    async def on_unverified(self, msg: Msg) -> None:
        # A claim the service will not take (a misconfigured bench) fails the run at
        # once with the service's reason, not after the saga's wait.
        env = Envelope.from_bytes(msg.data)
        saga_id = str(env.data.get("entity"))
        self.refused.setdefault(saga_id, str(env.data.get("reason")))
        if (event := self.done.get(saga_id)) is not None:
            event.set()

    async def saga(self, index: int, slots: asyncio.Semaphore, at: float | None = None) -> None:
        if at is not None:
            # Open loop: the saga starts on its schedule, however the earlier ones fare.
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
        async with slots:
            tag = f"{index:05d}-{uuid.uuid4().hex[:6]}"
            request_id = f"req-{tag}"
            self.done[saga_id_for(request_id)] = done = asyncio.Event()
            payload = EvictionRequested(
                request_id=request_id,
                decision_id=f"decision-{tag}",
                allocation_id=f"alloc-{tag}",
                job_id=f"job-{tag}",
                team="bench",
                priority_class=PriorityClassName.P1_NORMAL,
                gpus=8,
                started_at=datetime.now(UTC) - timedelta(hours=1),
                reason="bench surge",
            )
            self.requested[request_id] = time.perf_counter()
            subject = self.s.command("checkpoint", T.EVICTION_REQUESTED)
            await self.publish(subject, T.EVICTION_REQUESTED, payload)
            await asyncio.wait_for(done.wait(), 60)
            if (reason := self.refused.get(saga_id_for(request_id))) is not None:
                raise RuntimeError(f"the checkpoint service refused the bench's claim: {reason}")


async def round_trips(nc: NatsClient, n: int) -> list[float]:
    subject = f"bench.rtt.{uuid.uuid4().hex[:8]}"

    async def echo(msg: Msg) -> None:
        await msg.respond(msg.data)

    sub = await nc.subscribe(subject, cb=echo)
    body = b"x" * 300  # about the size of a small envelope
    out: list[float] = []
    try:
        for _ in range(n):
            t0 = time.perf_counter()
            await nc.request(subject, body, timeout=5)
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        await sub.unsubscribe()
    return out


async def run(ctx: Context) -> list[Figure]:
    settings = Settings(
        nats_url=ctx.nats_url,
        database_url=await ctx.create_database("bench_sagas"),
        subject_prefix=f"bench{uuid.uuid4().hex[:8]}",
        data_dir=ctx.scratch / "sagas",
    )
    # The jobs' checkpoints live where the service is told to read file:// claims
    # (checkpoint.file_roots), as in a deployment: the claims go through that check too.
    jobs_dir = ctx.scratch / "sagas-jobs"
    jobs_dir.mkdir()
    stack = Stack(
        settings,
        services=("checkpoint",),
        env={
            "GPUSCHED_LOG_LEVEL": "WARNING",
            "GPUSCHED_CHECKPOINT__GRACE_S": "600",
            "GPUSCHED_CHECKPOINT__FILE_ROOTS": json.dumps([str(jobs_dir.resolve())]),
        },
        log_dir=ctx.scratch / "sagas-logs",
    )
    ctx.progress(f"{NAME}: starting the checkpoint service")
    await asyncio.to_thread(stack.start)
    # The bench plays the jobs and the agent: the harness identity, anything in the
    # service account (on the bench's own NATS without auth: no identity at all).
    nc = await nats.connect(ctx.nats_url, name="bench-sagas", **harness_options(stack.settings))
    try:
        s = Subjects(settings.subject_prefix)
        checkpoint = jobs_dir / "checkpoint.bin"
        checkpoint.write_bytes(os.urandom(1 << 16))
        sim = Sim(nc, s, checkpoint)
        await nc.subscribe(f"{s.prefix}.jobs.*.control", cb=sim.on_control)
        await nc.subscribe(s.command("agent", T.EVICT_WORKLOAD), cb=sim.on_evict)
        await nc.subscribe(s.event("checkpoint", T.EVICTION_COMPLETED), cb=sim.on_completed)
        await nc.subscribe(s.audit("checkpoint.unverified"), cb=sim.on_unverified)
        await nc.flush()

        ctx.progress(f"{NAME}: warming up (20 sagas)")
        warm = asyncio.Semaphore(CONCURRENCY)
        await asyncio.gather(*(sim.saga(-1 - i, warm) for i in range(20)))
        warmed = set(sim.requested)
        ctx.progress(f"{NAME}: {UNLOADED} sagas one at a time (the overhead without queueing)")
        one = asyncio.Semaphore(1)
        await asyncio.gather(*(sim.saga(-100 - i, one) for i in range(UNLOADED)))
        unloaded = set(sim.requested) - warmed
        warmed = set(sim.requested)

        ctx.progress(f"{NAME}: {PACED} sagas arriving at {RATE:g}/s")
        slots = asyncio.Semaphore(CONCURRENCY)
        start = time.perf_counter() + 0.1
        await asyncio.gather(
            *(sim.saga(-1000 - i, slots, at=start + i / RATE) for i in range(PACED))
        )
        paced = set(sim.requested) - warmed
        warmed = set(sim.requested)

        ctx.progress(f"{NAME}: {SAGAS} sagas, up to {CONCURRENCY} at once")
        assert stack.supervisor is not None
        processes = ProcessCpu(os.getpid(), stack.supervisor.pid("checkpoint"))
        cpu_before = processes.sample()
        t0 = time.perf_counter()
        await asyncio.gather(*(sim.saga(i, slots) for i in range(SAGAS)))
        elapsed = time.perf_counter() - t0
        cpu_after = processes.sample()

        ctx.progress(f"{NAME}: {ROUND_TRIPS} raw NATS request/reply round trips")
        rtt = await round_trips(nc, ROUND_TRIPS)
        ctx.progress(f"{NAME}: the transport floor of {FLOOR_SAGAS} sagas")
        floor_ms = await transport_floor(nc, s, str(settings.database_url), FLOOR_SAGAS)
    finally:
        await nc.close()
        await asyncio.to_thread(stack.stop)

    to_evict, to_complete = overheads(sim, set(sim.requested) - warmed)
    alone_evict, alone_complete = overheads(sim, unloaded)
    paced_evict, paced_complete = overheads(sim, paced)
    rtt_p50, rtt_p99 = percentile(rtt, 50), percentile(rtt, 99)
    cpu = [
        Figure(
            NAME,
            f"cpu_per_saga.{role}",
            seconds / SAGAS * 1000,
            "ms",
            floor_ms if role == "checkpoint_service" else None,
        )
        for role, seconds in sorted(ProcessCpu.spent(cpu_before, cpu_after).items())
    ]
    return [
        Figure(NAME, "unloaded_request_to_evict_p50", percentile(alone_evict, 50), "ms", rtt_p50),
        Figure(NAME, "unloaded_request_to_evict_p99", percentile(alone_evict, 99), "ms", rtt_p99),
        Figure(
            NAME, "unloaded_stopped_to_completed_p50", percentile(alone_complete, 50), "ms", rtt_p50
        ),
        Figure(
            NAME, "unloaded_stopped_to_completed_p99", percentile(alone_complete, 99), "ms", rtt_p99
        ),
        Figure(NAME, "paced_rate", RATE, "sagas/s"),
        Figure(NAME, "paced_request_to_evict_p50", percentile(paced_evict, 50), "ms", rtt_p50),
        Figure(NAME, "paced_request_to_evict_p99", percentile(paced_evict, 99), "ms", rtt_p99),
        Figure(
            NAME, "paced_stopped_to_completed_p50", percentile(paced_complete, 50), "ms", rtt_p50
        ),
        Figure(
            NAME, "paced_stopped_to_completed_p99", percentile(paced_complete, 99), "ms", rtt_p99
        ),
        Figure(NAME, "sagas_per_s", len(to_evict) / elapsed, "sagas/s"),
        *cpu,
        Figure(NAME, "transport_floor_per_saga", floor_ms, "ms"),
        Figure(NAME, "request_to_evict_p50", percentile(to_evict, 50), "ms", baseline=rtt_p50),
        Figure(NAME, "request_to_evict_p99", percentile(to_evict, 99), "ms", baseline=rtt_p99),
        Figure(NAME, "stopped_to_completed_p50", percentile(to_complete, 50), "ms", rtt_p50),
        Figure(NAME, "stopped_to_completed_p99", percentile(to_complete, 99), "ms", rtt_p99),
    ]


async def transport_floor(nc: NatsClient, s: Subjects, database_url: str, sagas: int) -> float:
    """CPU ms of this process per saga for the floor (module docstring): the same
    clients as the service, the same batching, no work between the calls."""
    js = nc.jetstream()
    subject = s.command("floor", uuid.uuid4().hex[:8])
    body = b"x" * 600  # about an incoming envelope
    for i in range(0, FLOOR_IN * sagas, 500):
        await asyncio.gather(
            *[js.publish(subject, body) for _ in range(min(500, FLOOR_IN * sagas - i))]
        )
    sub = await js.pull_subscribe(subject, durable=None, stream=s.stream("COMMANDS"))
    conn = await asyncpg.connect(database_url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        cpu = time.process_time()
        taken = 0
        while taken < FLOOR_IN * sagas:
            for msg in await sub.fetch(16, timeout=5):
                await msg.ack()
                taken += 1
        for i in range(0, FLOOR_OUT * sagas, 200):
            futures = [
                await js.publish_async(subject, body, headers={"Nats-Msg-Id": uuid.uuid4().hex})
                for _ in range(min(200, FLOOR_OUT * sagas - i))
            ]
            await asyncio.gather(*futures)
        for i in range(FLOOR_ROUND_TRIPS * sagas):
            await conn.fetchrow("SELECT $1::int AS n", i)
        spent = time.process_time() - cpu
    finally:
        await conn.close()
        await sub.unsubscribe()
    return spent / sagas * 1000


def overheads(sim: Sim, request_ids: set[str]) -> tuple[list[float], list[float]]:
    """(request-to-evict, stopped-to-completed) in ms for these sagas."""
    to_evict: list[float] = []
    to_complete: list[float] = []
    for request_id in request_ids:
        saga_id = saga_id_for(request_id)
        job_time = sim.confirmed[request_id] - sim.asked[request_id]
        to_evict.append((sim.evicted[saga_id] - sim.requested[request_id] - job_time) * 1000)
        to_complete.append((sim.completed[saga_id] - sim.stopped[saga_id]) * 1000)
    return to_evict, to_complete


class ProcessCpu:
    """CPU seconds (user + system) of the processes a saga runs through, by role: this
    bench (the simulated jobs and agent), the checkpoint service, and the PostgreSQL and
    NATS servers when they are this process's descendants (the embedded ones)."""

    def __init__(self, bench_pid: int, service_pid: int) -> None:
        self._bench = bench_pid
        self._service = service_pid
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def sample(self) -> dict[int, tuple[str, float]]:
        """CPU seconds so far of each process that has a role: pid -> (role, seconds)."""
        proc = Path("/proc")
        if not proc.is_dir():
            return {}
        table: dict[int, tuple[int, str, float]] = {}
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # The command name is in parentheses and may hold spaces.
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks = int(fields[11]) + int(fields[12])
            table[int(entry.name)] = (int(fields[1]), name, ticks / self._tick)
        out: dict[int, tuple[str, float]] = {}
        for pid, (_, name, seconds) in table.items():
            role = self._role(pid, name, table)
            if role is not None:
                out[pid] = (role, seconds)
        return out

    @staticmethod
    def spent(
        before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]
    ) -> dict[str, float]:
        """CPU seconds by role between two samples. Per pid, since database backends
        come and go; one that exited in between is missing (an undercount)."""
        out: dict[str, float] = {}
        for pid, (role, seconds) in after.items():
            start = before[pid][1] if pid in before else 0.0
            out[role] = out.get(role, 0.0) + seconds - start
        return out

    def _role(self, pid: int, name: str, table: dict[int, tuple[int, str, float]]) -> str | None:
        if pid == self._bench:
            return "bench_sim"
        if pid == self._service:
            return "checkpoint_service"
        ancestor, hops = table[pid][0], 0
        while ancestor in table and ancestor != self._bench and hops < 16:
            ancestor, hops = table[ancestor][0], hops + 1
        if ancestor != self._bench:
            return None
        if name.startswith("postgres"):
            return "postgres"
        if name.startswith("nats"):
            return "nats"
        return None
