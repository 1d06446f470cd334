"""The cluster agent (simulated cluster) on the real NATS: the test plays admission and
the checkpoint service, sending commands and reading what the agent reports."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import pwd
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from pydantic import BaseModel
from tests.support.identity import harness_options, job_credentials
from tests.support.waiting import eventually, stream_messages

from gpusched.agent.app import start_agent
from gpusched.agent.handlers import ClusterAgent
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointInfo,
    CheckpointRequested,
    EvictWorkload,
    GpuRef,
    GpuSample,
    GpusReserved,
    InferenceStats,
    InventoryLoaded,
    InventoryNode,
    MigConfigure,
    StageName,
    StartWorkload,
    T,
    WorkloadSpec,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import AgentSettings, Settings
from gpusched.sdk import checkpoint_path
from gpusched.simcluster.demand import SIM_DEMAND, InferenceDemand

REPO = Path(__file__).resolve().parents[2]
# Every step of a teardown is bounded by this: a fixture never hangs a test run.
_STOP_S = 30.0
TRAIN_LOOP = REPO / "examples" / "train_loop.py"
# Who sends each command to the agent, as the envelope says (the agent checks it).
PRODUCER = {T.START_WORKLOAD: "admission", T.EVICT_WORKLOAD: "checkpoint"}


@dataclass
class Cluster:
    rt: ServiceRuntime
    agent: ClusterAgent
    running: asyncio.Task[None]

    async def stop_service(self) -> None:
        """Stop the agent's runtime; bounded: a runtime that does not stop in time is
        cancelled and its connection closed, so a test can never hang here."""
        self.rt.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.running), _STOP_S)
        except TimeoutError:
            self.running.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.running, _STOP_S)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.rt.nc.close(), _STOP_S)
            raise

    @property
    def s(self) -> Subjects:
        return self.rt.subjects

    async def send(
        self, subject: str, message_type: str, payload: BaseModel, source: str = "test"
    ) -> Envelope:
        envelope = make_envelope(message_type, payload, source=source)
        await self.rt.js.publish(subject, envelope.to_bytes(), headers={"Nats-Msg-Id": envelope.id})
        return envelope

    async def command(
        self, message_type: str, payload: BaseModel, source: str | None = None
    ) -> Envelope:
        """A command to the agent, from its real producer unless `source` says otherwise."""
        sender = source or PRODUCER.get(message_type, "test")
        return await self.send(self.s.command("agent", message_type), message_type, payload, sender)

    async def start(self, alloc: str, job: str, spec: WorkloadSpec, **kw: object) -> Envelope:
        gpus = [GpuRef(node="shared-00", index=i, model="A100-80GB") for i in (0, 1)]
        # As admission sends it: with the job's own credentials.
        kw.setdefault("credentials", job_credentials(self.rt.settings, job))
        start = StartWorkload(
            allocation_id=alloc, job_id=job, attempt=kw.pop("attempt", 1), gpus=gpus,
            workload=spec, **kw,
        )  # fmt: skip
        return await self.command(T.START_WORKLOAD, start)

    async def evict(self, alloc: str, job: str, saga: str) -> Envelope:
        return await self.command(
            T.EVICT_WORKLOAD, EvictWorkload(allocation_id=alloc, job_id=job, saga_id=saga)
        )

    async def events(self, subject: str, count: int) -> list[Envelope]:
        msgs = await stream_messages(self.rt.js, subject, count, within=30)
        return [Envelope.from_bytes(m.data) for m in msgs]

    async def stored(self, subject: str) -> int:
        """How many messages the stream holds on exactly this subject."""
        info = await self.rt.js.stream_info(self.s.stream("EVENTS"), subjects_filter=subject)
        return (info.state.subjects or {}).get(subject, 0)

    async def agent_events(self, message_type: str, count: int = 1) -> list[Envelope]:
        return await self.events(self.s.event("agent", message_type), count)

    async def job_events_until(
        self, job_id: str, done: Callable[[Envelope], bool]
    ) -> list[Envelope]:
        """The job's events, in order, up to and including the first `done` one."""
        got: list[Envelope] = []
        sub = await self.rt.js.subscribe(self.s.job_events(job_id), ordered_consumer=True)
        try:
            while not got or not done(got[-1]):
                got.append(Envelope.from_bytes((await sub.next_msg(timeout=30)).data))
        finally:
            await sub.unsubscribe()
        return got

    async def next_sample(
        self, subject: str, accept: Callable[[Envelope], bool], within: float = 20
    ) -> Envelope:
        sub = await self.rt.nc.subscribe(subject)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        last: Envelope | None = None
        try:
            while loop.time() < deadline:
                msg: Msg = await sub.next_msg(timeout=max(0.1, deadline - loop.time()))
                last = Envelope.from_bytes(msg.data)
                if accept(last):
                    return last
        finally:
            await sub.unsubscribe()
        raise AssertionError(f"no matching message on {subject} in {within}s (last: {last})")


