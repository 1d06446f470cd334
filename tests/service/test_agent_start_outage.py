"""A start command that meets a NATS outage while its workload launches is applied
again once the server is back, never reported as the job's failure.

The agent's commands come from the session NATS; its simulated jobs speak to the
control plane over a connection of their own, to a nats-server this test stops and
starts again (the way JetStream becomes unreachable for a moment while the command is
already in the agent's hands). Both are real servers.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from tests.support.waiting import eventually, stream_messages_after

from gpusched.agent.handlers import ClusterAgent
from gpusched.agent.publisher import Publisher
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import GpuRef, StartWorkload, T, WorkloadSpec
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.embedded import EmbeddedNats, free_port
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import AgentSettings, Settings

pytestmark = pytest.mark.timeout(180)

_STOP_S = 30.0


@dataclass
class Harness:
    rt: ServiceRuntime
    agent: ClusterAgent
    jobs_nats: EmbeddedNats
    jobs: JetStreamContext  # the jobs' NATS, where their events land
    jobs_nc: NatsClient

    @property
    def s(self) -> Subjects:
        return self.rt.subjects

    async def start_sim(self, alloc: str, job_id: str) -> Envelope:
        start = StartWorkload(
            allocation_id=alloc,
            job_id=job_id,
            attempt=1,
            gpus=[GpuRef(node="shared-00", index=0, model="A100-80GB")],
            workload=WorkloadSpec(kind="sim", steps=100_000, step_seconds=0.05),
        )
        envelope = make_envelope(T.START_WORKLOAD, start, source="admission")
        await self.rt.js.publish(
            self.s.command("agent", T.START_WORKLOAD),
            envelope.to_bytes(),
            headers={"Nats-Msg-Id": envelope.id},
        )
        return envelope

    async def reports(self, message_type: str) -> list[Envelope]:
        msgs = await stream_messages_after(self.rt.js, self.s.event("agent", message_type))
        return [Envelope.from_bytes(m.data) for m in msgs]

    async def job_events(self, job_id: str) -> list[Envelope]:
        msgs = await stream_messages_after(self.jobs, self.s.job_events(job_id))
        return [Envelope.from_bytes(m.data) for m in msgs]

    async def waiting_out_an_outage(self) -> bool:
        verdict = await self.rt.health.verdict()
        return any("waits out an outage" in problem for problem in verdict.problems)


@pytest.fixture
async def harness(settings: Settings, tmp_path: Path) -> AsyncIterator[Harness]:
    jobs_nats = EmbeddedNats(tmp_path / "jobs-nats", port=free_port())
    jobs_nats.start()
    rt: ServiceRuntime | None = None
    running: asyncio.Task[None] | None = None
    agent: ClusterAgent | None = None
    jobs_nc = await nats.connect(jobs_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        await bus.ensure_streams(jobs_nc.jetstream(), Subjects(settings.subject_prefix).streams())
        ours = settings.model_copy(
            update={"agent": AgentSettings(time_scale=1.0, workdir=tmp_path / "agent")}
        )
        rt = ServiceRuntime("agent", "agent", ours, None)
        await rt.start()
        # As app.start_agent wires it, but with the jobs on their own NATS.
        agent = ClusterAgent(
            Publisher(rt.nc, rt.js, "agent"),
            rt.subjects,
            ours.agent,
            agent_id="agent@test",
            nats_url=jobs_nats.url,
            connection=jobs_nc,
        )
        rt.consume(
            bus.Consumer(
                durable="agent-commands",
                stream=rt.subjects.stream("COMMANDS"),
                subjects=[rt.subjects.commands_for("agent")],
                edge_handlers={T.START_WORKLOAD: agent.on_start},
            )
        )
        running = asyncio.create_task(rt.run())
        yield Harness(rt, agent, jobs_nats, jobs_nc.jetstream(), jobs_nc)
    finally:
        jobs_nats.start()  # a test may leave it stopped: the workloads close cleanly
        if agent is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(agent.close(), _STOP_S)
        if rt is not None:
            rt.request_stop()
            if running is not None:
                try:
                    await asyncio.wait_for(running, _STOP_S)
                except TimeoutError:
                    running.cancel()
                    with contextlib.suppress(BaseException):
                        await running
            else:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(rt.nc.close(), _STOP_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(jobs_nc.close(), _STOP_S)
        jobs_nats.stop()


async def test_a_sim_start_during_a_nats_outage_is_applied_again_once_nats_is_back(
    harness: Harness,
) -> None:
    await asyncio.to_thread(harness.jobs_nats.stop)
    await eventually(lambda: _true(not harness.jobs_nc.is_connected), within=20)

    await harness.start_sim("alloc-out", "job-out")

    # The launch cannot reach JetStream: the agent waits the outage out with the
    # command in hand, and neither fails the job nor pretends it started.
    await eventually(harness.waiting_out_an_outage, within=30)
    assert await harness.reports(T.WORKLOAD_STOPPED) == []
    assert await harness.reports(T.WORKLOAD_STARTED) == []
    assert harness.agent.running_allocations == []

    await asyncio.to_thread(harness.jobs_nats.start)

    async def started() -> list[Envelope]:
        return await harness.reports(T.WORKLOAD_STARTED)

    [report] = await eventually(started, within=60)
    assert report.data["allocation_id"] == "alloc-out"

    async def job_started() -> list[Envelope]:
        events = await harness.job_events("job-out")
        return [e for e in events if e.type == T.JOB_STARTED]

    assert len(await eventually(job_started, within=30)) == 1
    assert await harness.reports(T.WORKLOAD_STOPPED) == []
    assert harness.agent.running_allocations == ["alloc-out"]
    assert not await harness.waiting_out_an_outage()


async def test_a_sim_start_that_can_never_listen_is_still_reported_failed_at_once(
    harness: Harness,
) -> None:
    # No JOBS stream on the jobs' NATS: JetStream answers (404), which is no outage.
    await harness.jobs.delete_stream(harness.s.stream("JOBS"))

    await harness.start_sim("alloc-bad", "job-bad")

    async def stopped() -> list[Envelope]:
        return await harness.reports(T.WORKLOAD_STOPPED)

    [report] = await eventually(stopped, within=30)
    assert (report.data["allocation_id"], report.data["reason"]) == ("alloc-bad", "failed")
    assert harness.agent.running_allocations == []
    assert await harness.reports(T.WORKLOAD_STARTED) == []


async def _true(value: bool) -> bool:
    return value
