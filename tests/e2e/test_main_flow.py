"""End to end: every service as a real process on real NATS and PostgreSQL.

The simulated cluster runs virtual training loops that speak the public job
contract through the client SDK. The test only talks to the system the way its
users do: the jobs API, the simulated inference demand, and the bus.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from gpusched.cli.client import ApiClient
from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import GpuRequest, PriorityClassName, SubmitJob, T, WorkloadSpec
from gpusched.contracts.subjects import Subjects
from gpusched.infra.settings import Settings
from gpusched.simcluster.demand import SIM_DEMAND, InferenceDemand
from tests.support.identity import harness_options
from tests.support.waiting import eventually

FAST = {
    "GPUSCHED_INGEST__WINDOW_S": "1.5",
    "GPUSCHED_INGEST__SNAPSHOT_INTERVAL_S": "0.5",
    "GPUSCHED_AGENT__TELEMETRY_INTERVAL_S": "0.25",
    "GPUSCHED_ADMISSION__SCHEDULE_INTERVAL_S": "0.25",
    "GPUSCHED_PREEMPTION__COOLDOWN_S": "1",
    # Act on the first hot/cold reading and on jobs seconds old (the windows, the
    # minimum lend and the minimum runtime have their own tests).
    "GPUSCHED_PREEMPTION__EXPAND_HOLD_S": "0",
    "GPUSCHED_PREEMPTION__SHRINK_HOLD_S": "0",
    "GPUSCHED_PREEMPTION__MIN_LEND_S": "0",
    "GPUSCHED_PREEMPTION__MIN_RUNTIME_S": "0",
    # The e2e jobs keep the shared pool at 95%: lift the shared-pool gate so the lent
    # GPUs can go back (the gate itself is covered in tests/unit/test_preemption_policy.py).
    "GPUSCHED_PREEMPTION__SHARED_BELOW": "1.0",
    "GPUSCHED_CHECKPOINT__SWEEP_INTERVAL_S": "0.2",
    "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
    "GPUSCHED_LOG_LEVEL": "WARNING",
    # Every class waits for the durable (persisted) stage, so a slow persist is a job
    # that cannot confirm in time.
    "GPUSCHED_CHECKPOINT__STAGE_REQUIRED": json.dumps(
        {"p0-urgent": "persisted", "p1-normal": "persisted", "p2-offline": "persisted"}
    ),
}


@dataclass
class Recorder:
    """Everything that crossed the bus under the test's prefix, in arrival order."""

    messages: list[tuple[float, str, str, dict[str, Any], str | None]] = field(default_factory=list)

    async def on_message(self, msg: Msg) -> None:
        try:
            env = Envelope.from_bytes(msg.data)
        except Exception:
            return
        self.messages.append(
            (time.monotonic(), msg.subject, env.type, env.data, env.correlation_id)
        )

    def of(self, message_type: str, **match: Any) -> list[dict[str, Any]]:
        return [
            d
            for _, _, t, d, _ in self.messages
            if t == message_type and all(d.get(k) == v for k, v in match.items())
        ]

    def index(self, message_type: str, **match: Any) -> int | None:
        for i, (_, _, t, d, _) in enumerate(self.messages):
            if t == message_type and all(d.get(k) == v for k, v in match.items()):
                return i
        return None

    def confirmations(self, job_id: str) -> list[tuple[int, dict[str, Any]]]:
        return [
            (i, d)
            for i, (_, _, t, d, corr) in enumerate(self.messages)
            if t == T.CHECKPOINT_CONFIRMED and corr == job_id
        ]


@dataclass
class Cluster:
    settings: Settings
    api: ApiClient
    nc: NatsClient
    bus: Recorder
    subjects: Subjects

    async def submit(
        self, name: str, priority: PriorityClassName, gpus: int, *, checkpoint_s: float = 0.2
    ) -> str:
        reply = await self.api.submit(
            SubmitJob(
                name=name,
                team="e2e",
                priority_class=priority,
                gpus=GpuRequest(count=gpus),
                workload=WorkloadSpec(
                    kind="sim", steps=1_000_000, step_seconds=0.05, checkpoint_seconds=checkpoint_s
                ),
            )
        )
        assert reply.ok and reply.job_id, reply
        return reply.job_id

    async def state(self, job_id: str) -> str:
        reply = await self.api.get(job_id)
        assert reply.ok and reply.job
        return reply.job.state

    async def demand(self, gpus: float) -> None:
        env = make_envelope(SIM_DEMAND, InferenceDemand(gpus=gpus), source="e2e")
        await self.nc.jetstream().publish(
            self.subjects.command("agent", SIM_DEMAND), env.to_bytes(),
            headers={"Nats-Msg-Id": env.id},
        )  # fmt: skip