@asynccontextmanager
async def running_cluster(
    settings: Settings, agent_settings: AgentSettings
) -> AsyncIterator[Cluster]:
    fast = settings.model_copy(update={"agent": agent_settings})
    rt = ServiceRuntime("agent", "agent", fast, None)
    await rt.start()
    agent = await start_agent(rt)
    task = asyncio.create_task(rt.run())
    harness = Cluster(rt, agent, task)
    await harness.send(
        rt.subjects.event("admission", T.INVENTORY_LOADED),
        T.INVENTORY_LOADED,
        InventoryLoaded(
            nodes=[
                InventoryNode(name="inf-00", pool="inference", gpu_model="A100-80GB", gpus=2),
                InventoryNode(name="shared-00", pool="shared", gpu_model="A100-80GB", gpus=4),
            ]
        ),
    )
    await eventually(lambda: _true(len(agent.view.nodes) == 2), within=20)
    try:
        yield harness
    finally:
        try:
            await asyncio.wait_for(agent.close(), _STOP_S)
        finally:
            await harness.stop_service()


def fast_agent(tmp_path: Path, **fields: Any) -> AgentSettings:
    return AgentSettings(
        **{"telemetry_interval_s": 0.2, "time_scale": 1.0, "workdir": tmp_path / "agent", **fields}
    )


@pytest.fixture
async def cluster(settings: Settings, tmp_path: Path) -> AsyncIterator[Cluster]:
    """The agent as deployed: process workloads run as `nobody` (under root)."""
    async with running_cluster(settings, fast_agent(tmp_path)) as harness:
        yield harness


@pytest.fixture
async def python_cluster(settings: Settings, tmp_path: Path) -> AsyncIterator[Cluster]:
    """For tests of a Python job's life (checkpoint, evict, exit), not of its identity:
    the test's interpreter and its SDK may sit where an unprivileged user cannot read
    them (a private home directory), so the agent is explicitly allowed to run its
    workloads as root. The identity tests below use the `cluster` fixture."""
    allowed = fast_agent(tmp_path, run_as="root", allow_root_workloads=True)
    async with running_cluster(settings, allowed) as harness:
        yield harness


def sim(
    steps: int = 100_000, step_seconds: float = 0.05, checkpoint_seconds: float = 0.2
) -> WorkloadSpec:
    return WorkloadSpec(
        kind="sim", steps=steps, step_seconds=step_seconds, checkpoint_seconds=checkpoint_seconds
    )


def process(*args: str) -> WorkloadSpec:
    return WorkloadSpec(kind="process", argv=["python", str(TRAIN_LOOP), *args])


async def request_checkpoint(c: Cluster, job_id: str, request_id: str) -> Envelope:
    return await c.send(
        c.s.job_control(job_id),
        T.CHECKPOINT_REQUESTED,
        CheckpointRequested(
            request_id=request_id,
            job_id=job_id,
            reason="inference surge",
            deadline=datetime.now(UTC) + timedelta(minutes=5),
            stage_required=StageName.PERSISTED,
        ),
    )


