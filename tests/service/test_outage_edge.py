"""Jobs keep training through a control-plane outage (the edge: SDK and cluster agent).

Each test runs its own nats-server on a fixed port and store directory (not the
session-wide one), stops it while a job runs and starts it again on the same port, the
way an operator's restart (or `gpusched up` supervising it) would.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from pydantic import BaseModel
from tests.support.waiting import eventually, stream_messages_after

from gpusched.agent.app import start_agent
from gpusched.agent.handlers import ClusterAgent
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointRequested,
    GpuRef,
    InventoryLoaded,
    InventoryNode,
    StageName,
    StartWorkload,
    T,
    WorkloadSpec,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.embedded import EmbeddedNats
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import AgentSettings, Settings
from gpusched.infra.supervisor import spawn_bound_child, terminate
from gpusched.sdk import AsyncJobClient, JobEnvironment

REPO = Path(__file__).resolve().parents[2]
TRAIN_LOOP = REPO / "examples" / "train_loop.py"
OUTAGE_S = 12.0
_STOP_S = 30.0

pytestmark = pytest.mark.timeout(240)


@dataclass
class ControlPlane:
    """The test's stand-in for the control plane, on a connection that reconnects."""

    nc: NatsClient
    js: JetStreamContext
    s: Subjects

    async def send(
        self, subject: str, message_type: str, payload: BaseModel, source: str = "test"
    ) -> Envelope:
        envelope = make_envelope(message_type, payload, source=source)
        await self.js.publish(subject, envelope.to_bytes(), headers={"Nats-Msg-Id": envelope.id})
        return envelope

    async def request_checkpoint(self, job_id: str, request_id: str) -> Envelope:
        return await self.send(
            self.s.job_control(job_id),
            T.CHECKPOINT_REQUESTED,
            CheckpointRequested(
                request_id=request_id,
                job_id=job_id,
                reason="inference surge",
                deadline=datetime.now(UTC) + timedelta(minutes=5),
                stage_required=StageName.PERSISTED,
            ),
        )

    async def stored(self, subject: str) -> list[Envelope]:
        """Every message stored on `subject`; each one's Nats-Msg-Id is its envelope id."""
        msgs = await stream_messages_after(self.js, subject)
        envelopes = [Envelope.from_bytes(m.data) for m in msgs]
        for msg, envelope in zip(msgs, envelopes, strict=True):
            assert msg.headers is not None
            assert msg.headers["Nats-Msg-Id"] == envelope.id
        return envelopes

    async def job_events(self, job_id: str) -> list[Envelope]:
        return await self.stored(self.s.job_events(job_id))

    async def until(
        self, subject: str, done: Callable[[list[Envelope]], bool], within: float = 45
    ) -> list[Envelope]:
        async def check() -> list[Envelope] | None:
            try:
                got = await self.stored(subject)
            except Exception:  # the server may still be coming back
                return None
            return got if done(got) else None

        found = await eventually(check, within=within)
        assert found is not None
        return found


@pytest.fixture
async def control(own_nats: EmbeddedNats, prefix: str) -> AsyncIterator[ControlPlane]:
    nc = await nats.connect(own_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    subjects = Subjects(prefix)
    await bus.ensure_streams(nc.jetstream(), subjects.streams())
    try:
        yield ControlPlane(nc, nc.jetstream(), subjects)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), _STOP_S)


async def outage(server: EmbeddedNats, seconds: float, during: Callable[[], None]) -> None:
    """Stop the server, wait `seconds` (checking `during` every second), start it again
    on the same port with the same data."""
    await asyncio.to_thread(server.stop)
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        during()
        await asyncio.sleep(1.0)
    await asyncio.to_thread(server.start)


def _progress_steps(events: list[Envelope]) -> list[int]:
    return [e.data["step"] for e in events if e.type == T.JOB_PROGRESS]


def _persisted_for(request_id: str) -> Callable[[list[Envelope]], bool]:
    return lambda events: any(
        e.type == T.CHECKPOINT_CONFIRMED
        and e.data["stage"] == "persisted"
        and e.data["request_id"] == request_id
        for e in events
    )


# --- a real job process (the sync SDK) ---------------------------------------------------