def start_stack(settings: Settings, tmp_path: Path, extra: dict[str, str]) -> Iterator[Stack]:
    stack = Stack(settings, env={**FAST, **extra}, log_dir=tmp_path / "logs")
    stack.start()
    try:
        yield stack
    finally:
        stack.stop()


async def cluster_on(settings: Settings) -> AsyncIterator[Cluster]:
    assert settings.nats_url
    subjects = Subjects(settings.subject_prefix)
    recorder = Recorder()
    nc = await nats.connect(settings.nats_url, **harness_options(settings))
    for subject in (
        f"{subjects.prefix}.evt.>",
        f"{subjects.prefix}.cmd.>",
        f"{subjects.prefix}.jobs.>",
    ):
        await nc.subscribe(subject, cb=recorder.on_message)
    try:
        async with ApiClient(
            settings.nats_url, settings.subject_prefix, credentials=settings.nats_credentials
        ) as api:
            await api.wait_until_serving()
            yield Cluster(settings, api, nc, recorder, subjects)
    finally:
        await nc.close()


def _stack_settings(settings: Settings, tmp_path: Path) -> Settings:
    inventory = Path(__file__).resolve().parents[2] / "deploy" / "inventory" / "demo.yaml"
    assert inventory.exists()
    return settings.model_copy(
        update={"data_dir": tmp_path / "data", "trace_file": tmp_path / "spans.jsonl"}
    )


@pytest.fixture
def stack_default(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    yield from start_stack(
        _stack_settings(settings, tmp_path), tmp_path, {"GPUSCHED_CHECKPOINT__GRACE_S": "30"}
    )


@pytest.fixture
async def cluster(stack_default: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack_default.settings):
        yield c


async def test_a_surge_evicts_only_after_the_confirmed_checkpoint_and_the_job_resumes_from_it(
    cluster: Cluster,
) -> None:
    offline = await cluster.submit("offline", PriorityClassName.P2_OFFLINE, 8)
    normal = await cluster.submit("normal", PriorityClassName.P1_NORMAL, 16)
    urgent = await cluster.submit("urgent", PriorityClassName.P0_URGENT, 16)
    for job in (offline, normal, urgent):
        await eventually(lambda job=job: _is(cluster, job, "running"), within=30)

    await cluster.demand(22.0)  # need = ceil(22/0.7) - 24 = 8 GPUs: the p2 job exactly
    [completed] = await eventually(
        lambda: _async(cluster.bus.of(T.EVICTION_COMPLETED, job_id=offline)), within=60
    )

    # Exactly one evict, for the p2 job, sent after its confirmation (of the stage its
    # class requires) for the very request the saga made.
    evicts = cluster.bus.of(T.EVICT_WORKLOAD)
    assert [e["job_id"] for e in evicts] == [offline]
    [request] = cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=offline)
    evict_at = cluster.bus.index(T.EVICT_WORKLOAD, job_id=offline)
    confirmed = [
        i for i, d in cluster.bus.confirmations(offline)
        if d["request_id"] == request["request_id"]
        and (d["stage"] == "persisted" or request["stage_required"] == "snapshotted")
    ]  # fmt: skip
    assert confirmed and evict_at is not None and confirmed[0] < evict_at
    assert completed["checkpoint"]["checkpoint_id"]

    await cluster.demand(2.0)
    await eventually(lambda: _async(cluster.bus.of(T.GPUS_RETURNED)), within=60)
    await eventually(lambda: _attempt_running(cluster, offline, 2), within=60)
    reply = await cluster.api.get(offline)
    assert reply.job and reply.job.resume_from
    assert reply.job.resume_from.checkpoint_id == completed["checkpoint"]["checkpoint_id"]
    # The new attempt announces itself once its workload is up.
    started = await eventually(
        lambda: _async(
            [
                d for _, _, t, d, corr in cluster.bus.messages
                if t == T.JOB_STARTED and corr == offline and d.get("resumed_from")
            ]
        ),
        within=30,
    )  # fmt: skip
    assert started[-1]["resumed_from"] == completed["checkpoint"]["checkpoint_id"]
    # The jobs above p2 were never touched.
    assert not cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=urgent)
    assert not cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=normal)

    # One trace follows the job from its submit, across every service, to its eviction.
    assert cluster.settings.trace_file is not None
    p = cluster.subjects.prefix
    journey = [
        f"admission handle {p}.api.jobs.submit",
        "agent apply workload.start",
        "preemption apply allocation.granted",
        "checkpoint apply eviction.requested",
        "agent apply workload.evict",
        "checkpoint apply workload.stopped",
        "admission apply eviction.completed",
    ]
    await eventually(
        lambda: _async(_one_trace_has(cluster.settings.trace_file, journey)), within=30
    )