def _is(message_type: str) -> Callable[[Envelope], bool]:
    return lambda e: e.type == message_type


def _persisted(e: Envelope) -> bool:
    return e.type == T.CHECKPOINT_CONFIRMED and e.data["stage"] == "persisted"


async def _true(value: bool) -> bool:
    return value


def processes_of(job_id: str) -> list[int]:
    """Live processes (not zombies) launched for this job, found by their environment."""
    found = []
    marker = f"GPUSCHED_JOB_ID={job_id}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in environ and state != "Z":
            found.append(int(entry.name))
    return found


# --- sim workloads -------------------------------------------------------------------------


async def test_a_started_sim_workload_is_reported_announces_itself_and_loads_its_gpus(
    cluster: Cluster,
) -> None:
    command = await cluster.start("alloc-1", "job-1", sim())

    [started] = await cluster.agent_events(T.WORKLOAD_STARTED)
    assert started.data["allocation_id"] == "alloc-1"
    assert started.data["node"] == "shared-00"
    assert started.causation_id == command.id
    job_started, *_ = await cluster.job_events_until("job-1", _is(T.JOB_PROGRESS))
    assert job_started.type == T.JOB_STARTED
    assert job_started.data == {"job_id": "job-1", "attempt": 1, "resumed_from": None}

    sample = await cluster.next_sample(
        cluster.s.telemetry_gpu("shared-00"),
        lambda e: GpuSample.model_validate(e.data).gpus[0].util > 0.5,
    )
    utils = [g.util for g in GpuSample.model_validate(sample.data).gpus]
    assert len(utils) == 4
    assert all(0.9 <= u <= 1.0 for u in utils[:2])
    assert utils[2:] == [0.0, 0.0]


async def test_a_sim_job_runs_to_its_last_step_and_is_reported_completed(
    cluster: Cluster,
) -> None:
    await cluster.start("alloc-2", "job-2", sim(steps=20, step_seconds=0.02))

    events = await cluster.job_events_until("job-2", _is(T.JOB_COMPLETED))
    assert events[-1].data == {"job_id": "job-2", "step": 20}
    assert [e.data["step"] for e in events if e.type == T.JOB_PROGRESS][-1] == 20
    [stopped] = await cluster.agent_events(T.WORKLOAD_STOPPED)
    assert (stopped.data["reason"], stopped.data["exit_code"]) == ("completed", 0)
    assert cluster.agent.running_allocations == []


# Signal-based: without the counted catch-up the event loop never gets back control, so
# only an alarm can end the test.
@pytest.mark.timeout(120)
async def test_a_sim_step_too_short_for_the_clock_finishes_the_run_without_holding_the_agent(
    settings: Settings, tmp_path: Path
) -> None:
    # A 1 ms step under time_scale 1e297 lasts 1e-300 s of wall time: adding it to the
    # clock changes nothing, and a trillion of them were once taken one by one.
    hostile = fast_agent(tmp_path, time_scale=1e297)
    steps = 10**12
    async with running_cluster(settings, hostile) as c:
        async with asyncio.timeout(60):
            await c.start("alloc-h", "job-h", sim(steps=steps, step_seconds=1e-3))
            # The agent goes on serving: a job started after it runs and ends too.
            await c.start("alloc-n", "job-n", sim(steps=20, step_seconds=1e-3))
            events = await c.job_events_until("job-h", _is(T.JOB_COMPLETED))
            after = await c.job_events_until("job-n", _is(T.JOB_COMPLETED))
            stopped = await c.agent_events(T.WORKLOAD_STOPPED, 2)
        assert events[-1].data == {"job_id": "job-h", "step": steps}
        assert [e.data["step"] for e in events if e.type == T.JOB_PROGRESS] == [steps]
        assert after[-1].data == {"job_id": "job-n", "step": 20}
        assert sorted(e.data["allocation_id"] for e in stopped) == ["alloc-h", "alloc-n"]
        assert {(e.data["reason"], e.data["exit_code"]) for e in stopped} == {("completed", 0)}
        assert c.agent.running_allocations == []


