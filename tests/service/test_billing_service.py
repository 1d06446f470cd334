"""Billing on the real NATS and PostgreSQL: it meters allocations from admission's
events, credits forced preemption from checkpoint's, and prices statements on request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from tests.support.waiting import eventually, stream_messages

from gpusched.billing import app
from gpusched.billing.api import StatementReply, StatementView, statement_subject
from gpusched.contracts.envelope import Envelope, make_envelope, new_id, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    AllocationReleased,
    EvictionForced,
    GpuRef,
    JobKind,
    PriorityClassName,
    T,
)
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

REPO = Path(__file__).resolve().parents[2]
A100 = "A100-80GB"


@pytest.fixture
async def billing(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    configured = settings.model_copy(
        update={
            "billing": settings.billing.model_copy(
                update={"price_book_path": REPO / "deploy" / "prices.yaml"}
            )
        }
    )
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, configured, app.migrations_dir(app.__file__))
    await runtime.start()
    await app.build(runtime)
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


def at(hours: float) -> datetime:
    """A fixed instant in the past, `hours` after a reference point."""
    return datetime(2026, 3, 2, 9, 0, tzinfo=UTC) + timedelta(hours=hours)


def granted(
    allocation_id: str,
    *,
    gpus: int = 2,
    model: str = A100,
    granted_at: datetime | None = None,
    team: str = "vision",
    cpu_cores: str = "8",
    memory_gb: str = "64",
) -> AllocationGranted:
    return AllocationGranted(
        allocation_id=allocation_id,
        job_id=f"job-{allocation_id}",
        team=team,
        kind=JobKind.TRAINING,
        priority_class=PriorityClassName.P2_OFFLINE,
        pool="shared",
        gpus=[GpuRef(node="shared-00", index=i, model=model) for i in range(gpus)],
        granted_at=granted_at or at(0),
        attempt=1,
        checkpointable=True,
        cpu_cores=Decimal(cpu_cores),
        memory_gb=Decimal(memory_gb),
    )


def released(allocation_id: str, released_at: datetime, team: str = "vision") -> AllocationReleased:
    return AllocationReleased(
        allocation_id=allocation_id,
        job_id=f"job-{allocation_id}",
        team=team,
        gpus=[],
        released_at=released_at,
        reason="completed",
    )


def forced(allocation_id: str, lost_gpu_seconds: float, saga_id: str = "saga-1") -> EvictionForced:
    return EvictionForced(
        saga_id=saga_id,
        request_id="req-1",
        allocation_id=allocation_id,
        job_id=f"job-{allocation_id}",
        lost_gpu_seconds=lost_gpu_seconds,
        checkpoint=None,
    )


async def announce(rt: ServiceRuntime, source: str, message_type: T, data: BaseModel) -> Envelope:
    envelope = make_envelope(message_type, data, source=source)
    await publish(rt, source, message_type, envelope.to_bytes())
    return envelope


async def publish(rt: ServiceRuntime, source: str, message_type: T, raw: bytes) -> None:
    await rt.js.publish(rt.subjects.event(source, message_type), raw)


async def statement(rt: ServiceRuntime, **request: Any) -> StatementReply:
    body = {k: v.isoformat() if isinstance(v, datetime) else v for k, v in request.items()}
    msg = await rt.nc.request(
        statement_subject(rt.subjects.prefix), json.dumps(body).encode(), timeout=10
    )
    return StatementReply.model_validate_json(msg.data)


async def statement_of(rt: ServiceRuntime, team: str, lines: int, **request: Any) -> StatementView:
    """The team's statement once it shows `lines` usage lines (events are applied async)."""

    async def ready() -> StatementView | None:
        reply = await statement(rt, team=team, **request)
        assert reply.ok, reply.error
        found = [s for s in reply.statements if s.team == team]
        return found[0] if found and len(found[0].lines) == lines else None

    return await eventually(ready, within=20)


async def test_a_granted_then_released_allocation_is_billed_at_its_gpu_models_price(
    billing: ServiceRuntime,
) -> None:
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a1", gpus=2))
    await announce(billing, "admission", T.ALLOCATION_RELEASED, released("a1", at(1.5)))

    async def closed() -> StatementReply | None:
        reply = await statement(billing, team="vision", period_start=at(-1), period_end=at(3))
        done = reply.ok and reply.statements and not reply.statements[0].lines[0].open
        return reply if done else None

    reply = await eventually(closed, within=20)
    [bill] = reply.statements
    [line] = bill.lines
    # 2 GPUs x 1.5 h x 2.80 + 8 cores x 1.5 h x 0.04 + 64 GB x 1.5 h x 0.005
    assert (line.start, line.end) == (at(0), at(1.5))
    assert line.gpu_seconds == Decimal("10800")
    assert line.gpu_cost == Decimal("8.40")
    assert line.cpu_cost == Decimal("0.48")
    assert line.memory_cost == Decimal("0.48")
    assert bill.total == Decimal("9.36")
    assert bill.currency == "USD"
    assert "Statement for team vision" in reply.text
    assert "9.36" in reply.text


