"""A keyed consumer applies different keys at once and each key in stream order.

A probe service on the real NATS and PostgreSQL applies `job.progress` events (keyed
by the envelope's correlation id, the job) by recording the step. Handlers that block
on an asyncio.Event make overlap visible through events, not timing.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import JobProgress, T
from gpusched.infra import bus
from gpusched.infra.db import UnitOfWork
from gpusched.infra.errors import Rejected
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

MIGRATIONS = Path(__file__).resolve().parents[1] / "support" / "probe_migrations"
DURABLE = "probe-keyed"

Apply = Callable[[Envelope, UnitOfWork], Awaitable[None]]


async def record_step(envelope: Envelope, uow: UnitOfWork) -> None:
    progress = envelope.payload(JobProgress)
    await uow.execute(
        "INSERT INTO probe.steps (job_id, step) VALUES (:j, :s)",
        {"j": envelope.correlation_id, "s": progress.step},
    )


def progress(job_id: str, step: int) -> Envelope:
    return make_envelope(
        T.JOB_PROGRESS, JobProgress(step=step), source="test", correlation_id=job_id
    )


def tuned(settings: Settings, **bus_settings: float) -> Settings:
    return settings.model_copy(
        update={"bus": settings.bus.model_copy(update={"consumer_concurrency": 8, **bus_settings})}
    )


@asynccontextmanager
async def probe(
    settings: Settings,
    apply: Apply,
    *,
    key: bus.KeyOf | None = bus.by_correlation,
    concurrency: int | None = None,
    batch: int = 1,
    prepare: bus.Prepare | None = None,
) -> AsyncIterator[ServiceRuntime]:
    runtime = ServiceRuntime("probe", "probe", settings, MIGRATIONS)
    await runtime.start()
    runtime.consume(
        bus.Consumer(
            durable=DURABLE,
            stream=runtime.subjects.stream("JOBS"),
            subjects=[runtime.subjects.all_job_events],
            handlers={T.JOB_PROGRESS: apply},
            key=key,
            concurrency=concurrency,
            batch=batch,
            prepare=prepare,
        )
    )
    task = asyncio.create_task(runtime.run())
    try:
        yield runtime
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 20)


async def publish(runtime: ServiceRuntime, *envelopes: Envelope) -> None:
    for envelope in envelopes:
        subject = runtime.subjects.job_events(envelope.correlation_id or "none")
        await runtime.js.publish(subject, envelope.to_bytes())


async def steps(runtime: ServiceRuntime) -> list[tuple[str, int]]:
    async with runtime.uow() as uow:
        rows = await uow.execute("SELECT job_id, step FROM probe.steps ORDER BY job_id, step")
        return [(r.job_id, r.step) for r in rows]


class Gate:
    """Holds the handler of chosen steps until released; logs entries and exits."""

    def __init__(self, *held: int) -> None:
        self.held = set(held)
        self.release = asyncio.Event()
        self.entered: dict[int, asyncio.Event] = {}
        self.log: list[str] = []

    def arrived(self, step: int) -> asyncio.Event:
        return self.entered.setdefault(step, asyncio.Event())

    async def apply(self, envelope: Envelope, uow: UnitOfWork) -> None:
        step = envelope.payload(JobProgress).step
        self.log.append(f"enter {envelope.correlation_id}/{step}")
        self.arrived(step).set()
        await record_step(envelope, uow)
        if step in self.held:
            await self.release.wait()
        self.log.append(f"exit {envelope.correlation_id}/{step}")


async def held_then_batched(runtime: ServiceRuntime, gate: Gate) -> None:
    """The only worker is held on a first message while 6 jobs' 30 messages arrive:
    they wait, and then go in batches. Returns once all 31 are applied and acked."""
    await publish(runtime, progress("first", 0))
    await asyncio.wait_for(gate.arrived(0).wait(), 20)
    await publish(runtime, *interleaved(jobs=6, per_job=5))
    gate.release.set()
    await eventually(lambda: _count(runtime, 31), within=20)
    await eventually(lambda: _all_acked(runtime), within=20)


def interleaved(jobs: int, per_job: int) -> Iterator[Envelope]:
    for step in range(per_job):
        for job in range(jobs):
            yield progress(f"job-{job}", job * 1000 + step)


async def test_messages_of_one_key_are_applied_in_stream_order_while_keys_interleave(
    settings: Settings,
) -> None:
    applied: dict[str, list[int]] = {}
    in_flight = 0
    most_in_flight = 0

    async def apply(envelope: Envelope, uow: UnitOfWork) -> None:
        nonlocal in_flight, most_in_flight
        in_flight += 1
        most_in_flight = max(most_in_flight, in_flight)
        try:
            await record_step(envelope, uow)
            applied.setdefault(envelope.correlation_id or "", []).append(
                envelope.payload(JobProgress).step
            )
        finally:
            in_flight -= 1

    async with probe(tuned(settings), apply) as runtime:
        await publish(runtime, *interleaved(jobs=6, per_job=20))
        await eventually(lambda: _count(runtime, 120), within=20)

    for job in range(6):
        assert applied[f"job-{job}"] == [job * 1000 + step for step in range(20)]
    assert most_in_flight > 1
    assert most_in_flight <= 8


async def _count(runtime: ServiceRuntime, expected: int) -> bool:
    return len(await steps(runtime)) >= expected


async def test_a_key_held_in_its_handler_does_not_hold_up_other_keys_nor_lose_its_order(
    settings: Settings,
) -> None:
    gate = Gate(1)
    async with probe(tuned(settings), gate.apply) as runtime:
        await publish(runtime, progress("slow", 1), progress("slow", 2), progress("fast", 3))
        await asyncio.wait_for(gate.arrived(1).wait(), 20)

        # The other key commits while the held one is still inside its handler.
        assert await eventually(lambda: steps(runtime), within=20) == [("fast", 3)]
        assert "enter slow/2" not in gate.log

        gate.release.set()
        await eventually(lambda: _count(runtime, 3), within=20)
    assert gate.log.index("exit slow/1") < gate.log.index("enter slow/2")
    assert await steps(runtime) == [("fast", 3), ("slow", 1), ("slow", 2)]


async def test_a_consumer_without_a_key_applies_one_message_at_a_time_in_stream_order(
    settings: Settings,
) -> None:
    gate = Gate(1)
    async with probe(tuned(settings), gate.apply, key=None) as runtime:
        await publish(runtime, progress("slow", 1), progress("fast", 2), progress("other", 3))
        await asyncio.wait_for(gate.arrived(1).wait(), 20)
        gate.release.set()
        await eventually(lambda: _count(runtime, 3), within=20)
    assert gate.log == [
        "enter slow/1",
        "exit slow/1",
        "enter fast/2",
        "exit fast/2",
        "enter other/3",
        "exit other/3",
    ]


async def test_copies_of_one_message_racing_in_different_lanes_have_one_effect(
    settings: Settings,
) -> None:
    # A key that puts every delivery in a lane of its own: only the inbox, committed
    # in the same transaction as the effect, can keep the second copy out.
    def every_copy_alone(envelope: Envelope) -> str:
        return uuid.uuid4().hex

    twice = progress("job-1", 7)
    async with probe(tuned(settings), record_step, key=every_copy_alone) as runtime:
        # Published without a Nats-Msg-Id, so JetStream stores both copies.
        await publish(runtime, twice, twice, progress("job-1", 8))
        await eventually(lambda: _count(runtime, 2), within=20)
        await eventually(lambda: _all_acked(runtime), within=20)
        assert await steps(runtime) == [("job-1", 7), ("job-1", 8)]


async def _all_acked(runtime: ServiceRuntime) -> bool:
    info = await runtime.js.consumer_info(runtime.subjects.stream("JOBS"), DURABLE)
    return info.num_ack_pending == 0 and info.num_pending == 0


async def test_malformed_rejected_and_failing_messages_are_dead_lettered_without_blocking_others(
    settings: Settings,
) -> None:
    async def apply(envelope: Envelope, uow: UnitOfWork) -> None:
        step = envelope.payload(JobProgress).step
        await record_step(envelope, uow)
        if step == 66:
            raise Rejected("step 66 is refused")
        if step == 99:
            raise RuntimeError("downstream unavailable")

    fast = tuned(settings, max_deliver=2, nak_delay_s=0.05)
    async with probe(fast, apply) as runtime:
        subject = runtime.subjects.job_events("bad")
        await runtime.js.publish(subject, b"not json at all")
        await publish(runtime, progress("refused", 66), progress("failing", 99))
        await publish(runtime, *(progress(f"good-{n}", n) for n in range(5)))

        dead = await stream_messages(runtime.js, runtime.subjects.dead_letter("probe"), 3, 20)
        reasons = sorted(m.headers["Gpusched-Reason"] for m in dead if m.headers)
        assert reasons == ["failing", "malformed", "rejected"]
        audits = await stream_messages(
            runtime.js, runtime.subjects.audit("message.dead_lettered"), 3, 20
        )
        assert len(audits) == 3
        await eventually(lambda: _count(runtime, 5), within=20)
        # The refused and the failing message rolled back their effects.
        assert await steps(runtime) == [(f"good-{n}", n) for n in range(5)]


async def test_stopping_applies_or_leaves_for_redelivery_every_fetched_message(
    settings: Settings,
) -> None:
    gate = Gate(0)
    batch = [progress(f"job-{n % 4}", n) for n in range(40)]
    async with probe(tuned(settings), gate.apply) as runtime:
        await publish(runtime, *batch)
        await asyncio.wait_for(gate.arrived(0).wait(), 20)
        # Stop while one message is held in its handler and others wait behind it.
        runtime.request_stop()
        await asyncio.sleep(0)
        gate.release.set()
    partial = await steps(runtime)

    # A restarted service applies whatever the first one did not, and nothing twice.
    async with probe(tuned(settings), record_step) as again:
        await eventually(lambda: _count(again, 40), within=20)
        await eventually(lambda: _all_acked(again), within=20)
        final = await steps(again)
    assert sorted(step for _, step in final) == list(range(40))
    assert set(partial) <= set(final)


# --- batches: waiting messages of different keys share one transaction ------------------


async def test_waiting_messages_of_different_keys_share_a_transaction_each_key_in_order(
    settings: Settings,
) -> None:
    gate = Gate(0)
    transactions: dict[int, list[str]] = {}

    async def apply(envelope: Envelope, uow: UnitOfWork) -> None:
        txid = (await uow.execute("SELECT txid_current() AS t")).scalar_one()
        step = envelope.payload(JobProgress).step
        transactions.setdefault(txid, []).append(f"{envelope.correlation_id}/{step}")
        await gate.apply(envelope, uow)

    async with probe(tuned(settings), apply, concurrency=1, batch=16) as runtime:
        await held_then_batched(runtime, gate)

    assert max(len(applied) for applied in transactions.values()) > 1
    for applied in transactions.values():
        jobs = [entry.split("/")[0] for entry in applied]
        assert len(jobs) == len(set(jobs)), f"one key twice in a transaction: {applied}"
    for job in range(6):
        entered = [e for e in gate.log if e.startswith(f"enter job-{job}/")]
        assert entered == [f"enter job-{job}/{job * 1000 + step}" for step in range(5)]


async def test_a_failing_message_in_a_batch_is_dead_lettered_alone_and_the_rest_applied(
    settings: Settings,
) -> None:
    gate = Gate(0)

    async def apply(envelope: Envelope, uow: UnitOfWork) -> None:
        await gate.apply(envelope, uow)
        if envelope.payload(JobProgress).step == 66:
            raise Rejected("step 66 is refused")

    async with probe(tuned(settings), apply, concurrency=1, batch=16) as runtime:
        await publish(runtime, progress("first", 0))
        await asyncio.wait_for(gate.arrived(0).wait(), 20)
        await publish(runtime, progress("good-1", 1), progress("refused", 66))
        await publish(runtime, *(progress(f"good-{n}", n) for n in range(2, 6)))
        gate.release.set()

        dead = await stream_messages(runtime.js, runtime.subjects.dead_letter("probe"), 1, 20)
        assert [m.headers["Gpusched-Reason"] for m in dead if m.headers] == ["rejected"]
        await eventually(lambda: _count(runtime, 6), within=20)
        await eventually(lambda: _all_acked(runtime), within=20)
        # The refused message's own effect rolled back; its batch's others committed.
        assert await steps(runtime) == [("first", 0), *((f"good-{n}", n) for n in range(1, 6))]
    # It was tried with others first (a batch), then alone.
    assert gate.log.count("enter refused/66") == 2


async def test_a_batch_is_prepared_once_in_its_own_transaction_with_what_it_applies(
    settings: Settings,
) -> None:
    gate = Gate(0)
    prepared: dict[int, list[str]] = {}  # transaction -> the ids its prepare was given
    applied: dict[int, list[str]] = {}  # transaction -> the ids its handlers applied
    handled_before_prepare: list[int] = []

    async def prepare(envelopes: Sequence[Envelope], uow: UnitOfWork) -> None:
        txid = (await uow.execute("SELECT txid_current() AS t")).scalar_one()
        assert txid not in prepared, "prepared twice"
        prepared[txid] = [envelope.id for envelope in envelopes]
        if txid in applied:
            handled_before_prepare.append(txid)

    async def apply(envelope: Envelope, uow: UnitOfWork) -> None:
        txid = (await uow.execute("SELECT txid_current() AS t")).scalar_one()
        applied.setdefault(txid, []).append(envelope.id)
        await gate.apply(envelope, uow)

    async with probe(tuned(settings), apply, concurrency=1, batch=16, prepare=prepare) as runtime:
        await held_then_batched(runtime, gate)

    shared = {txid: ids for txid, ids in applied.items() if len(ids) > 1}
    assert shared, "no batch was formed"
    # Every shared transaction was prepared once, before its handlers, with exactly the
    # messages it applied in their order; a message applied alone is not prepared.
    assert prepared == shared
    assert handled_before_prepare == []


async def test_a_prepare_that_fails_rolls_its_batch_back_and_each_message_is_applied_alone(
    settings: Settings,
) -> None:
    gate = Gate(0)
    failed = 0

    async def prepare(envelopes: Sequence[Envelope], uow: UnitOfWork) -> None:
        nonlocal failed
        await uow.execute(
            "INSERT INTO probe.steps (job_id, step) VALUES ('prepared', :n)", {"n": failed}
        )
        failed += 1
        raise RuntimeError("the batch cannot be prepared")

    async with probe(
        tuned(settings), gate.apply, concurrency=1, batch=16, prepare=prepare
    ) as runtime:
        await publish(runtime, progress("first", 0))
        await asyncio.wait_for(gate.arrived(0).wait(), 20)
        await publish(runtime, *(progress(f"job-{n}", n) for n in range(1, 7)))
        gate.release.set()
        await eventually(lambda: _count(runtime, 7), within=20)
        await eventually(lambda: _all_acked(runtime), within=20)
        # Each message applied once, alone; nothing the failed prepare wrote committed.
        assert await steps(runtime) == [("first", 0), *((f"job-{n}", n) for n in range(1, 7))]
        dead = await runtime.js.stream_info(runtime.subjects.stream("DLQ"))
        assert dead.state.messages == 0
    assert failed >= 1