async def test_an_evicted_workload_is_stopped_and_reported_evicted_once_for_its_saga(
    cluster: Cluster,
) -> None:
    await cluster.start("alloc-3", "job-3", sim())
    await cluster.agent_events(T.WORKLOAD_STARTED)

    await cluster.evict("alloc-3", "job-3", "saga-3")
    [stopped] = await cluster.agent_events(T.WORKLOAD_STOPPED)
    assert stopped.data["reason"] == "evicted"
    assert stopped.data["saga_id"] == "saga-3"
    assert stopped.correlation_id == "saga-3"
    assert cluster.agent.running_allocations == []

    # A re-sent evict gets the same answer, which JetStream stores only once.
    await cluster.evict("alloc-3", "job-3", "saga-3")
    await cluster.evict("alloc-unknown", "job-3", "saga-x")
    await cluster.agent_events(T.EVICT_FAILED)  # handled in order: the re-sent one is done
    assert await cluster.stored(cluster.s.event("agent", T.WORKLOAD_STOPPED)) == 1


async def test_evicting_an_allocation_this_cluster_does_not_run_reports_evict_failed(
    cluster: Cluster,
) -> None:
    command = await cluster.evict("alloc-404", "job-404", "saga-404")

    [failed] = await cluster.agent_events(T.EVICT_FAILED)
    assert failed.data == {
        "allocation_id": "alloc-404",
        "job_id": "job-404",
        "saga_id": "saga-404",
        "error": "no such workload on this cluster",
    }
    assert failed.causation_id == command.id


async def test_a_start_delivered_twice_runs_one_workload(cluster: Cluster) -> None:
    await cluster.start("alloc-5", "job-5", sim())
    await cluster.start("alloc-5", "job-5", sim())
    await cluster.evict("alloc-none", "job-5", "saga-marker")
    await cluster.agent_events(T.EVICT_FAILED)  # both starts were handled before this

    assert cluster.agent.running_allocations == ["alloc-5"]
    assert await cluster.stored(cluster.s.event("agent", T.WORKLOAD_STARTED)) == 1
    job_started = [e for e in await cluster.job_events_until("job-5", _is(T.JOB_PROGRESS))
                   if e.type == T.JOB_STARTED]  # fmt: skip
    assert len(job_started) == 1


async def test_a_sim_job_answers_a_checkpoint_request_with_a_real_file_and_resumes_from_it(
    cluster: Cluster,
) -> None:
    await cluster.start("alloc-6", "job-6", sim())
    await cluster.job_events_until("job-6", _is(T.JOB_PROGRESS))

    request = await request_checkpoint(cluster, "job-6", "req-6")
    events = await cluster.job_events_until("job-6", _persisted)
    confirmed = [e for e in events if e.type == T.CHECKPOINT_CONFIRMED]
    assert [e.data["stage"] for e in confirmed] == ["snapshotted", "persisted"]
    data = confirmed[-1].data
    assert data["request_id"] == "req-6"
    assert confirmed[-1].causation_id == request.id
    content = checkpoint_path(data["uri"]).read_bytes()
    assert hashlib.sha256(content).hexdigest() == data["sha256"]
    assert data["bytes"] == len(content)
    assert data["step"] > 0

    await cluster.evict("alloc-6", "job-6", "saga-6")
    await cluster.agent_events(T.WORKLOAD_STOPPED)
    resume = CheckpointInfo(**{k: data[k] for k in CheckpointInfo.model_fields})
    await cluster.start("alloc-7", "job-6", sim(), attempt=2, resume_from=resume)

    events = await cluster.job_events_until(
        "job-6", lambda e: e.type == T.JOB_STARTED and e.data["attempt"] == 2
    )
    assert events[-1].data["resumed_from"] == data["checkpoint_id"]
    after = await cluster.job_events_until(
        "job-6", lambda e: e.type == T.JOB_PROGRESS and e.data["step"] > data["step"]
    )
    progress = [e.data["step"] for e in after[len(events) :] if e.type == T.JOB_PROGRESS]
    assert progress[0] > data["step"]  # it continued from the checkpoint, not from 0