async def test_a_statement_for_part_of_an_allocation_bills_only_that_part(
    billing: ServiceRuntime,
) -> None:
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a1", gpus=1))
    await announce(billing, "admission", T.ALLOCATION_RELEASED, released("a1", at(4)))
    await eventually(lambda: _has_closed_line(billing, "vision"), within=20)

    reply = await statement(billing, team="vision", period_start=at(1), period_end=at(2))
    [line] = reply.statements[0].lines
    assert (line.start, line.end, line.gpu_cost) == (at(1), at(2), Decimal("2.80"))


async def _has_closed_line(rt: ServiceRuntime, team: str) -> bool:
    reply = await statement(rt, team=team)
    return bool(reply.statements) and not reply.statements[0].lines[0].open


async def test_an_open_allocation_is_billed_up_to_now_and_never_beyond(
    billing: ServiceRuntime,
) -> None:
    opened = (utcnow() - timedelta(hours=1)).replace(microsecond=0)
    await announce(
        billing, "admission", T.ALLOCATION_GRANTED, granted("a1", gpus=1, granted_at=opened)
    )
    await statement_of(billing, "vision", lines=1)

    before = utcnow()
    # Without a period: from the first usage to now. With a period ending tomorrow:
    # still only up to now, since the rest has not been used yet.
    for request in ({}, {"period_end": before + timedelta(days=1)}):
        reply = await statement(billing, team="vision", **request)
        after = utcnow()
        [line] = reply.statements[0].lines
        assert line.open
        assert line.start == opened
        assert before <= line.end <= after
        seconds = Decimal((line.end - opened) // timedelta(microseconds=1)) / 1_000_000
        assert line.gpu_seconds == seconds.quantize(Decimal("0.000001"))
        expected = (seconds * Decimal("2.80") / 3600).quantize(Decimal("0.000001"))
        assert line.gpu_cost == expected
        assert Decimal("2.80") <= line.gpu_cost < Decimal("2.81")


async def test_a_forced_eviction_is_credited_once_as_a_negative_line_and_audited(
    billing: ServiceRuntime,
) -> None:
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a1", gpus=2))
    await announce(billing, "admission", T.ALLOCATION_RELEASED, released("a1", at(1)))
    # The same saga announced twice (e.g. a replayed outbox row under a new id).
    for _ in range(2):
        await announce(billing, "checkpoint", T.EVICTION_FORCED, forced("a1", 1800.5))

    [audit] = await stream_messages(billing.js, billing.subjects.audit("billing.credit"), 1)
    record = Envelope.from_bytes(audit.data).data
    assert record["entity"] == "a1"
    assert record["details"]["lost_gpu_seconds"] == "1800.5"
    assert record["details"]["gpu_model"] == A100

    reply = await statement(billing, team="vision", period_start=at(-1), period_end=utcnow())
    [bill] = reply.statements
    [credit] = bill.credits
    # 1800.5 GPU-seconds x 2.80 / 3600, given back.
    assert credit.amount == Decimal("-1.400389")
    assert credit.lost_gpu_seconds == Decimal("1800.5")
    assert bill.subtotal == Decimal("6.24")  # 2 x 2.80 + 8 x 0.04 + 64 x 0.005
    assert bill.credits_total == Decimal("-1.400389")
    assert bill.total == Decimal("4.84")
    assert "Credits for work lost to forced preemption" in reply.text


async def test_a_forced_eviction_of_an_allocation_never_granted_is_dead_lettered(
    billing: ServiceRuntime,
) -> None:
    await announce(billing, "checkpoint", T.EVICTION_FORCED, forced("ghost", 60.0))

    [dead] = await stream_messages(billing.js, billing.subjects.dead_letter("billing"), 1)
    assert dead.headers["Gpusched-Reason"] == "rejected"
    reply = await statement(billing)
    assert reply.ok and reply.statements == []


async def test_a_statement_with_an_unpriced_gpu_model_is_refused_with_unknown_gpu_model(
    billing: ServiceRuntime,
) -> None:
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a1", model="MI300X"))

    [audit] = await stream_messages(billing.js, billing.subjects.audit("billing.unpriced"), 1)
    assert Envelope.from_bytes(audit.data).data["details"]["models"] == ["MI300X"]
    reply = await statement(billing, team="vision")
    assert not reply.ok
    assert reply.error is not None
    assert reply.error.code == "unknown_gpu_model"
    assert "MI300X" in reply.error.message
    assert reply.statements == []


async def test_a_malformed_statement_request_gets_a_bad_request_reply(
    billing: ServiceRuntime,
) -> None:
    reply = await statement(billing, period_start=at(2), period_end=at(1))
    assert not reply.ok and reply.error is not None and reply.error.code == "bad_request"
    msg = await billing.nc.request(statement_subject(billing.subjects.prefix), b"{", timeout=10)
    reply = StatementReply.model_validate_json(msg.data)
    assert not reply.ok and reply.error is not None and reply.error.code == "bad_request"


@pytest.mark.parametrize(
    ("period_start", "period_end"),
    [
        # Year 1 east of UTC, year 9999 west of it: valid times with no UTC value.
        ("0001-01-01T00:00:00+01:00", None),
        (None, "9999-12-31T23:59:59-12:00"),
        ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-12:00"),
    ],
    ids=["start", "end", "both"],
)
async def test_a_period_beyond_the_calendars_utc_range_is_clamped_to_the_whole_ledger(
    billing: ServiceRuntime, period_start: str | None, period_end: str | None
) -> None:
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a1", gpus=1))
    await announce(billing, "admission", T.ALLOCATION_RELEASED, released("a1", at(1)))
    await eventually(lambda: _has_closed_line(billing, "vision"), within=20)

    bounds = {"period_start": period_start, "period_end": period_end}
    reply = await statement(billing, team="vision", **{k: v for k, v in bounds.items() if v})
    assert reply.ok, reply.error
    [bill] = reply.statements
    [line] = bill.lines
    assert (line.start, line.end, line.gpu_cost) == (at(0), at(1), Decimal("2.80"))
    if period_start is not None:
        assert bill.period_start == datetime.min.replace(tzinfo=UTC)
    if period_end is not None:
        assert bill.period_end == datetime.max.replace(tzinfo=UTC)


def _bad(message_type: T, data: dict[str, Any]) -> bytes:
    return json.dumps(
        {"id": new_id(), "type": message_type.value, "source": "test",
         "time": "2026-03-02T09:00:00Z", "data": data}
    ).encode()  # fmt: skip


@pytest.mark.parametrize(
    ("source", "message_type", "raw"),
    [
        ("admission", T.ALLOCATION_GRANTED, _bad(T.ALLOCATION_GRANTED, {"allocation_id": "x"})),
        ("admission", T.ALLOCATION_RELEASED, b"not json"),
        ("checkpoint", T.EVICTION_FORCED, _bad(T.EVICTION_FORCED, {"saga_id": "s"})),
    ],
    ids=["granted", "released", "forced"],
)
async def test_a_malformed_message_on_a_consumed_subject_is_dead_lettered_and_changes_nothing(
    billing: ServiceRuntime, source: str, message_type: T, raw: bytes
) -> None:
    await publish(billing, source, message_type, raw)

    [dead] = await stream_messages(billing.js, billing.subjects.dead_letter("billing"), 1)
    assert dead.data == raw
    assert dead.headers["Gpusched-Reason"] == "malformed"
    # Still consuming, and the bad message left nothing behind.
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a2"))
    bill = await statement_of(billing, "vision", lines=1)
    assert [line.allocation_id for line in bill.lines] == ["a2"]
    assert bill.credits == []
    assert await usage_rows(billing) == [("a2", "opened")]


async def test_the_same_envelope_delivered_twice_records_one_usage_row(
    billing: ServiceRuntime,
) -> None:
    envelope = make_envelope(T.ALLOCATION_GRANTED, granted("a1"), source="admission")
    # Published without a Nats-Msg-Id, so JetStream stores both copies and only the
    # inbox stands between them and a double bill.
    for _ in range(2):
        await publish(billing, "admission", T.ALLOCATION_GRANTED, envelope.to_bytes())
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a2"))

    bill = await statement_of(billing, "vision", lines=2)
    assert sorted(line.allocation_id for line in bill.lines) == ["a1", "a2"]
    assert await usage_rows(billing) == [("a1", "opened"), ("a2", "opened")]


async def test_the_usage_ledger_refuses_updates_and_deletes(billing: ServiceRuntime) -> None:
    await announce(billing, "admission", T.ALLOCATION_GRANTED, granted("a1"))
    await statement_of(billing, "vision", lines=1)

    for sql in (
        "UPDATE billing.usage_events SET team = 'x'",
        "DELETE FROM billing.usage_events",
        "TRUNCATE billing.credits",
    ):
        async with billing.uow() as uow:
            with pytest.raises(Exception, match="append-only"):
                await uow.execute(sql)
    assert await usage_rows(billing) == [("a1", "opened")]


async def usage_rows(rt: ServiceRuntime) -> list[tuple[str, str]]:
    async with rt.uow() as uow:
        result = await uow.execute(
            "SELECT allocation_id, event FROM billing.usage_events ORDER BY allocation_id, seq"
        )
        return [(row.allocation_id, row.event) for row in result]
