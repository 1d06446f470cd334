"""The delivery guarantees every service inherits: outbox, inbox, dead letters.

A probe service on the real NATS and PostgreSQL applies `job.progress` events by
recording the step and announcing it through the outbox.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import JobProgress, T
from gpusched.infra import bus
from gpusched.infra.db import UnitOfWork
from gpusched.infra.errors import Unavailable
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

MIGRATIONS = Path(__file__).resolve().parents[1] / "support" / "probe_migrations"


async def apply_progress(envelope: Envelope, uow: UnitOfWork) -> None:
    progress = envelope.payload(JobProgress)
    job_id = envelope.correlation_id or "?"
    await uow.execute(
        "INSERT INTO probe.steps (job_id, step) VALUES (:j, :s)", {"j": job_id, "s": progress.step}
    )
    await uow.emit(
        uow.subjects.event("probe", "step.recorded"), "step.recorded", progress,
        correlation_id=job_id, causation_id=envelope.id,
    )  # fmt: skip


@pytest.fixture
async def probe(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    runtime = ServiceRuntime("probe", "probe", settings, MIGRATIONS)
    await runtime.start()
    runtime.consume(
        bus.Consumer(
            durable="probe-progress",
            stream=runtime.subjects.stream("JOBS"),
            subjects=[runtime.subjects.all_job_events],
            handlers={T.JOB_PROGRESS: apply_progress},
        )
    )
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


async def steps(runtime: ServiceRuntime) -> list[tuple[str, int]]:
    async with runtime.uow() as uow:
        rows = await uow.execute("SELECT job_id, step FROM probe.steps ORDER BY step")
        return [(r.job_id, r.step) for r in rows]


def progress(step: int, job_id: str = "job-1") -> Envelope:
    return make_envelope(
        T.JOB_PROGRESS, JobProgress(step=step), source="test", correlation_id=job_id
    )


async def test_an_applied_message_commits_its_effect_and_publishes_its_event(
    probe: ServiceRuntime,
) -> None:
    envelope = progress(7)
    await probe.js.publish(probe.subjects.job_events("job-1"), envelope.to_bytes())

    assert await eventually(lambda: steps(probe)) == [("job-1", 7)]
    [event] = await stream_messages(probe.js, probe.subjects.event("probe", "step.recorded"), 1)
    published = Envelope.from_bytes(event.data)
    assert published.causation_id == envelope.id
    assert event.headers["Nats-Msg-Id"] == published.id
    assert published.data == {"step": 7}


async def test_the_same_envelope_delivered_twice_has_one_effect(probe: ServiceRuntime) -> None:
    envelope = progress(3)
    subject = probe.subjects.job_events("job-1")
    # Two publishes without a Nats-Msg-Id, so JetStream stores both copies: only the
    # inbox can keep the second one from being applied.
    await probe.js.publish(subject, envelope.to_bytes())
    await probe.js.publish(subject, envelope.to_bytes())
    await probe.js.publish(subject, progress(4).to_bytes())

    await eventually(lambda: _has_step(probe, 4))
    assert await steps(probe) == [("job-1", 3), ("job-1", 4)]


async def _has_step(runtime: ServiceRuntime, step: int) -> bool:
    return any(s == step for _, s in await steps(runtime))


@pytest.mark.parametrize(
    "raw",
    [
        b"not json at all",
        b'{"id": "x"}',
        json.dumps(
            {"id": "e1", "type": "job.progress", "source": "t", "time": "2026-01-01T00:00:00Z",
             "data": {"step": -5}}
        ).encode(),
    ],
    ids=["garbage", "missing-fields", "bad-payload"],
)  # fmt: skip
async def test_a_malformed_message_is_dead_lettered_and_audited_and_changes_nothing(
    probe: ServiceRuntime, raw: bytes
) -> None:
    subject = probe.subjects.job_events("job-1")
    await probe.js.publish(subject, raw)

    [dead] = await stream_messages(probe.js, probe.subjects.dead_letter("probe"), 1)
    assert dead.data == raw
    assert dead.headers["Gpusched-Original-Subject"] == subject
    assert dead.headers["Gpusched-Reason"] == "malformed"
    [audit] = await stream_messages(probe.js, probe.subjects.audit("message.dead_lettered"), 1)
    assert Envelope.from_bytes(audit.data).data["entity"] == subject

    # The service is still up and applies the next message; the bad one left no trace.
    await probe.js.publish(subject, progress(9).to_bytes())
    assert await eventually(lambda: steps(probe)) == [("job-1", 9)]


async def test_a_handler_that_keeps_failing_is_dead_lettered_after_max_deliver(
    settings: Settings,
) -> None:
    fast = settings.model_copy(
        update={"bus": settings.bus.model_copy(update={"max_deliver": 2, "nak_delay_s": 0.05})}
    )
    runtime = ServiceRuntime("probe", "probe", fast, MIGRATIONS)
    await runtime.start()
    calls = 0

    async def broken(envelope: Envelope, uow: UnitOfWork) -> None:
        nonlocal calls
        calls += 1
        await apply_progress(envelope, uow)
        raise RuntimeError("downstream unavailable")

    runtime.consume(
        bus.Consumer("probe-broken", runtime.subjects.stream("JOBS"),
                     [runtime.subjects.all_job_events], {T.JOB_PROGRESS: broken})
    )  # fmt: skip
    task = asyncio.create_task(runtime.run())
    try:
        await runtime.js.publish(runtime.subjects.job_events("job-1"), progress(1).to_bytes())
        [dead] = await stream_messages(runtime.js, runtime.subjects.dead_letter("probe"), 1)
        assert dead.headers["Gpusched-Reason"] == "failing"
        assert calls == 2
        # Each failed attempt rolled back, so nothing half-written remains.
        assert await steps(runtime) == []
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 15)


@pytest.mark.parametrize("edge", [False, True], ids=["with-database", "edge"])
async def test_a_handler_meeting_an_outage_keeps_its_message_without_spending_its_budget(
    settings: Settings, edge: bool
) -> None:
    fast = settings.model_copy(
        update={"bus": settings.bus.model_copy(update={"max_deliver": 2, "nak_delay_s": 0.05})}
    )
    runtime = ServiceRuntime("probe", "probe", fast, MIGRATIONS)
    await runtime.start()
    attempts = 0
    applied: list[int] = []

    async def flaky_server(envelope: Envelope) -> None:
        # Five outages in a row: more than twice the delivery budget.
        nonlocal attempts
        attempts += 1
        if attempts <= 5:
            raise Unavailable("database unreachable")
        applied.append(envelope.payload(JobProgress).step)

    async def with_uow(envelope: Envelope, uow: UnitOfWork) -> None:
        await flaky_server(envelope)

    runtime.consume(
        bus.Consumer(
            "probe-outage",
            runtime.subjects.stream("JOBS"),
            [runtime.subjects.all_job_events],
            handlers={} if edge else {T.JOB_PROGRESS: with_uow},
            edge_handlers={T.JOB_PROGRESS: flaky_server} if edge else {},
        )
    )
    task = asyncio.create_task(runtime.run())
    try:
        await runtime.js.publish(runtime.subjects.job_events("job-1"), progress(1).to_bytes())
        await runtime.js.publish(runtime.subjects.job_events("job-1"), progress(2).to_bytes())
        assert await eventually(lambda: _value(len(applied) == 2)) is True
        # In order: the first message was held while the server was away, not skipped.
        assert applied == [1, 2]
        info = await runtime.js.stream_info(runtime.subjects.stream("DLQ"))
        assert info.state.messages == 0
        assert not task.done()
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 15)


async def test_a_runtime_run_inside_a_program_leaves_its_signal_handlers_alone(
    settings: Settings,
) -> None:
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    runtime = ServiceRuntime("probe", "probe", settings, MIGRATIONS)
    await runtime.start()
    runtime.consume(
        bus.Consumer("probe-signals", runtime.subjects.stream("JOBS"),
                     [runtime.subjects.all_job_events], {T.JOB_PROGRESS: apply_progress})
    )  # fmt: skip
    task = asyncio.create_task(runtime.run())
    try:
        await runtime.js.publish(runtime.subjects.job_events("job-1"), progress(5).to_bytes())
        assert await eventually(lambda: steps(runtime)) == [("job-1", 5)]
        # Running: Ctrl-C and SIGTERM still belong to the program (here pytest).
        assert {sig: signal.getsignal(sig) for sig in before} == before
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 15)
    assert {sig: signal.getsignal(sig) for sig in before} == before


async def _value(value: bool) -> bool:
    return value