def _one_trace_has(trace_file: Path, names: list[str]) -> bool:
    """True when the trace of the (only) evict span holds a span of each name."""
    if not trace_file.exists():
        return False
    spans = [json.loads(line) for line in trace_file.read_text().splitlines() if line.strip()]
    evicts = [s["trace_id"] for s in spans if _label(s) == "agent apply workload.evict"]
    if not evicts:
        return False
    in_trace = {_label(s) for s in spans if s["trace_id"] == evicts[0]}
    return all(name in in_trace for name in names)


def _label(span: dict[str, Any]) -> str:
    """ "<service> apply <type>" for a message applied, "<service> <span name>" else."""
    message_type = span["attributes"].get("gpusched.message.type")
    if span["kind"] == "CONSUMER" and message_type:
        return f"{span['service']} apply {message_type}"
    return f"{span['service']} {span['name']}"


async def _is(cluster: Cluster, job_id: str, state: str) -> bool:
    return await cluster.state(job_id) == state


async def _attempt_running(cluster: Cluster, job_id: str, attempt: int) -> bool:
    reply = await cluster.api.get(job_id)
    return bool(reply.job and reply.job.state == "running" and reply.job.attempt >= attempt)


async def _async(value: Any) -> Any:
    return value


@pytest.fixture
def stack_short_grace(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    # A 2 s deadline; p2 jobs are forced at the deadline (the default), p1 jobs aborted.
    yield from start_stack(
        _stack_settings(settings, tmp_path), tmp_path, {"GPUSCHED_CHECKPOINT__GRACE_S": "2"}
    )


@pytest.fixture
async def short_grace(stack_short_grace: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack_short_grace.settings):
        yield c


async def _fill_shared_pool(
    cluster: Cluster, p2_checkpoint_s: float, p1_checkpoint_s: float = 0.2
) -> tuple[str, str]:
    """p2 (8 GPUs) + p1 (16) + p0 (16) fill the 40 shared GPUs; returns (p2, p1) ids."""
    p2 = await cluster.submit("p2", PriorityClassName.P2_OFFLINE, 8, checkpoint_s=p2_checkpoint_s)
    p1 = await cluster.submit("p1", PriorityClassName.P1_NORMAL, 16, checkpoint_s=p1_checkpoint_s)
    p0 = await cluster.submit("p0", PriorityClassName.P0_URGENT, 16)
    for job in (p2, p1, p0):
        await eventually(lambda job=job: _is(cluster, job, "running"), within=30)
    return p2, p1


async def test_a_job_that_cannot_checkpoint_in_time_is_forced_and_its_lost_work_recorded(
    short_grace: Cluster,
) -> None:
    cluster = short_grace
    slow, _ = await _fill_shared_pool(cluster, p2_checkpoint_s=60.0)

    await cluster.demand(22.0)
    [forced] = await eventually(
        lambda: _async(cluster.bus.of(T.EVICTION_FORCED, job_id=slow)), within=60
    )
    assert forced["lost_gpu_seconds"] > 0
    [evict] = cluster.bus.of(T.EVICT_WORKLOAD, job_id=slow)
    assert evict["forced"] is True
    # No confirmation of the required (persisted) stage arrived before the deadline: the
    # force is what the p2 policy says, and only then.
    [request] = cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=slow)
    assert request["stage_required"] == "persisted"
    evict_at = cluster.bus.index(T.EVICT_WORKLOAD, job_id=slow)
    assert not [
        i
        for i, d in cluster.bus.confirmations(slow)
        if d["request_id"] == request["request_id"] and d["stage"] == "persisted" and i < evict_at
    ]
    await eventually(lambda: _audited(cluster, "eviction.forced", forced["saga_id"]), within=20)
    # Billing credits the lost work to the team.
    bill = await eventually(lambda: _credited(cluster), within=20)
    assert bill