async def test_a_job_process_keeps_training_through_a_nats_restart_and_every_event_arrives_once(
    own_nats: EmbeddedNats, control: ControlPlane, prefix: str, tmp_path: Path
) -> None:
    job_id = "job-outage"
    env = JobEnvironment(
        nats_url=own_nats.url,
        job_id=job_id,
        attempt=1,
        prefix=prefix,
        checkpoint_dir=tmp_path / "ckpt",
    )
    argv = [sys.executable, str(TRAIN_LOOP), "--steps", "1000000", "--step-seconds", "0.02"]
    with (tmp_path / "job.log").open("ab") as log:
        process = spawn_bound_child(
            argv, env={**_base_env(), **env.to_environ()}, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        before = await control.until(
            control.s.job_events(job_id), lambda es: len(_progress_steps(es)) >= 2
        )
        last_before = _progress_steps(before)[-1]

        def still_running() -> None:
            assert process.poll() is None, "the job exited while NATS was away"

        await outage(own_nats, OUTAGE_S, still_running)

        # It kept stepping: what it reported during the outage arrives now. At 0.02 s a
        # step it makes ~50 steps a second; half of that is proof enough on a busy box.
        expected = last_before + int(OUTAGE_S * 25)
        events = await control.until(
            control.s.job_events(job_id),
            lambda es: any(s >= expected for s in _progress_steps(es)),
        )
        still_running()
        ids = [e.id for e in events]
        assert len(ids) == len(set(ids))  # exactly once, by envelope id
        steps = _progress_steps(events)
        assert steps == list(range(steps[0], steps[-1] + 10, 10))  # none lost, none twice
        assert [e.type for e in events].count(T.JOB_STARTED) == 1

        # The control subscription survived the restart: a request reaches the job.
        await control.request_checkpoint(job_id, "req-after")
        await control.until(control.s.job_events(job_id), _persisted_for("req-after"))
        still_running()
    finally:
        await asyncio.to_thread(terminate, process, signal.SIGTERM, 10.0)
    assert process.returncode == 128 + 15  # it stopped on SIGTERM, not on an error


def _base_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}


# --- the SDK's buffer ----------------------------------------------------------------------


async def test_while_nats_is_away_events_wait_in_a_bounded_buffer_that_drops_old_progress_first(
    own_nats: EmbeddedNats, control: ControlPlane, prefix: str
) -> None:
    job = AsyncJobClient(own_nats.url, "job-buf", 1, prefix=prefix, buffer_capacity=5)
    await job.connect()
    try:
        await job.started()
        assert str(job.connection_state) == "connected"
        await asyncio.to_thread(own_nats.stop)
        await eventually(lambda: _true(not job.connection_state.connected))

        loop = asyncio.get_running_loop()
        began = loop.time()
        await job.checkpoint_confirmed(
            request_id="req-b",
            checkpoint_id="ck-b",
            step=1,
            uri="file:///ck-b",
            bytes=1,
            sha256="0" * 64,
            stage=StageName.PERSISTED,
        )
        for step in range(1, 11):
            await job.progress(step)
        await job.completed(10)
        assert loop.time() - began < 1.0  # the training loop was never held up
        state = job.connection_state
        assert (state.buffered, state.dropped) == (5, 7)
        assert str(state) == "disconnected, buffering 5"

        await asyncio.to_thread(own_nats.start)
        assert await job.flush(30) == 0
    finally:
        await job.close(timeout=5)
    events = await control.job_events("job-buf")
    assert [(e.type, e.data.get("step")) for e in events] == [
        (T.JOB_STARTED, None),
        (T.CHECKPOINT_CONFIRMED, 1),
        (T.JOB_PROGRESS, 8),
        (T.JOB_PROGRESS, 9),
        (T.JOB_PROGRESS, 10),
        (T.JOB_COMPLETED, 10),
    ]


async def _true(value: bool) -> bool:
    return value


# --- the cluster agent with a simulated workload -----------------------------------------


@dataclass
class Agent:
    rt: ServiceRuntime
    agent: ClusterAgent
    running: asyncio.Task[None]

    async def stop(self) -> None:
        self.rt.request_stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.running), _STOP_S)
        except TimeoutError:
            self.running.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(self.running, _STOP_S)
            raise


