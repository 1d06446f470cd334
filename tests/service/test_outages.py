"""An unreachable server is an outage to wait out, never poison and never a hang.

Each test starts its own PostgreSQL or NATS on a fixed port with its own data dir, stops
it while a probe service runs, and starts it again on the same port with the same data
(as a supervisor would). The probe applies `job.progress` events by recording the step
and announcing it through the outbox.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import nats
import pytest
from prometheus_client import REGISTRY
from tests.conftest import Servers, harness_credentials_in, install
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import JobProgress, T
from gpusched.infra import bus, outbox
from gpusched.infra.db import UnitOfWork
from gpusched.infra.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from gpusched.infra.leader import LeaderLease
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

MIGRATIONS = Path(__file__).resolve().parents[1] / "support" / "probe_migrations"
SERVICE = "probe"
RECORDED = "step.recorded"

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A data dir for this test's own server. Not pytest's tmp_path: pytest prunes old
    base temp dirs, which would pull it from under the server when several test runs
    share a machine."""
    path = Path(tempfile.mkdtemp(prefix="gpusched-test-outage-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def apply_progress(envelope: Envelope, uow: UnitOfWork) -> None:
    progress = envelope.payload(JobProgress)
    await uow.execute(
        "INSERT INTO probe.steps (job_id, step) VALUES (:j, :s)",
        {"j": envelope.correlation_id, "s": progress.step},
    )
    await uow.emit(
        uow.subjects.event(SERVICE, RECORDED), RECORDED, progress,
        correlation_id=envelope.correlation_id, causation_id=envelope.id,
    )  # fmt: skip


async def count_steps(runtime: ServiceRuntime) -> int:
    async with runtime.uow() as uow:
        result = await uow.execute("SELECT count(*) AS n FROM probe.steps")
        return int(result.scalar_one())


async def steps(runtime: ServiceRuntime) -> list[int]:
    async with runtime.uow() as uow:
        rows = await uow.execute("SELECT step FROM probe.steps ORDER BY step")
        return [r.step for r in rows]


async def has_steps(runtime: ServiceRuntime, n: int) -> bool:
    return await count_steps(runtime) >= n


def progress(step: int) -> Envelope:
    return make_envelope(
        T.JOB_PROGRESS, JobProgress(step=step), source="test", correlation_id="job-1"
    )


def tuned(settings: Settings) -> Settings:
    # A delivery budget of 2 attempts and an ack wait of 3 s: the outages below last
    # many times longer than both, so only waiting them out keeps messages alive.
    return settings.model_copy(
        update={
            "bus": settings.bus.model_copy(
                update={"max_deliver": 2, "nak_delay_s": 0.05, "ack_wait_s": 3.0}
            )
        }
    )


@asynccontextmanager
async def probe(settings: Settings) -> AsyncIterator[tuple[ServiceRuntime, asyncio.Task[None]]]:
    runtime = ServiceRuntime(SERVICE, "probe", tuned(settings), MIGRATIONS)
    await runtime.start()
    runtime.consume(
        bus.Consumer(
            durable="probe-outages",
            stream=runtime.subjects.stream("JOBS"),
            subjects=[runtime.subjects.all_job_events],
            handlers={T.JOB_PROGRESS: apply_progress},
        )
    )

    async def count_reply(raw: bytes) -> JobProgress:
        return JobProgress(step=await count_steps(runtime))

    runtime.serve(f"{runtime.subjects.prefix}.api.probe.count", count_reply)
    task = asyncio.create_task(runtime.run())
    try:
        yield runtime, task
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 30)


async def dead_letters(runtime: ServiceRuntime) -> int:
    info = await runtime.js.stream_info(runtime.subjects.stream("DLQ"))
    return info.state.messages


def gauge(name: str) -> float:
    return REGISTRY.get_sample_value(name, {"service": SERVICE}) or 0.0


async def test_a_postgres_outage_longer_than_the_retry_budget_loses_and_dead_letters_nothing(
    servers: Servers, prefix: str, tmp_path: Path, scratch: Path
) -> None:
    pg = EmbeddedPostgres(scratch / "pg", port=free_port())
    database_url = await asyncio.to_thread(pg.start)
    security = await install(servers, prefix, tmp_path / "auth")
    settings = Settings(
        nats_url=servers.nats_url,
        nats_credentials=harness_credentials_in(security),
        database_url=database_url,
        subject_prefix=prefix,
        data_dir=tmp_path / "data",
        security=security,
    )
    try:
        async with probe(settings) as (runtime, task):
            subject = runtime.subjects.job_events("job-1")
            await runtime.js.publish(subject, progress(0).to_bytes())
            await eventually(lambda: has_steps(runtime, 1))

            await asyncio.to_thread(pg.stop)
            for step in range(1, 21):
                await runtime.js.publish(subject, progress(step).to_bytes())

            # The API answers at once that it cannot serve, and says when to try again.
            reply = await asyncio.wait_for(
                runtime.nc.request(f"{prefix}.api.probe.count", b"{}", timeout=10), 12
            )
            error = json.loads(reply.data)["error"]
            assert error["code"] == "unavailable"
            assert "try again in a few seconds" in error["message"]

            # Far longer than 2 deliveries and 3 s of ack wait.
            await asyncio.sleep(12)
            assert not task.done()
            assert await dead_letters(runtime) == 0

            await asyncio.to_thread(pg.start)
            await eventually(lambda: has_steps(runtime, 21), within=30)
            assert await steps(runtime) == list(range(21))
            # Each message was applied once and announced once.
            recorded = await stream_messages(
                runtime.js, runtime.subjects.event(SERVICE, RECORDED), 21, within=30
            )
            assert sorted(Envelope.from_bytes(m.data).data["step"] for m in recorded) == list(
                range(21)
            )
            assert await dead_letters(runtime) == 0
            assert not task.done()
            # And the endpoint serves again.
            reply = await runtime.nc.request(f"{prefix}.api.probe.count", b"{}", timeout=10)
            assert json.loads(reply.data) == {"step": 21}
    finally:
        await asyncio.to_thread(pg.stop)


async def test_a_nats_outage_holds_the_outbox_backlog_and_publishes_all_of_it_after(
    database_url: str,
    prefix: str,
    tmp_path: Path,
    scratch: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Acks lost with the connection time out sooner here than in production.
    monkeypatch.setattr(outbox, "ACK_TIMEOUT_S", 2.0)
    server = EmbeddedNats(scratch / "nats", port=free_port())
    nats_url = await asyncio.to_thread(server.start)
    settings = Settings(
        nats_url=nats_url,
        database_url=database_url,
        subject_prefix=prefix,
        data_dir=tmp_path / "data",
    )
    try:
        async with probe(settings) as (runtime, task):
            subject = runtime.subjects.job_events("job-1")
            await runtime.js.publish(subject, progress(0).to_bytes())
            await eventually(lambda: has_steps(runtime, 1))

            await asyncio.to_thread(server.stop)
            # Work goes on meanwhile: state changes commit with their events in the outbox.
            for step in range(1, 31):
                async with runtime.uow() as uow:
                    await apply_progress(progress(step), uow)
                    await uow.commit()

            assert await eventually(
                lambda: _async(gauge("gpusched_outbox_oldest_unpublished_seconds") > 1.0),
                within=20,
            )
            assert gauge("gpusched_outbox_unpublished_rows") == 30
            assert not task.done()

            await asyncio.to_thread(server.start)
            # A separate client: the probe's own connection reconnects by itself.
            observer = await nats.connect(nats_url)
            try:
                js = observer.jetstream()
                recorded = await stream_messages(
                    js, runtime.subjects.event(SERVICE, RECORDED), 31, within=30
                )
                # All of the backlog, each row once (retries were de-duplicated).
                assert sorted(Envelope.from_bytes(m.data).data["step"] for m in recorded) == list(
                    range(31)
                )
                assert len({m.headers["Nats-Msg-Id"] for m in recorded}) == 31
                assert await eventually(
                    lambda: _async(gauge("gpusched_outbox_oldest_unpublished_seconds") == 0.0),
                    within=10,
                )
                assert gauge("gpusched_outbox_unpublished_rows") == 0

                # The consumer fetches again after the reconnect.
                await js.publish(subject, progress(31).to_bytes())
                await eventually(lambda: has_steps(runtime, 32), within=30)
                assert await steps(runtime) == list(range(32))
                info = await js.stream_info(runtime.subjects.stream("DLQ"))
                assert info.state.messages == 0
            finally:
                await observer.close()
            assert not task.done()
    finally:
        await asyncio.to_thread(server.stop)


async def _async(value: bool) -> bool:
    return value


async def test_a_leader_whose_database_restarts_stops_leading_until_it_takes_the_lease_again(
    scratch: Path,
) -> None:
    pg = EmbeddedPostgres(scratch / "pg", port=free_port())
    url = await asyncio.to_thread(pg.start)
    lease = LeaderLease(url, "probe.loop")
    try:
        assert await lease.try_acquire()
        await asyncio.to_thread(pg.stop)
        # Answered within the lease's bounds, not a hang: not the leader any more.
        assert not await asyncio.wait_for(lease.try_acquire(), 15)
        assert not await asyncio.wait_for(lease.try_acquire(), 15)
        await asyncio.to_thread(pg.start)
        assert await lease.try_acquire()
        assert lease.is_leader
    finally:
        await lease.release()
        await asyncio.to_thread(pg.stop)


async def test_an_event_nats_refuses_for_its_size_is_parked_and_the_events_behind_it_go_out(
    settings: Settings,
) -> None:
    async with probe(settings) as (runtime, task):
        parked_before = (
            REGISTRY.get_sample_value("gpusched_outbox_parked_total", {"service": SERVICE}) or 0.0
        )
        huge = runtime.nc.max_payload + 1
        async with runtime.uow() as uow:
            # One event over the server's max_payload, committed between two others.
            for step in (1, 2, 3):
                # Lists of strings: a metric holds at most 64 KiB of text in one string.
                notes = {f"note{n}": ["x" * 60_000] * 50 for n in range(huge // 3_000_000 + 1)}
                data = JobProgress(step=step, **(notes if step == 2 else {}))
                await uow.emit(runtime.subjects.event(SERVICE, RECORDED), RECORDED, data)
            await uow.commit()
        # Before: every later event waited behind the refused one, for ever.
        recorded = await stream_messages(
            runtime.js, runtime.subjects.event(SERVICE, RECORDED), 2, within=30
        )
        assert [Envelope.from_bytes(m.data).data["step"] for m in recorded] == [1, 3]

        async def outbox_empty() -> bool:
            # The relay deletes what it published when its transaction commits, just
            # after the publish arrives.
            async with runtime.uow() as uow:
                left = (await uow.execute("SELECT count(*) FROM probe.outbox")).scalar_one()
            return bool(left == 0)

        await eventually(outbox_empty, within=10)
        async with runtime.uow() as uow:
            rows = (
                await uow.execute(
                    "SELECT subject, length(payload) AS size, error FROM probe.outbox_parked"
                )
            ).all()
        [row] = rows
        assert row.subject == runtime.subjects.event(SERVICE, RECORDED)
        assert row.size > huge and "MaxPayload" in row.error
        assert (
            REGISTRY.get_sample_value("gpusched_outbox_parked_total", {"service": SERVICE})
            == parked_before + 1
        )
        [audit] = await stream_messages(
            runtime.js, runtime.subjects.audit("outbox.parked"), 1, within=30
        )
        assert Envelope.from_bytes(audit.data).data["details"]["bytes"] == row.size
        # The relay goes on: a later event is published as usual.
        async with runtime.uow() as uow:
            await uow.emit(runtime.subjects.event(SERVICE, RECORDED), RECORDED, JobProgress(step=4))
            await uow.commit()
        recorded = await stream_messages(
            runtime.js, runtime.subjects.event(SERVICE, RECORDED), 3, within=30
        )
        assert Envelope.from_bytes(recorded[-1].data).data["step"] == 4
        assert not task.done()
