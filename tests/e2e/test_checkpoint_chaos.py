"""Crash safety of the eviction saga: SIGKILL the checkpoint service at random points.

The checkpoint service runs as a real process (under the Supervisor) on real NATS and
PostgreSQL. The test plays preemption (eviction requests, some withdrawn), the jobs
(each with a random behaviour: confirms at once, confirms late, never answers as if its
process died, claims a checkpoint it did not write, fails, finishes) and the cluster
agent (stops workloads, sometimes fails to, and sometimes is down for a while and
answers the commands it missed when it is back). Meanwhile the service is killed with
SIGKILL and restarted at random moments. After every run:

1. no workload was evicted without a verified confirmation of the stage its class
   requires, unless its class policy is FORCED and an audit record says so;
2. no saga is stuck past its deadline;
3. every saga ends in exactly one terminal state (one outcome event, matching the
   saga's stored state).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import signal
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from pydantic import BaseModel

from gpusched.checkpoint.api import get_saga_subject
from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointConfirmed,
    CheckpointFailed,
    EvictFailed,
    EvictionRequested,
    EvictionWithdrawn,
    JobCompleted,
    PriorityClassName,
    StageName,
    StopReason,
    T,
    WorkloadStopped,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra.settings import Settings
from tests.support.identity import harness_options
from tests.support.waiting import eventually, stream_messages_after

GRACE_S = 2.0
SAGAS_PER_RUN = 6
RUN_SPAN_S = 3.0  # inputs and kills happen within this many seconds of a run's start
SETTLE_S = 30.0  # after the last deadline: time for a restarted service to finish up
# Which stage each class waits for, and what its deadline does (the defaults).
CLASSES = {
    PriorityClassName.P1_NORMAL: (StageName.PERSISTED, "abort"),
    PriorityClassName.P2_OFFLINE: (StageName.SNAPSHOTTED, "force"),
}
OUTCOMES = (T.EVICTION_COMPLETED, T.EVICTION_ABORTED, T.EVICTION_FORCED, T.EVICTION_CANCELLED)
STATE_OF_OUTCOME = {
    T.EVICTION_COMPLETED: {"completed"},
    T.EVICTION_ABORTED: {"aborted"},
    T.EVICTION_FORCED: {"forced"},
    T.EVICTION_CANCELLED: {"cancelled", "completed"},  # completed: the job finished
}


class Behaviour(StrEnum):
    PROMPT = "prompt"  # confirms the required stage at once
    LATE = "late"  # snapshot soon, the durable copy later (maybe after the deadline)
    SILENT = "silent"  # its process died: never answers
    LIAR = "liar"  # claims a checkpoint whose sha256 is not what it wrote
    FAILS = "fails"  # checkpoint.failed
    FINISHES = "finishes"  # job.completed during the saga


@dataclass
class Victim:
    job_id: str
    allocation_id: str
    request_id: str
    priority_class: PriorityClassName
    behaviour: Behaviour
    withdraw_after: float | None
    # When a true claim of the required stage was published (None: never).
    confirmed_at: datetime | None = None


@dataclass
class Bus:
    """Everything seen under the test's prefix (core NATS), in arrival order."""

    messages: list[tuple[str, Envelope]] = field(default_factory=list)
    waiters: list[asyncio.Queue[tuple[str, Envelope]]] = field(default_factory=list)

    async def on_message(self, msg: Msg) -> None:
        try:
            env = Envelope.from_bytes(msg.data)
        except Exception:
            return
        self.messages.append((msg.subject, env))
        for q in self.waiters:
            q.put_nowait((msg.subject, env))


@dataclass
class Chaos:
    stack: Stack
    nc: NatsClient
    js: JetStreamContext
    s: Subjects
    bus: Bus
    files: Path

    async def publish(
        self, subject: str, message_type: str, data: BaseModel, correlation_id: str | None = None
    ) -> None:
        env = make_envelope(message_type, data, source="chaos", correlation_id=correlation_id)
        await self.js.publish(subject, env.to_bytes(), headers={"Nats-Msg-Id": env.id})

    async def marks(self) -> dict[str, int]:
        """Each stream's last sequence now: a run is judged on what came after its mark."""
        return {info.config.name: info.state.last_seq for info in await self.js.streams_info()}

    async def stored(self, subject: str, marks: dict[str, int]) -> list[Envelope]:
        stream = await self.js.find_stream_name_by_subject(subject)
        msgs = await stream_messages_after(self.js, subject, marks.get(stream, 0))
        return [Envelope.from_bytes(m.data) for m in msgs]

    def kill_service(self) -> None:
        assert self.stack.supervisor is not None
        self.stack.supervisor.kill("checkpoint", signal.SIGKILL)

    def restart_service(self) -> None:
        assert self.stack.supervisor is not None
        self.stack.supervisor.restart("checkpoint")