async def test_inference_demand_sets_the_utilization_of_every_serving_gpu(
    cluster: Cluster,
) -> None:
    # Admission lends shared-00 GPU 3 to inference: 3 GPUs serve now.
    await cluster.send(
        cluster.s.event("admission", T.GPUS_RESERVED),
        T.GPUS_RESERVED,
        GpusReserved(
            reservation_id="res-1", gpus=[GpuRef(node="shared-00", index=3, model="A100-80GB")]
        ),
    )
    await cluster.command(SIM_DEMAND, InferenceDemand(gpus=2.4))

    def at_80_percent(e: Envelope) -> bool:
        return GpuSample.model_validate(e.data).gpus[0].util == pytest.approx(0.8)

    await cluster.next_sample(cluster.s.telemetry_gpu("inf-00"), at_80_percent)
    lent = await cluster.next_sample(
        cluster.s.telemetry_gpu("shared-00"),
        lambda e: GpuSample.model_validate(e.data).gpus[3].util == pytest.approx(0.8),
    )
    assert GpuSample.model_validate(lent.data).gpus[0].util == 0.0
    busy = await cluster.next_sample(
        cluster.s.telemetry_inference("chat"), lambda e: e.data["requests"] > 0
    )
    await cluster.command(SIM_DEMAND, InferenceDemand(gpus=0.6))
    calm = await cluster.next_sample(
        cluster.s.telemetry_inference("chat"),
        lambda e: InferenceStats.model_validate(e.data).p99_ms < busy.data["p99_ms"],
    )
    assert calm.data["requests"] < busy.data["requests"]


# --- process workloads ---------------------------------------------------------------------


async def test_a_process_workload_checkpoints_is_evicted_with_sigterm_and_leaves_no_process(
    python_cluster: Cluster,
) -> None:
    cluster = python_cluster
    await cluster.start("alloc-8", "job-8", process("--steps", "100000", "--step-seconds", "0.02"))
    await cluster.agent_events(T.WORKLOAD_STARTED)
    await cluster.job_events_until("job-8", _is(T.JOB_PROGRESS))
    assert processes_of("job-8")

    await request_checkpoint(cluster, "job-8", "req-8")
    events = await cluster.job_events_until("job-8", _persisted)
    data = events[-1].data
    assert data["request_id"] == "req-8"
    content = checkpoint_path(data["uri"]).read_bytes()
    assert hashlib.sha256(content).hexdigest() == data["sha256"]

    await cluster.evict("alloc-8", "job-8", "saga-8")
    [stopped] = await cluster.agent_events(T.WORKLOAD_STOPPED)
    assert stopped.data["reason"] == "evicted"
    assert stopped.data["exit_code"] == 128 + 15  # the loop exited on SIGTERM by itself
    assert processes_of("job-8") == []


async def test_a_process_that_exits_zero_is_reported_completed_and_one_that_fails_failed(
    python_cluster: Cluster,
) -> None:
    cluster = python_cluster
    await cluster.start("alloc-9", "job-9", process("--steps", "5", "--step-seconds", "0.01"))
    done = await cluster.job_events_until("job-9", _is(T.JOB_COMPLETED))
    assert done[0].data["job_id"] == "job-9"
    [stopped] = await cluster.agent_events(T.WORKLOAD_STOPPED)
    assert (stopped.data["reason"], stopped.data["exit_code"]) == ("completed", 0)

    broken = WorkloadSpec(kind="process", argv=[sys.executable, "-c", "raise SystemExit(3)"])
    await cluster.start("alloc-10", "job-10", broken)
    _, failed = await cluster.agent_events(T.WORKLOAD_STOPPED, 2)
    assert (failed.data["reason"], failed.data["exit_code"]) == ("failed", 3)