@pytest.fixture
async def agent(
    settings: Settings, own_nats: EmbeddedNats, control: ControlPlane, tmp_path: Path
) -> AsyncIterator[Agent]:
    ours = settings.model_copy(
        update={
            "nats_url": own_nats.url,
            "agent": AgentSettings(
                telemetry_interval_s=0.5, time_scale=1.0, workdir=tmp_path / "agent"
            ),
        }
    )
    # Admission's inventory is on the stream before the agent starts: the agent catches
    # up with it, then says it is ready with its nodes (sent after the start, the first
    # ready could come before it, with no node).
    await control.send(
        control.s.event("admission", T.INVENTORY_LOADED),
        T.INVENTORY_LOADED,
        InventoryLoaded(
            nodes=[InventoryNode(name="shared-00", pool="shared", gpu_model="A100-80GB", gpus=4)]
        ),
    )
    rt = ServiceRuntime("agent", "agent", ours, None)
    await rt.start()
    cluster = await start_agent(rt)
    running = asyncio.create_task(rt.run())
    harness = Agent(rt, cluster, running)
    try:
        yield harness
    finally:
        if not running.done():
            await harness.stop()


async def _start_sim(control: ControlPlane, alloc: str, job_id: str) -> None:
    start = StartWorkload(
        allocation_id=alloc,
        job_id=job_id,
        attempt=1,
        gpus=[GpuRef(node="shared-00", index=0, model="A100-80GB")],
        workload=WorkloadSpec(
            kind="sim", steps=1_000_000, step_seconds=0.05, checkpoint_seconds=0.2
        ),
    )
    subject = control.s.command("agent", T.START_WORKLOAD)
    await control.send(subject, T.START_WORKLOAD, start, source="admission")


async def test_the_agent_says_it_is_ready_with_its_nodes_and_the_allocations_it_runs(
    agent: Agent, control: ControlPlane
) -> None:
    ready_subject = control.s.event("agent", T.AGENT_READY)
    [ready] = await control.until(ready_subject, lambda es: len(es) >= 1)
    assert ready.data["nodes"] == ["shared-00"]
    assert ready.data["running"] == []
    assert ready.data["agent_id"].startswith("agent@")


async def test_the_agent_keeps_a_sim_job_training_through_a_nats_restart_and_reports_afterwards(
    agent: Agent, control: ControlPlane, own_nats: EmbeddedNats
) -> None:
    ready_subject = control.s.event("agent", T.AGENT_READY)
    await control.until(ready_subject, lambda es: len(es) >= 1)
    await _start_sim(control, "alloc-o", "job-o")
    before = await control.until(
        control.s.job_events("job-o"), lambda es: len(_progress_steps(es)) >= 2
    )
    last_before = _progress_steps(before)[-1]

    def still_running() -> None:
        assert not agent.running.done(), "the agent stopped while NATS was away"
        assert agent.agent.running_allocations == ["alloc-o"]

    await outage(own_nats, OUTAGE_S, still_running)

    # 20 steps a second; half of that over the outage is proof it kept stepping.
    expected = last_before + int(OUTAGE_S * 10)
    events = await control.until(
        control.s.job_events("job-o"), lambda es: any(s >= expected for s in _progress_steps(es))
    )
    ids = [e.id for e in events]
    assert len(ids) == len(set(ids))
    steps = _progress_steps(events)
    assert steps == sorted(set(steps))  # in order, none twice
    assert max(b - a for a, b in itertools.pairwise(steps)) <= 40  # none lost

    # After the reconnect the agent says again what it runs, and control reaches the job.
    readies = await control.until(ready_subject, lambda es: len(es) >= 2)
    assert readies[-1].data["running"] == ["alloc-o"]
    await control.request_checkpoint("job-o", "req-o")
    await control.until(control.s.job_events("job-o"), _persisted_for("req-o"))
    still_running()


async def test_stopping_the_agent_checkpoints_a_sim_job_and_reports_it_interrupted(
    agent: Agent, control: ControlPlane
) -> None:
    await _start_sim(control, "alloc-i", "job-i")
    await control.until(control.s.job_events("job-i"), lambda es: len(_progress_steps(es)) >= 1)

    await agent.stop()

    [stopped] = await control.stored(control.s.event("agent", T.WORKLOAD_STOPPED))
    assert (stopped.data["allocation_id"], stopped.data["reason"]) == ("alloc-i", "interrupted")
    events = await control.job_events("job-i")
    last_step = _progress_steps(events)[-1]
    saved = [e for e in events if e.type == T.CHECKPOINT_CONFIRMED]
    assert [e.data["stage"] for e in saved] == ["snapshotted", "persisted"]
    assert saved[-1].data["request_id"] is None  # the job's own, not asked for
    assert saved[-1].data["step"] >= last_step