@pytest.fixture
def stack_abort(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    # A 2 s deadline, and every class aborts at the deadline instead of forcing.
    abort_all = {"p0-urgent": "abort", "p1-normal": "abort", "p2-offline": "abort"}
    yield from start_stack(
        _stack_settings(settings, tmp_path),
        tmp_path,
        {
            "GPUSCHED_CHECKPOINT__GRACE_S": "2",
            "GPUSCHED_CHECKPOINT__DEADLINE_POLICY": json.dumps(abort_all),
        },
    )


@pytest.fixture
async def abort_policy(stack_abort: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack_abort.settings):
        yield c


async def test_a_job_that_cannot_checkpoint_in_time_keeps_running_and_another_victim_goes(
    abort_policy: Cluster,
) -> None:
    cluster = abort_policy
    # The p2 job is chosen first but cannot persist within the deadline; the p1 job can.
    slow_p2, fast_p1 = await _fill_shared_pool(cluster, p2_checkpoint_s=60.0, p1_checkpoint_s=0.2)

    await cluster.demand(22.0)
    [aborted] = await eventually(
        lambda: _async(cluster.bus.of(T.EVICTION_ABORTED, job_id=slow_p2)), within=60
    )
    assert aborted["reason"]
    # The p2 job was told to keep training and was never evicted.
    [cancel] = await eventually(lambda: _async(cluster.bus.of(T.PREEMPTION_CANCELLED)), within=20)
    [request] = cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=slow_p2)
    assert cancel["request_id"] == request["request_id"]
    assert not cluster.bus.of(T.EVICT_WORKLOAD, job_id=slow_p2)
    assert await cluster.state(slow_p2) == "running"
    # Another victim was chosen in its place, and evicted only after its confirmation.
    [completed] = await eventually(
        lambda: _async(cluster.bus.of(T.EVICTION_COMPLETED, job_id=fast_p1)), within=60
    )
    assert completed["checkpoint"]["stage"] == "persisted"
    [replacement] = cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=fast_p1)
    evict_at = cluster.bus.index(T.EVICT_WORKLOAD, job_id=fast_p1)
    assert evict_at is not None and any(
        i < evict_at
        for i, d in cluster.bus.confirmations(fast_p1)
        if d["request_id"] == replacement["request_id"] and d["stage"] == "persisted"
    )


async def test_a_surge_that_ends_before_the_checkpoint_cancels_the_eviction(
    cluster: Cluster,
) -> None:
    slow, _ = await _fill_shared_pool(cluster, p2_checkpoint_s=15.0)

    await cluster.demand(22.0)
    await eventually(lambda: _async(cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=slow)), within=60)
    await cluster.demand(6.0)  # the need disappears while the job is still saving

    [cancelled] = await eventually(
        lambda: _async(cluster.bus.of(T.EVICTION_CANCELLED, job_id=slow)), within=60
    )
    assert cancelled["reason"]
    assert cluster.bus.of(T.PREEMPTION_CANCELLED)
    assert not cluster.bus.of(T.EVICT_WORKLOAD, job_id=slow)
    assert await cluster.state(slow) == "running"


async def _audited(cluster: Cluster, action: str, entity: str) -> bool:
    from tests.support.waiting import stream_messages

    msgs = await stream_messages(
        cluster.nc.jetstream(), cluster.subjects.audit(action), 1, within=5
    )
    return any(Envelope.from_bytes(m.data).data["entity"] == entity for m in msgs)


async def _credited(cluster: Cluster) -> bool:
    reply = await cluster.api.call("api.billing.statement", {"team": "e2e"})
    return (
        bool(reply.get("ok"))
        and "redit" in str(reply.get("text", ""))
        and any(s.get("credits") for s in reply.get("statements", []))
    )