async def test_stopping_the_agent_service_leaves_no_process_behind_and_reports_it_interrupted(
    python_cluster: Cluster, settings: Settings
) -> None:
    cluster = python_cluster
    forever = process("--steps", "100000", "--step-seconds", "0.02")
    await cluster.start("alloc-11", "job-11", forever)
    await cluster.job_events_until("job-11", _is(T.JOB_STARTED))
    assert processes_of("job-11")

    await cluster.stop_service()

    assert processes_of("job-11") == []
    assert settings.nats_url is not None
    nc = await nats.connect(settings.nats_url, **harness_options(settings))
    try:
        subject = cluster.s.event("agent", T.WORKLOAD_STOPPED)
        [msg] = await stream_messages(nc.jetstream(), subject, 1)
    finally:
        await nc.close()
    stopped = Envelope.from_bytes(msg.data)
    assert (stopped.data["allocation_id"], stopped.data["reason"]) == ("alloc-11", "interrupted")


# --- who a process workload runs as, and what it sees -------------------------------------

# What the child reports about itself: uid, groups, working directory, whether it can
# write its checkpoint directory, then its whole environment.
_WHOAMI = (
    'id -u; id -G; pwd; touch "$GPUSCHED_CHECKPOINT_DIR/written" && echo writable; echo ---; env'
)
_AGENT_SECRETS = {
    "GPUSCHED_NATS_CREDENTIALS": "/etc/gpusched/agent.creds",
    "GPUSCHED_DATABASE_URL": "postgresql+asyncpg://agent:secret@db/gpusched",
    "GPUSCHED_SECURITY__OPERATOR_TOKEN": "op-secret",
    "AWS_SECRET_ACCESS_KEY": "aws-secret",
}