@pytest.fixture
def checkpoint_stack(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(
        settings.model_copy(update={"data_dir": tmp_path / "data"}),
        services=("checkpoint",),
        env={
            "GPUSCHED_CHECKPOINT__GRACE_S": str(GRACE_S),
            "GPUSCHED_CHECKPOINT__SWEEP_INTERVAL_S": "0.1",
            "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
            "GPUSCHED_LOG_LEVEL": "WARNING",
        },
        log_dir=tmp_path / "logs",
    )
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture
async def chaos(checkpoint_stack: Stack, tmp_path: Path) -> AsyncIterator[Chaos]:
    settings = checkpoint_stack.settings
    assert settings.nats_url
    s = Subjects(settings.subject_prefix)
    bus = Bus()
    nc = await nats.connect(settings.nats_url, **harness_options(settings))
    await nc.subscribe(f"{s.prefix}.>", cb=bus.on_message)
    try:
        yield Chaos(checkpoint_stack, nc, nc.jetstream(), s, bus, tmp_path / "checkpoints")
    finally:
        await nc.close()


# --- the roles ----------------------------------------------------------------------------


def new_victim(rng: random.Random) -> Victim:
    tag = uuid.UUID(int=rng.getrandbits(128)).hex[:12]
    return Victim(
        job_id=f"job-{tag}",
        allocation_id=f"alloc-{tag}",
        request_id=f"req-{tag}",
        priority_class=rng.choice(list(CLASSES)),
        behaviour=rng.choice(list(Behaviour)),
        withdraw_after=rng.uniform(0, RUN_SPAN_S) if rng.random() < 0.2 else None,
    )


async def request_eviction(c: Chaos, v: Victim) -> None:
    payload = EvictionRequested(
        request_id=v.request_id,
        decision_id=f"decision-{v.request_id}",
        allocation_id=v.allocation_id,
        job_id=v.job_id,
        team="chaos",
        priority_class=v.priority_class,
        gpus=2,
        started_at=datetime.now(UTC) - timedelta(minutes=10),
        reason="chaos surge",
    )
    await c.publish(c.s.command("checkpoint", T.EVICTION_REQUESTED), T.EVICTION_REQUESTED, payload)


async def claim(c: Chaos, v: Victim, step: int, stage: StageName, *, true: bool) -> None:
    path = c.files / v.job_id / f"step-{step}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = f"{v.job_id}:{step}".encode()
    path.write_bytes(data)
    digest = hashlib.sha256(data).hexdigest() if true else "f" * 64
    required, _ = CLASSES[v.priority_class]
    if (
        true
        and v.confirmed_at is None
        and (stage, required)
        != (
            StageName.SNAPSHOTTED,
            StageName.PERSISTED,
        )
    ):
        # Stamped before publishing: an evict caused by it can only be later.
        v.confirmed_at = datetime.now(UTC)
    payload = CheckpointConfirmed(
        request_id=v.request_id,
        checkpoint_id=f"{v.job_id}-{step}",
        step=step,
        uri=path.as_uri(),
        bytes=len(data),
        sha256=digest,
        stage=stage,
    )
    await c.publish(
        c.s.job_events(v.job_id), T.CHECKPOINT_CONFIRMED, payload, correlation_id=v.job_id
    )


async def play_job(c: Chaos, v: Victim, rng: random.Random) -> None:
    """The job's answer to its checkpoint request (the test sends it as soon as the
    request is out, or after the delay the behaviour asks for)."""
    q: asyncio.Queue[tuple[str, Envelope]] = asyncio.Queue()
    c.bus.waiters.append(q)
    try:
        while True:
            subject, env = await q.get()
            if subject == c.s.job_control(v.job_id) and env.type == T.CHECKPOINT_REQUESTED:
                break
    finally:
        c.bus.waiters.remove(q)
    events = c.s.job_events(v.job_id)
    match v.behaviour:
        case Behaviour.PROMPT:
            await claim(c, v, 100, StageName.PERSISTED, true=True)
        case Behaviour.LATE:
            await asyncio.sleep(rng.uniform(0, 0.5))
            await claim(c, v, 100, StageName.SNAPSHOTTED, true=True)
            await asyncio.sleep(rng.uniform(0, GRACE_S * 1.5))
            await claim(c, v, 100, StageName.PERSISTED, true=True)
        case Behaviour.SILENT:
            pass
        case Behaviour.LIAR:
            await claim(c, v, 100, StageName.PERSISTED, true=False)
        case Behaviour.FAILS:
            failure = CheckpointFailed(request_id=v.request_id, error="disk full")
            await c.publish(events, T.CHECKPOINT_FAILED, failure, correlation_id=v.job_id)
        case Behaviour.FINISHES:
            done = JobCompleted(job_id=v.job_id, step=100)
            await c.publish(events, T.JOB_COMPLETED, done, correlation_id=v.job_id)


async def play_preemption(c: Chaos, v: Victim) -> None:
    await request_eviction(c, v)
    if v.withdraw_after is not None:
        await asyncio.sleep(v.withdraw_after)
        withdrawn = EvictionWithdrawn(request_id=v.request_id, reason="load fell")
        subject = c.s.command("checkpoint", T.EVICTION_WITHDRAWN)
        await c.publish(subject, T.EVICTION_WITHDRAWN, withdrawn)


async def play_agent(
    c: Chaos, rng: random.Random, down: list[tuple[float, float]], jobs: set[str]
) -> None:
    """Answers every evict command once; while `down`, it misses them and answers them
    when it is back (as a restarted agent does with its redelivered commands)."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    answered: set[str] = set()
    evicts = c.s.command("agent", T.EVICT_WORKLOAD)
    while True:
        now = loop.time() - start
        if not any(a <= now < b for a, b in down):
            for subject, env in list(c.bus.messages):
                if subject != evicts or env.id in answered or env.data["job_id"] not in jobs:
                    continue
                answered.add(env.id)
                data = env.data
                if rng.random() < 0.15:
                    failed = EvictFailed(
                        allocation_id=data["allocation_id"],
                        job_id=data["job_id"],
                        saga_id=data["saga_id"],
                        error="node unreachable",
                    )
                    await c.publish(c.s.event("agent", T.EVICT_FAILED), T.EVICT_FAILED, failed)
                else:
                    stopped = WorkloadStopped(
                        allocation_id=data["allocation_id"],
                        job_id=data["job_id"],
                        reason=StopReason.EVICTED,
                        stopped_at=datetime.now(UTC),
                        saga_id=data["saga_id"],
                    )
                    subject_ = c.s.event("agent", T.WORKLOAD_STOPPED)
                    await c.publish(subject_, T.WORKLOAD_STOPPED, stopped)
        await asyncio.sleep(0.05)


async def play_crashes(c: Chaos, rng: random.Random) -> int:
    kills = rng.randint(1, 3)
    for _ in range(kills):
        await asyncio.sleep(rng.uniform(0, RUN_SPAN_S / kills))
        c.kill_service()
        await asyncio.sleep(rng.uniform(0, 0.5))
        await asyncio.to_thread(c.restart_service)
    return kills


# --- one run and its checks ------------------------------------------------------------------


async def saga_of(c: Chaos, job_id: str) -> dict[str, Any] | None:
    try:
        reply = await c.nc.request(
            get_saga_subject(c.s), json.dumps({"job_id": job_id}).encode(), timeout=2
        )
    except Exception:
        return None  # the service is restarting
    answer = json.loads(reply.data)
    saga: dict[str, Any] | None = answer.get("saga")
    return saga


async def chaos_run(c: Chaos, seed: int) -> list[str]:
    """One randomized run; the invariant violations it found."""
    rng = random.Random(seed)
    marks = await c.marks()
    victims = [new_victim(rng) for _ in range(SAGAS_PER_RUN)]
    agent_down = [(a, a + rng.uniform(0.5, 2.0)) for a in [rng.uniform(0, RUN_SPAN_S)]]
    agent = asyncio.create_task(
        play_agent(c, random.Random(seed + 1), agent_down, {v.job_id for v in victims})
    )
    jobs = [asyncio.create_task(play_job(c, v, random.Random(seed + 2 + i))) for i, v in
            enumerate(victims)]  # fmt: skip
    try:
        await asyncio.gather(*(play_preemption(c, v) for v in victims), play_crashes(c, rng))
        sagas: dict[str, dict[str, Any]] = {}

        async def all_terminal() -> bool:
            for v in victims:
                saga = await saga_of(c, v.job_id)
                if saga is not None:
                    sagas[v.job_id] = saga
            return len(sagas) == len(victims) and all(
                s["state"] in {"completed", "cancelled", "aborted", "forced"}
                for s in sagas.values()
            )

        with contextlib.suppress(AssertionError):  # judged below, saga by saga
            await eventually(all_terminal, within=GRACE_S + SETTLE_S)
    finally:
        agent.cancel()
        for task in jobs:
            task.cancel()
        await asyncio.gather(agent, *jobs, return_exceptions=True)
    return await judge_run(c, victims, sagas, seed, marks)


async def judge_run(
    c: Chaos,
    victims: list[Victim],
    sagas: dict[str, dict[str, Any]],
    seed: int,
    marks: dict[str, int],
) -> list[str]:
    violations: list[str] = []
    evicts = await c.stored(c.s.command("agent", T.EVICT_WORKLOAD), marks)
    outcomes = await c.stored(c.s.event("checkpoint", ">"), marks)
    forced_audits = await c.stored(c.s.audit("eviction.forced"), marks)
    now = datetime.now(UTC)
    for v in victims:
        where = f"seed {seed}, job {v.job_id} ({v.priority_class.value}, {v.behaviour.value})"
        saga = sagas.get(v.job_id)
        if saga is None:
            violations.append(f"{where}: no saga")
            continue
        # 2. Nothing stuck past its deadline.
        if saga["state"] not in {"completed", "cancelled", "aborted", "forced"}:
            deadline = datetime.fromisoformat(saga["deadline"])
            violations.append(f"{where}: stuck in {saga['state']} (deadline {deadline}, now {now})")
        # 3. Exactly one terminal state.
        ended = [e for e in outcomes if e.type in OUTCOMES and e.data["saga_id"] == saga["saga_id"]]
        if len(ended) != 1:
            violations.append(f"{where}: {len(ended)} outcome events {[e.type for e in ended]}")
        elif saga["state"] not in STATE_OF_OUTCOME[T(ended[0].type)]:
            violations.append(f"{where}: outcome {ended[0].type} but state {saga['state']}")
        # 1. No eviction without a verified confirmation, unless forced and audited.
        for evict in (e for e in evicts if e.data["saga_id"] == saga["saga_id"]):
            if evict.data["forced"]:
                _, policy = CLASSES[v.priority_class]
                audited = any(a.data["entity"] == saga["saga_id"] for a in forced_audits)
                if policy != "force" or saga["state"] != "forced" or not audited:
                    violations.append(f"{where}: forced evict (policy {policy}, audited {audited})")
            elif v.confirmed_at is None or evict.time < v.confirmed_at:
                violations.append(f"{where}: evicted without a verified confirmation")
    return violations


async def test_killing_the_checkpoint_service_mid_saga_never_breaks_the_saga_invariants(
    chaos: Chaos,
) -> None:
    violations: list[str] = []
    for seed in range(5):
        violations += await chaos_run(chaos, seed)
    assert violations == []


@pytest.mark.slow
async def test_two_hundred_chaos_runs_find_no_violation(chaos: Chaos) -> None:
    violations: list[str] = []
    for seed in range(200):
        violations += await chaos_run(chaos, 1000 + seed)
        if (seed + 1) % 20 == 0:
            print(f"chaos: {seed + 1}/200 runs, {len(violations)} violations so far", flush=True)
    print(f"chaos: 200 runs, {len(violations)} violations")
    for line in violations:
        print(line)
    assert violations == []