@pytest.mark.skipif(os.geteuid() != 0, reason="the agent switches users only under root")
async def test_a_process_workload_runs_unprivileged_in_its_own_directory_without_agent_secrets(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in _AGENT_SECRETS.items():
        monkeypatch.setenv(name, value)
    nobody = pwd.getpwnam("nobody")
    spec = WorkloadSpec(kind="process", argv=["/bin/sh", "-c", _WHOAMI])

    await cluster.start("alloc-who", "job-who", spec)

    [stopped] = await cluster.agent_events(T.WORKLOAD_STOPPED)
    job_dir = tmp_path / "agent" / "job-who"
    report = (job_dir / "attempt-1.log").read_text()
    assert (stopped.data["reason"], stopped.data["exit_code"]) == ("completed", 0), report
    facts, _, environment = report.partition("---\n")
    uid, groups, cwd, writable = facts.split()
    assert int(uid) == nobody.pw_uid != 0
    assert groups.split() == [str(nobody.pw_gid)]  # no supplementary group of the agent
    assert Path(cwd) == job_dir
    assert writable == "writable"
    assert (job_dir / "written").stat().st_uid == nobody.pw_uid
    env = dict(line.split("=", 1) for line in environment.splitlines() if "=" in line)
    # None of the agent's secrets; the one credentials variable is the job's own file.
    assert not {k: v for k, v in _AGENT_SECRETS.items() if env.get(k) == v}, env
    assert not set(_AGENT_SECRETS) - {"GPUSCHED_NATS_CREDENTIALS"} & set(env), env
    assert not any(name.startswith("GPUSCHED_SECURITY") for name in env)
    creds = job_dir / "nats.creds"
    assert env["GPUSCHED_NATS_CREDENTIALS"] == str(creds)
    assert creds.stat().st_uid == nobody.pw_uid and creds.stat().st_mode & 0o777 == 0o600
    assert env["GPUSCHED_JOB_ID"] == "job-who"
    assert env["GPUSCHED_CHECKPOINT_DIR"] == str(job_dir)
    assert env["HOME"] == str(job_dir)
    assert env["USER"] == "nobody"
    # Other users may pass through the workdir to their own directory, not list it.
    assert (tmp_path / "agent").stat().st_mode & 0o777 == 0o711
    assert job_dir.stat().st_mode & 0o777 == 0o700


async def test_commands_not_from_their_producer_are_refused_dead_lettered_and_audited(
    cluster: Cluster,
) -> None:
    forged = [
        # The forged start of the issue: a process workload, as if from a job.
        await cluster.command(
            T.START_WORKLOAD,
            StartWorkload(
                allocation_id="alloc-forged",
                job_id="job-forged",
                attempt=1,
                gpus=[GpuRef(node="shared-00", index=0, model="A100-80GB")],
                workload=WorkloadSpec(kind="process", argv=["id"]),
            ),
            source="sdk",
        ),
        await cluster.command(
            T.START_WORKLOAD,
            StartWorkload(
                allocation_id="alloc-forged-2",
                job_id="job-forged",
                attempt=1,
                gpus=[],
                workload=sim(),
            ),
            source="checkpoint",
        ),
        await cluster.command(
            T.EVICT_WORKLOAD,
            EvictWorkload(allocation_id="alloc-x", job_id="job-x", saga_id="saga-x"),
            source="billing",
        ),
        await cluster.command(
            T.MIG_CONFIGURE,
            MigConfigure(change_id="mig-x", node="inf-00", gpu=0, model="A100-80GB", profiles=[]),
            source="preemption",
        ),
    ]

    dead = await stream_messages(cluster.rt.js, cluster.s.dead_letter("agent"), len(forged))
    assert sorted(Envelope.from_bytes(m.data).id for m in dead) == sorted(e.id for e in forged)
    assert {(m.headers or {}).get("Gpusched-Reason") for m in dead} == {"rejected"}
    audits = await cluster.events(cluster.s.audit("message.dead_lettered"), len(forged))
    reasons = [a.data["reason"] for a in audits]
    assert all(a.data["actor"] == "agent" for a in audits)
    assert any("workload.start from 'sdk' refused: only admission" in r for r in reasons), reasons
    assert any("workload.evict from 'billing' refused" in r for r in reasons), reasons
    # Nothing of them ran, and nothing was reported.
    assert cluster.agent.running_allocations == []
    assert await cluster.stored(cluster.s.event("agent", T.WORKLOAD_STARTED)) == 0
    assert await cluster.stored(cluster.s.event("agent", T.EVICT_FAILED)) == 0
    assert await cluster.stored(cluster.s.event("agent", T.MIG_CONFIGURED)) == 0

    # The same commands from their producers are carried out.
    await cluster.start("alloc-real", "job-real", sim())
    [started] = await cluster.agent_events(T.WORKLOAD_STARTED)
    assert started.data["allocation_id"] == "alloc-real"
    await cluster.command(
        T.EVICT_WORKLOAD,
        EvictWorkload(allocation_id="alloc-real", job_id="job-real", saga_id="cancel-1"),
        source="admission",  # a cancel or a replica scale-down
    )
    [stopped] = await cluster.agent_events(T.WORKLOAD_STOPPED)
    assert stopped.data["reason"] == "evicted"


# --- robustness ----------------------------------------------------------------------------


async def test_a_malformed_command_is_dead_lettered_and_the_agent_keeps_working(
    cluster: Cluster,
) -> None:
    subject = cluster.s.command("agent", T.START_WORKLOAD)
    bad = make_envelope(T.START_WORKLOAD, InferenceDemand(gpus=1.0), source="test")
    await cluster.rt.js.publish(subject, bad.to_bytes())

    [dead] = await stream_messages(cluster.rt.js, cluster.s.dead_letter("agent"), 1)
    assert dead.headers is not None
    assert dead.headers["Gpusched-Reason"] == "malformed"
    assert dead.headers["Gpusched-Original-Subject"] == subject

    await cluster.start("alloc-12", "job-12", sim())
    [started] = await cluster.agent_events(T.WORKLOAD_STARTED)
    assert started.data["job_id"] == "job-12"
