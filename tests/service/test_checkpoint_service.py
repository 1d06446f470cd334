"""The checkpoint service: the checkpoint-confirmed-before-evict saga (DESIGN §3.4).

The service runs in-process on the real NATS and PostgreSQL; the test plays
preemption (eviction commands), the job (job events, as the SDK sends them: the
correlation id is the job id) and the cluster agent (workload results), and watches
what the service publishes: job control messages, evict commands, saga outcomes and
the audit stream.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel
from tests.support import services
from tests.support.waiting import eventually, stream_messages

from gpusched.checkpoint import app
from gpusched.checkpoint.api import get_saga_subject, latest_checkpoint_subject
from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    CheckpointConfirmed,
    CheckpointFailed,
    EvictFailed,
    EvictionRequested,
    EvictionWithdrawn,
    GpuRef,
    JobCompleted,
    JobKind,
    PriorityClassName,
    StageName,
    StopReason,
    T,
    WorkloadStopped,
)
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

WITHIN = 20.0


def with_checkpoint(settings: Settings, **update: Any) -> Settings:
    return settings.model_copy(update={"checkpoint": settings.checkpoint.model_copy(update=update)})


@pytest.fixture
def patient(settings: Settings) -> Settings:
    """A deadline far enough away that it never fires during a test."""
    return with_checkpoint(settings, grace_s=120.0, sweep_interval_s=0.1)


@pytest.fixture
def hasty(settings: Settings) -> Settings:
    return with_checkpoint(settings, grace_s=0.5, sweep_interval_s=0.1)


def running(settings: Settings) -> AbstractAsyncContextManager[ServiceRuntime]:
    return services.running(settings, app)


@pytest.fixture
async def service(patient: Settings) -> AsyncIterator[ServiceRuntime]:
    async with running(patient) as rt:
        yield rt


# --- the roles the test plays --------------------------------------------------------------


@dataclass(frozen=True)
class Victim:
    job_id: str
    allocation_id: str
    request_id: str


def victim() -> Victim:
    tag = uuid.uuid4().hex[:8]
    return Victim(f"job-{tag}", f"alloc-{tag}", f"req-{tag}")


async def publish(
    rt: ServiceRuntime,
    subject: str,
    message_type: str,
    data: BaseModel,
    *,
    correlation_id: str | None = None,
) -> Envelope:
    envelope = make_envelope(message_type, data, source="test", correlation_id=correlation_id)
    # No Nats-Msg-Id: what the service does with a copy is its own business (its inbox).
    await rt.js.publish(subject, envelope.to_bytes())
    return envelope


async def request_eviction(
    rt: ServiceRuntime,
    v: Victim,
    priority_class: PriorityClassName = PriorityClassName.P1_NORMAL,
    *,
    request_id: str | None = None,
    share_milli: int | None = None,
) -> Envelope:
    payload = EvictionRequested(
        request_id=request_id or v.request_id,
        decision_id=f"decision-{uuid.uuid4().hex[:8]}",
        allocation_id=v.allocation_id,
        job_id=v.job_id,
        team="vision",
        priority_class=priority_class,
        # A fraction of one GPU, or four whole ones.
        gpus=4 if share_milli is None else 1,
        started_at=utcnow() - timedelta(hours=1),
        reason="inference surge",
        share_milli=1000 if share_milli is None else share_milli,
    )
    subject = rt.subjects.command("checkpoint", T.EVICTION_REQUESTED)
    return await publish(rt, subject, T.EVICTION_REQUESTED, payload)


# The service verifies file:// claims, so the job the test plays writes real files.
CHECKPOINTS = Path(tempfile.gettempdir()) / "gpusched-test-checkpoints"


def checkpoint_file(job_id: str, step: int) -> tuple[str, int, str]:
    """Write a checkpoint file; its (uri, bytes, sha256)."""
    path = CHECKPOINTS / job_id / f"ckpt-{step}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = f"{job_id} at step {step}".encode()
    # Written aside and renamed, as a job saves: the service may be verifying an earlier
    # claim on this very file, and must never read it half-written.
    aside = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    aside.write_bytes(data)
    aside.replace(path)
    return path.as_uri(), len(data), hashlib.sha256(data).hexdigest()


async def confirm(
    rt: ServiceRuntime,
    v: Victim,
    step: int,
    stage: StageName = StageName.PERSISTED,
    *,
    request_id: str | None = None,
    job_id: str | None = None,
    claim: dict[str, Any] | None = None,
) -> Envelope:
    """The job confirms a checkpoint it really wrote; `claim` overrides what it says
    about it (uri, bytes, sha256) to make a false claim."""
    uri, size, sha256 = checkpoint_file(job_id or v.job_id, step)
    payload = CheckpointConfirmed(
        request_id=request_id,
        checkpoint_id=f"ckpt-{step}",
        step=step,
        stage=stage,
        **{"uri": uri, "bytes": size, "sha256": sha256, **(claim or {})},
    )
    return await publish(
        rt,
        rt.subjects.job_events(job_id or v.job_id),
        T.CHECKPOINT_CONFIRMED,
        payload,
        correlation_id=job_id or v.job_id,
    )


async def granted(
    rt: ServiceRuntime, v: Victim, priority_class: PriorityClassName = PriorityClassName.P1_NORMAL
) -> Envelope:
    """Admission grants the job its GPUs: the checkpoint service learns its class."""
    payload = AllocationGranted(
        allocation_id=v.allocation_id,
        job_id=v.job_id,
        team="vision",
        kind=JobKind.TRAINING,
        priority_class=priority_class,
        pool="shared",
        gpus=[GpuRef(node="shared-00", index=0, model="A100-80GB")],
        granted_at=utcnow(),
        attempt=1,
        checkpointable=True,
    )
    subject = rt.subjects.event("admission", T.ALLOCATION_GRANTED)
    envelope = await publish(rt, subject, T.ALLOCATION_GRANTED, payload, correlation_id=v.job_id)

    async def known() -> bool:
        async with rt.uow() as uow:
            result = await uow.execute(
                "SELECT priority_class FROM checkpoint.job_classes WHERE job_id = :j",
                {"j": v.job_id},
            )
            return result.scalar_one_or_none() == priority_class.value

    await eventually(known, within=WITHIN)
    return envelope


def claimed(uri: str, size: int = 1234) -> dict[str, Any]:
    """A claim about an object the test never wrote (storage the service cannot read)."""
    return {"uri": uri, "bytes": size, "sha256": hashlib.sha256(uri.encode()).hexdigest()}


async def workload_stopped(rt: ServiceRuntime, v: Victim, saga_id: str) -> Envelope:
    payload = WorkloadStopped(
        allocation_id=v.allocation_id,
        job_id=v.job_id,
        reason=StopReason.EVICTED,
        stopped_at=utcnow(),
        saga_id=saga_id,
    )
    subject = rt.subjects.event("agent", T.WORKLOAD_STOPPED)
    return await publish(rt, subject, T.WORKLOAD_STOPPED, payload)


# --- what the test watches ----------------------------------------------------------------


async def stored(rt: ServiceRuntime, subject: str) -> list[Envelope]:
    """Every message stored so far on `subject` (wildcards allowed), oldest first."""
    stream = await rt.js.find_stream_name_by_subject(subject)
    info = await rt.js.stream_info(stream, subjects_filter=subject)
    count = sum((info.state.subjects or {}).values())
    if count == 0:
        return []
    return [Envelope.from_bytes(m.data) for m in await stream_messages(rt.js, subject, count)]


async def wait_for(rt: ServiceRuntime, subject: str, count: int = 1) -> list[Envelope]:
    async def enough() -> list[Envelope]:
        got = await stored(rt, subject)
        return got if len(got) >= count else []

    return await eventually(enough, within=WITHIN)


def evict_commands(rt: ServiceRuntime) -> str:
    return rt.subjects.command("agent", T.EVICT_WORKLOAD)


def outcome(rt: ServiceRuntime, message_type: T) -> str:
    return rt.subjects.event("checkpoint", message_type)


async def audit_trail(rt: ServiceRuntime, entity: str) -> list[dict[str, Any]]:
    records = await stored(rt, rt.subjects.audit(">"))
    return [e.data for e in records if e.data["entity"] == entity]


async def wait_for_audit(rt: ServiceRuntime, entity: str, action: str) -> dict[str, Any]:
    async def found() -> dict[str, Any] | None:
        return next((r for r in await audit_trail(rt, entity) if r["action"] == action), None)

    record = await eventually(found, within=WITHIN)
    assert record is not None
    return record


async def ask(rt: ServiceRuntime, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await rt.nc.request(subject, json.dumps(body).encode(), timeout=WITHIN)
    answer: dict[str, Any] = json.loads(reply.data)
    return answer


async def saga_of(rt: ServiceRuntime, job_id: str) -> dict[str, Any]:
    reply = await ask(rt, get_saga_subject(rt.subjects), {"job_id": job_id})
    assert reply["ok"], reply
    saga: dict[str, Any] = reply["saga"]
    return saga


async def saga_rows(rt: ServiceRuntime) -> list[tuple[Any, ...]]:
    async with rt.uow() as uow:
        result = await uow.execute(
            "SELECT saga_id, state, deadline, data::text AS data FROM checkpoint.sagas "
            "ORDER BY saga_id"
        )
        return [tuple(row) for row in result]


async def checkpoint_requested(rt: ServiceRuntime, v: Victim) -> Envelope:
    [requested] = await wait_for(rt, rt.subjects.job_control(v.job_id))
    assert requested.type == T.CHECKPOINT_REQUESTED
    return requested


# --- the saga ----------------------------------------------------------------------------------


async def test_a_job_is_evicted_only_after_its_checkpoint_is_persisted_and_resumes_from_it(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    asked_at = utcnow()
    await request_eviction(rt, v)

    requested = await checkpoint_requested(rt, v)
    saga_id = requested.correlation_id
    assert saga_id is not None
    assert requested.data["request_id"] == v.request_id
    assert requested.data["job_id"] == v.job_id
    assert requested.data["stage_required"] == "persisted"  # the p1-normal policy
    deadline = datetime.fromisoformat(requested.data["deadline"])
    assert asked_at + timedelta(seconds=110) < deadline < utcnow() + timedelta(seconds=130)
    assert await stored(rt, evict_commands(rt)) == []

    # A snapshot in host memory is not enough for p1-normal: still nothing is evicted.
    await confirm(rt, v, 100, StageName.SNAPSHOTTED, request_id=v.request_id)
    await wait_for_audit(rt, saga_id, "checkpoint.recorded")
    assert await stored(rt, evict_commands(rt)) == []
    assert (await saga_of(rt, v.job_id))["state"] == "checkpointing"

    confirmation = await confirm(rt, v, 100, StageName.PERSISTED, request_id=v.request_id)
    [evict] = await wait_for(rt, evict_commands(rt))
    assert evict.data == {
        "allocation_id": v.allocation_id,
        "job_id": v.job_id,
        "saga_id": saga_id,
        "forced": False,
    }
    assert evict.correlation_id == saga_id
    assert evict.causation_id == confirmation.id

    await workload_stopped(rt, v, saga_id)
    [completed] = await wait_for(rt, outcome(rt, T.EVICTION_COMPLETED))
    assert completed.data["request_id"] == v.request_id
    assert completed.data["allocation_id"] == v.allocation_id
    assert completed.data["checkpoint"]["checkpoint_id"] == "ckpt-100"
    assert completed.data["checkpoint"]["stage"] == "persisted"

    await wait_for_audit(rt, saga_id, "eviction.completed")
    trail = await audit_trail(rt, saga_id)
    assert [(r["action"], r["details"]["from"], r["details"]["to"]) for r in trail] == [
        ("checkpoint.requested", "requested", "checkpointing"),
        ("checkpoint.recorded", "checkpointing", "checkpointing"),
        ("checkpoint.confirmed", "checkpointing", "confirmed"),
        ("evict", "confirmed", "evicting"),
        ("workload.evicted", "evicting", "evicted"),
        ("eviction.completed", "evicted", "completed"),
    ]
    assert all(r["details"]["request_id"] == v.request_id for r in trail)
    assert trail[-1]["details"]["checkpoint"]["checkpoint_id"] == "ckpt-100"
    saga = await saga_of(rt, v.job_id)
    assert (saga["state"], saga["outcome"]) == ("completed", "evicted")


async def test_a_missed_deadline_aborts_the_eviction_and_the_job_keeps_training(
    hasty: Settings,
) -> None:
    async with running(hasty) as rt:
        v = victim()
        await request_eviction(rt, v, PriorityClassName.P1_NORMAL)

        [aborted] = await wait_for(rt, outcome(rt, T.EVICTION_ABORTED))
        assert aborted.data["request_id"] == v.request_id
        assert aborted.data["reason"] == "deadline_aborted"
        control = await wait_for(rt, rt.subjects.job_control(v.job_id), 2)
        assert [m.type for m in control] == [T.CHECKPOINT_REQUESTED, T.PREEMPTION_CANCELLED]
        assert control[1].data == {"request_id": v.request_id}
        assert await stored(rt, evict_commands(rt)) == []
        record = await wait_for_audit(rt, aborted.data["saga_id"], "eviction.aborted")
        assert record["details"]["outcome"] == "deadline_aborted"


@pytest.mark.parametrize(("share_milli", "gpus"), [(None, 4.0), (250, 0.25)])
async def test_a_missed_deadline_under_the_force_policy_evicts_and_records_the_lost_work(
    hasty: Settings, share_milli: int | None, gpus: float
) -> None:
    async with running(hasty) as rt:
        v = victim()
        await request_eviction(rt, v, PriorityClassName.P2_OFFLINE, share_milli=share_milli)

        requested = await checkpoint_requested(rt, v)
        assert requested.data["stage_required"] == "snapshotted"  # the p2-offline policy
        [forced] = await wait_for(rt, outcome(rt, T.EVICTION_FORCED))
        # Four GPUs (or a quarter of one) for an hour with no checkpoint at all.
        assert gpus * 3600 <= forced.data["lost_gpu_seconds"] < gpus * 3700
        assert forced.data["checkpoint"] is None
        [evict] = await wait_for(rt, evict_commands(rt))
        assert evict.data["forced"] is True
        assert evict.data["saga_id"] == forced.data["saga_id"]
        record = await wait_for_audit(rt, forced.data["saga_id"], "eviction.forced")
        assert record["details"]["lost_gpu_seconds"] == forced.data["lost_gpu_seconds"]


async def test_a_withdrawn_need_cancels_the_eviction_and_a_late_checkpoint_evicts_nothing(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    saga_id = (await checkpoint_requested(rt, v)).correlation_id
    assert saga_id is not None

    withdrawal = EvictionWithdrawn(request_id=v.request_id, reason="inference load fell")
    subject = rt.subjects.command("checkpoint", T.EVICTION_WITHDRAWN)
    await publish(rt, subject, T.EVICTION_WITHDRAWN, withdrawal)

    [cancelled] = await wait_for(rt, outcome(rt, T.EVICTION_CANCELLED))
    assert cancelled.data["reason"] == "need_withdrawn"
    control = await wait_for(rt, rt.subjects.job_control(v.job_id), 2)
    assert control[1].type == T.PREEMPTION_CANCELLED
    assert (await saga_of(rt, v.job_id))["state"] == "cancelled"

    # The job had already started its checkpoint: the confirmation arrives too late.
    await confirm(rt, v, 50, request_id=v.request_id)
    ignored = await wait_for_audit(rt, saga_id, "saga.input_ignored")
    assert ignored["details"]["input"] == "CheckpointConfirmed"
    assert await stored(rt, evict_commands(rt)) == []


async def test_a_job_that_completes_during_the_saga_completes_it_with_nothing_evicted(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)

    await publish(
        rt,
        rt.subjects.job_events(v.job_id),
        T.JOB_COMPLETED,
        JobCompleted(job_id=v.job_id, step=1000),
        correlation_id=v.job_id,
    )

    [cancelled] = await wait_for(rt, outcome(rt, T.EVICTION_CANCELLED))
    assert cancelled.data["reason"] == "job_finished"
    saga = await saga_of(rt, v.job_id)
    assert (saga["state"], saga["outcome"]) == ("completed", "job_finished")
    assert await stored(rt, evict_commands(rt)) == []


async def test_a_second_eviction_request_for_the_same_allocation_is_audited_and_ignored(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    saga_id = (await checkpoint_requested(rt, v)).correlation_id
    assert saga_id is not None

    await request_eviction(rt, v, request_id="req-second")

    ignored = await wait_for_audit(rt, saga_id, "saga.input_ignored")
    assert ignored["details"]["request_id"] == "req-second"
    assert ignored["details"]["live_request_id"] == v.request_id
    assert len(await stored(rt, rt.subjects.job_control(v.job_id))) == 1
    assert len(await saga_rows(rt)) == 1
    assert (await saga_of(rt, v.job_id))["request_id"] == v.request_id


async def test_a_confirmation_for_another_request_is_audited_and_the_saga_keeps_waiting(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    saga_id = (await checkpoint_requested(rt, v)).correlation_id
    assert saga_id is not None

    await confirm(rt, v, 70, request_id="req-someone-else")

    ignored = await wait_for_audit(rt, saga_id, "saga.input_ignored")
    assert "req-someone-else" in ignored["reason"]
    assert (await saga_of(rt, v.job_id))["state"] == "checkpointing"
    assert await stored(rt, evict_commands(rt)) == []


async def test_a_restarted_service_still_enforces_a_deadline_set_before_the_restart(
    settings: Settings,
) -> None:
    short = with_checkpoint(settings, grace_s=3.0, sweep_interval_s=0.1)
    v = victim()
    async with running(short) as first:
        await request_eviction(first, v)
        requested = await checkpoint_requested(first, v)
    deadline = datetime.fromisoformat(requested.data["deadline"])
    assert utcnow() < deadline, "the first runtime should stop before the deadline"

    async with running(short) as second:
        [(_, state, stored_deadline, _)] = await saga_rows(second)
        assert state == "checkpointing"
        assert stored_deadline == deadline

        [aborted] = await wait_for(second, outcome(second, T.EVICTION_ABORTED))
        assert aborted.data["request_id"] == v.request_id
        assert aborted.time >= deadline


async def test_malformed_messages_on_every_consumed_subject_are_dead_lettered_and_change_nothing(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)
    before = await saga_rows(rt)
    now = datetime.now(UTC).isoformat()

    def raw(message_type: str, data: dict[str, Any], correlation_id: str | None = None) -> bytes:
        return json.dumps(
            {
                "id": str(uuid.uuid4()),
                "type": message_type,
                "source": "test",
                "time": now,
                "correlation_id": correlation_id,
                "data": data,
            }
        ).encode()

    good_checkpoint = {
        "request_id": v.request_id,
        "checkpoint_id": "ckpt-1",
        "step": 1,
        "uri": "file:///c",
        "bytes": 1,
        "sha256": "ab" * 32,
        "stage": "persisted",
    }
    bad = [
        (rt.subjects.command("checkpoint", T.EVICTION_REQUESTED), b"not json at all"),
        (
            rt.subjects.command("checkpoint", T.EVICTION_REQUESTED),
            raw(T.EVICTION_REQUESTED, {"request_id": "r", "gpus": 0}),
        ),
        (
            rt.subjects.command("checkpoint", T.EVICTION_WITHDRAWN),
            raw(T.EVICTION_WITHDRAWN, {"request_id": v.request_id}),
        ),
        (
            rt.subjects.job_events(v.job_id),
            raw(T.CHECKPOINT_CONFIRMED, {**good_checkpoint, "sha256": "nope"}, v.job_id),
        ),
        # Well-formed, but no correlation id: nothing says which job it is about.
        (rt.subjects.job_events(v.job_id), raw(T.CHECKPOINT_CONFIRMED, good_checkpoint)),
        (
            rt.subjects.event("agent", T.WORKLOAD_STOPPED),
            raw(T.WORKLOAD_STOPPED, {"allocation_id": v.allocation_id, "reason": "vanished"}),
        ),
        (
            rt.subjects.event("admission", T.ALLOCATION_GRANTED),
            raw(T.ALLOCATION_GRANTED, {"job_id": v.job_id, "priority_class": "p0-urgent"}),
        ),
    ]
    for subject, body in bad:
        await rt.js.publish(subject, body)

    dead = await stream_messages(rt.js, rt.subjects.dead_letter("checkpoint"), len(bad), WITHIN)
    headers = [m.headers or {} for m in dead]
    assert sorted(
        (h["Gpusched-Original-Subject"], m.data) for h, m in zip(headers, dead, strict=True)
    ) == sorted(bad)
    assert {h["Gpusched-Reason"] for h in headers} == {"malformed"}
    assert await saga_rows(rt) == before
    assert await stored(rt, evict_commands(rt)) == []

    # Still serving: a good confirmation moves the saga on.
    await confirm(rt, v, 5, request_id=v.request_id)
    await wait_for(rt, evict_commands(rt))


async def test_the_same_envelope_delivered_twice_opens_one_saga_and_asks_once(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    envelope = await request_eviction(rt, v)
    await rt.js.publish(
        rt.subjects.command("checkpoint", T.EVICTION_REQUESTED), envelope.to_bytes()
    )
    # A message behind both copies on the same consumer: once it is applied, so are they.
    marker = EvictionWithdrawn(request_id="req-marker", reason="marker")
    await publish(
        rt, rt.subjects.command("checkpoint", T.EVICTION_WITHDRAWN), T.EVICTION_WITHDRAWN, marker
    )
    await wait_for_audit(rt, "req-marker", "saga.input_ignored")

    assert len(await stored(rt, rt.subjects.job_control(v.job_id))) == 1
    saga_id = (await saga_of(rt, v.job_id))["saga_id"]
    assert [r["action"] for r in await audit_trail(rt, saga_id)] == ["checkpoint.requested"]


async def test_the_catalogue_answers_the_latest_usable_checkpoint_of_a_job(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    latest = latest_checkpoint_subject(rt.subjects)
    # Periodic checkpoints, with no eviction in sight, are catalogued all the same.
    await confirm(rt, v, 100, StageName.PERSISTED)
    await confirm(rt, v, 200, StageName.SNAPSHOTTED)
    await confirm(rt, v, 200, StageName.PERSISTED)
    await confirm(rt, v, 300, StageName.SNAPSHOTTED)

    async def newest() -> dict[str, Any]:
        reply = await ask(rt, latest, {"job_id": v.job_id})
        found: dict[str, Any] = reply["checkpoint"] or {}
        return found if found.get("step") == 300 else {}

    assert (await eventually(newest, within=WITHIN))["stage"] == "snapshotted"
    durable = await ask(rt, latest, {"job_id": v.job_id, "min_stage": "persisted"})
    assert (durable["checkpoint"]["step"], durable["checkpoint"]["stage"]) == (200, "persisted")
    assert await ask(rt, latest, {"job_id": "job-unknown"}) == {
        "ok": True,
        "checkpoint": None,
        "confirmed_at": None,
        "error": None,
    }
    assert (await ask(rt, latest, {"nope": 1}))["ok"] is False


async def test_a_failed_checkpoint_aborts_the_eviction_under_the_abort_policy(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)

    failure = CheckpointFailed(request_id=v.request_id, error="disk full")
    await publish(
        rt,
        rt.subjects.job_events(v.job_id),
        T.CHECKPOINT_FAILED,
        failure,
        correlation_id=v.job_id,
    )

    [aborted] = await wait_for(rt, outcome(rt, T.EVICTION_ABORTED))
    assert aborted.data["reason"] == "checkpoint_failed_aborted"
    assert await stored(rt, evict_commands(rt)) == []


async def test_a_failed_evict_command_is_sent_again(service: ServiceRuntime) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    saga_id = (await checkpoint_requested(rt, v)).correlation_id
    assert saga_id is not None
    await confirm(rt, v, 10, request_id=v.request_id)
    await wait_for(rt, evict_commands(rt))

    failure = EvictFailed(
        allocation_id=v.allocation_id, job_id=v.job_id, saga_id=saga_id, error="node unreachable"
    )
    await publish(rt, rt.subjects.event("agent", T.EVICT_FAILED), T.EVICT_FAILED, failure)

    first, second = await wait_for(rt, evict_commands(rt), 2)
    assert first.data == second.data
    saga = await saga_of(rt, v.job_id)
    assert (saga["state"], saga["evict_attempts"]) == ("evicting", 2)


# --- verification of what the job claims -------------------------------------------------


async def test_a_checkpoint_claim_that_storage_contradicts_is_no_confirmation(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    saga_id = (await checkpoint_requested(rt, v)).correlation_id
    assert saga_id is not None

    missing = {"uri": (CHECKPOINTS / v.job_id / "never-written.bin").as_uri()}
    await confirm(rt, v, 10, request_id=v.request_id, claim=missing)
    await confirm(rt, v, 11, request_id=v.request_id, claim={"bytes": 1})
    await confirm(rt, v, 12, request_id=v.request_id, claim={"sha256": "0" * 64})

    async def three_unverified() -> list[dict[str, Any]]:
        trail = await audit_trail(rt, saga_id)
        found = [r for r in trail if r["action"] == "checkpoint.unverified"]
        return found if len(found) == 3 else []

    records = await eventually(three_unverified, within=WITHIN)
    reasons = " ".join(r["reason"] for r in records)
    assert "does not exist" in reasons and "bytes" in reasons and "sha256" in reasons
    assert all(r["details"]["verification"] == "false" for r in records)
    assert await stored(rt, evict_commands(rt)) == []
    assert (await saga_of(rt, v.job_id))["state"] == "checkpointing"
    # A false claim is not in the catalogue either: nothing would resume from it.
    latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": v.job_id})
    assert latest["checkpoint"] is None

    # The true claim that follows is a confirmation like any other.
    await confirm(rt, v, 13, request_id=v.request_id)
    [evict] = await wait_for(rt, evict_commands(rt))
    assert evict.data["forced"] is False
    assert (await saga_of(rt, v.job_id))["checkpoint"]["checkpoint_id"] == "ckpt-13"


async def test_a_verified_checkpoint_is_announced_once_and_a_false_claim_never(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    first = await confirm(rt, v, 10)
    await rt.js.publish(rt.subjects.job_events(v.job_id), first.to_bytes())  # redelivered
    await confirm(rt, v, 10)  # the same claim again, under a new id
    await confirm(rt, v, 11, claim={"sha256": "0" * 64})
    await confirm(rt, v, 11, claim={"uri": (CHECKPOINTS / v.job_id / "gone.bin").as_uri()})
    # The job's claims are applied in order: once step 12 is announced, all were seen.
    await confirm(rt, v, 12, StageName.SNAPSHOTTED)
    await confirm(rt, v, 12, StageName.PERSISTED)  # the same checkpoint, now durable

    announced = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED), 3)
    assert [
        (e.data["checkpoint"]["checkpoint_id"], e.data["checkpoint"]["stage"]) for e in announced
    ] == [("ckpt-10", "persisted"), ("ckpt-12", "snapshotted"), ("ckpt-12", "persisted")]
    assert all(e.data["job_id"] == v.job_id and e.correlation_id == v.job_id for e in announced)
    assert all(e.data["request_id"] is None for e in announced)
    assert announced[0].causation_id == first.id
    await asyncio.sleep(1)  # nothing more follows
    assert len(await stored(rt, outcome(rt, T.CHECKPOINT_VERIFIED))) == 3


async def test_an_evictions_confirmation_is_announced_with_its_request(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)
    await confirm(rt, v, 10, request_id=v.request_id, claim={"bytes": 1})  # false
    await confirm(rt, v, 10, request_id=v.request_id)

    [announced] = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED))
    assert announced.data["request_id"] == v.request_id
    assert announced.data["checkpoint"]["checkpoint_id"] == "ckpt-10"
    catalogued = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": v.job_id})
    assert datetime.fromisoformat(announced.data["confirmed_at"]) == datetime.fromisoformat(
        catalogued["confirmed_at"]
    )


async def test_with_verification_off_only_the_schemes_trusted_for_the_class_are_accepted(
    settings: Settings,
) -> None:
    blind = with_checkpoint(settings, verify_uris=False, trusted_schemes={"p2-offline": ["file"]})
    async with running(blind) as rt:
        offline, normal = victim(), victim()
        await granted(rt, offline, PriorityClassName.P2_OFFLINE)
        await granted(rt, normal, PriorityClassName.P1_NORMAL)
        await confirm(rt, offline, 10, claim={"sha256": "0" * 64})  # not read: not caught
        await confirm(rt, normal, 10)

        [announced] = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED))
        assert announced.data["job_id"] == offline.job_id
        assert announced.data["checkpoint"]["sha256"] == "0" * 64
        trusted = await wait_for_audit(rt, offline.job_id, "checkpoint.trusted")
        assert "trusted without verification" in trusted["reason"]
        assert trusted["details"]["verification"] == "trusted"
        assert trusted["details"]["scheme"] == "file"
        assert trusted["details"]["priority_class"] == "p2-offline"
        # A true file claim is not verified either with verification off, and p1-normal
        # trusts nothing: refused.
        refused = await wait_for_audit(rt, normal.job_id, "checkpoint.unverified")
        assert refused["details"]["verification"] == "untrusted"
        assert refused["details"]["priority_class"] == "p1-normal"
        latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": normal.job_id})
        assert latest["checkpoint"] is None


# --- URI schemes the service cannot verify ------------------------------------------------


async def test_an_s3_claim_of_a_p1_job_with_no_trust_is_refused_and_nothing_is_evicted_on_it(
    hasty: Settings,
) -> None:
    async with running(hasty) as rt:
        v = victim()
        await request_eviction(rt, v, PriorityClassName.P1_NORMAL)
        saga_id = (await checkpoint_requested(rt, v)).correlation_id
        assert saga_id is not None

        forged = claimed("s3://attacker-bucket/evil.pt")
        await confirm(rt, v, 10, request_id=v.request_id, claim=forged)

        refused = await wait_for_audit(rt, saga_id, "checkpoint.unverified")
        assert refused["details"]["job_id"] == v.job_id
        assert refused["details"]["verification"] == "untrusted"
        assert refused["details"]["scheme"] == "s3"
        assert refused["details"]["priority_class"] == "p1-normal"
        assert "not trusted for class p1-normal" in refused["reason"]
        # The deadline decides, as if no claim had come: p1-normal aborts, evicts nothing.
        [aborted] = await wait_for(rt, outcome(rt, T.EVICTION_ABORTED))
        assert aborted.data["reason"] == "deadline_aborted"
        assert await stored(rt, evict_commands(rt)) == []
        assert (await saga_of(rt, v.job_id))["checkpoint"] is None
        # Never catalogued nor announced: nothing resumes from it.
        latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": v.job_id})
        assert latest["checkpoint"] is None
        assert await stored(rt, outcome(rt, T.CHECKPOINT_VERIFIED)) == []


async def test_a_scheme_trusted_for_a_class_is_accepted_for_it_and_audited_unverified(
    settings: Settings,
) -> None:
    trusting = with_checkpoint(
        settings, grace_s=120.0, sweep_interval_s=0.1, trusted_schemes={"p2-offline": ["S3"]}
    )
    async with running(trusting) as rt:
        offline, periodic, normal, unknown = victim(), victim(), victim(), victim()
        await request_eviction(rt, offline, PriorityClassName.P2_OFFLINE)
        await checkpoint_requested(rt, offline)
        await granted(rt, periodic, PriorityClassName.P2_OFFLINE)
        await granted(rt, normal, PriorityClassName.P1_NORMAL)

        uri = "s3://checkpoints/offline/ckpt-10.pt"
        await confirm(rt, offline, 10, request_id=offline.request_id, claim=claimed(uri))
        [evict] = await wait_for(rt, evict_commands(rt))
        assert (evict.data["job_id"], evict.data["forced"]) == (offline.job_id, False)
        trusted = await wait_for_audit(rt, offline.job_id, "checkpoint.trusted")
        assert trusted["reason"].startswith(
            f"checkpoint ckpt-10 of job {offline.job_id} trusted without verification"
        )
        assert trusted["details"]["verification"] == "trusted"
        assert trusted["details"]["scheme"] == "s3"
        assert trusted["details"]["priority_class"] == "p2-offline"
        assert trusted["details"]["checkpoint"]["uri"] == uri

        # A periodic claim: the class comes from admission's grant.
        await confirm(rt, periodic, 5, claim=claimed("s3://checkpoints/periodic/5.pt"))
        await wait_for_audit(rt, periodic.job_id, "checkpoint.trusted")
        # Trusted for p2-offline only: a p1-normal job's claim, or that of a job whose
        # class the service has not learned, is refused.
        await confirm(rt, normal, 5, claim=claimed("s3://checkpoints/normal/5.pt"))
        await confirm(rt, unknown, 5, claim=claimed("s3://checkpoints/unknown/5.pt"))
        refused = await wait_for_audit(rt, normal.job_id, "checkpoint.unverified")
        assert refused["details"]["priority_class"] == "p1-normal"
        stranger = await wait_for_audit(rt, unknown.job_id, "checkpoint.unverified")
        assert stranger["details"]["priority_class"] is None
        assert "not known" in stranger["reason"]

        announced = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED), 2)
        assert {e.data["job_id"] for e in announced} == {offline.job_id, periodic.job_id}
        latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": normal.job_id})
        assert latest["checkpoint"] is None


async def test_a_claim_whose_uri_is_malformed_or_has_no_scheme_is_refused(
    service: ServiceRuntime,
) -> None:
    rt = service
    bad = [
        "checkpoints/ckpt-1.pt",  # no scheme
        "/var/ckpt/ckpt-2.pt",  # a path, not a URI
        "http://[::1/ckpt-3.pt",  # not a URI at all
        "file:ckpt-4.pt",  # relative: read from wherever each reader runs
        "file://attacker.example/ckpt-5.pt",  # a host the service would ignore
    ]
    jobs = [victim() for _ in bad]
    for step, (v, uri) in enumerate(zip(jobs, bad, strict=True), start=1):
        await confirm(rt, v, step, claim={"uri": uri})

    for v, uri in zip(jobs, bad, strict=True):
        record = await wait_for_audit(rt, v.job_id, "checkpoint.unverified")
        assert record["details"]["verification"] == "malformed", (uri, record)
        assert record["details"]["scheme"] is None
        assert record["details"]["claim"]["uri"] == uri
    assert await stored(rt, outcome(rt, T.CHECKPOINT_VERIFIED)) == []


async def test_a_false_claim_leaves_the_deadline_to_decide_and_the_force_is_audited(
    hasty: Settings,
) -> None:
    async with running(hasty) as rt:
        v = victim()
        await request_eviction(rt, v, PriorityClassName.P2_OFFLINE)
        await checkpoint_requested(rt, v)
        await confirm(rt, v, 10, request_id=v.request_id, claim={"sha256": "1" * 64})

        [forced] = await wait_for(rt, outcome(rt, T.EVICTION_FORCED))
        [evict] = await wait_for(rt, evict_commands(rt))
        assert evict.data["forced"] is True
        assert forced.data["checkpoint"] is None
        await wait_for_audit(rt, forced.data["saga_id"], "checkpoint.unverified")
        await wait_for_audit(rt, forced.data["saga_id"], "eviction.forced")


# --- edge cases --------------------------------------------------------------------------


async def test_a_confirmation_delivered_twice_sends_one_evict_command(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)
    confirmation = await confirm(rt, v, 10, request_id=v.request_id)
    await rt.js.publish(rt.subjects.job_events(v.job_id), confirmation.to_bytes())
    # A second confirmation (new id, same claim) is a duplicate the saga refuses. Sent
    # as it is, without writing the file again: a rewrite while the service verifies
    # the first claim would make that one false (and this one the confirmation).
    await publish(
        rt,
        rt.subjects.job_events(v.job_id),
        T.CHECKPOINT_CONFIRMED,
        confirmation.payload(CheckpointConfirmed),
        correlation_id=v.job_id,
    )

    [evict] = await wait_for(rt, evict_commands(rt))
    saga_id = evict.data["saga_id"]
    ignored = await wait_for_audit(rt, saga_id, "saga.input_ignored")
    assert ignored["details"]["input"] == "CheckpointConfirmed"
    assert len(await stored(rt, evict_commands(rt))) == 1


async def test_an_older_confirmation_arriving_after_the_eviction_started_changes_nothing(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)
    await confirm(rt, v, 20, StageName.PERSISTED, request_id=v.request_id)
    [evict] = await wait_for(rt, evict_commands(rt))

    # Out of order: the snapshot of an earlier step overtaken by its persisted successor.
    await confirm(rt, v, 15, StageName.SNAPSHOTTED, request_id=v.request_id)
    await wait_for_audit(rt, evict.data["saga_id"], "saga.input_ignored")
    saga = await saga_of(rt, v.job_id)
    assert (saga["state"], saga["checkpoint"]["step"]) == ("evicting", 20)
    assert len(await stored(rt, evict_commands(rt))) == 1


async def test_a_confirmation_from_another_job_with_this_request_id_moves_nothing(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    await checkpoint_requested(rt, v)
    other = victim()

    await confirm(rt, v, 30, request_id=v.request_id, job_id=other.job_id)

    # Catalogued for the job that sent it, and only for that one.
    latest = latest_checkpoint_subject(rt.subjects)

    async def catalogued() -> bool:
        reply = await ask(rt, latest, {"job_id": other.job_id})
        return reply["checkpoint"] is not None

    await eventually(catalogued, within=WITHIN)
    assert (await ask(rt, latest, {"job_id": v.job_id}))["checkpoint"] is None
    assert (await saga_of(rt, v.job_id))["state"] == "checkpointing"
    assert await stored(rt, evict_commands(rt)) == []


async def test_an_eviction_that_fails_three_times_is_aborted_and_the_job_keeps_training(
    service: ServiceRuntime,
) -> None:
    rt, v = service, victim()
    await request_eviction(rt, v)
    saga_id = (await checkpoint_requested(rt, v)).correlation_id
    assert saga_id is not None
    await confirm(rt, v, 10, request_id=v.request_id)

    for attempt in range(1, 4):
        await wait_for(rt, evict_commands(rt), attempt)
        failure = EvictFailed(
            allocation_id=v.allocation_id,
            job_id=v.job_id,
            saga_id=saga_id,
            error="no such workload on this cluster",  # what the agent says of a lost node
        )
        await publish(rt, rt.subjects.event("agent", T.EVICT_FAILED), T.EVICT_FAILED, failure)

    [aborted] = await wait_for(rt, outcome(rt, T.EVICTION_ABORTED))
    assert aborted.data["reason"] == "evict_failed"
    assert len(await stored(rt, evict_commands(rt))) == 3
    control = await wait_for(rt, rt.subjects.job_control(v.job_id), 2)
    assert control[-1].type == T.PREEMPTION_CANCELLED
    record = await wait_for_audit(rt, saga_id, "eviction.aborted")
    assert "3 times" in record["reason"]


# --- catalogue retention -----------------------------------------------------------------


async def test_the_catalogue_keeps_the_newest_checkpoints_and_those_a_saga_references(
    settings: Settings,
) -> None:
    keep_two = with_checkpoint(settings, grace_s=120.0, sweep_interval_s=0.1, retention_per_job=2)
    async with running(keep_two) as rt:
        v = victim()
        await request_eviction(rt, v)
        await checkpoint_requested(rt, v)
        # The eviction waits for (and admission will resume from) step 1.
        await confirm(rt, v, 1, request_id=v.request_id)
        await wait_for(rt, evict_commands(rt))
        for step in (2, 3, 4):
            await confirm(rt, v, step)

        async def kept() -> set[str]:
            async with rt.uow() as uow:
                result = await uow.execute(
                    "SELECT DISTINCT checkpoint_id FROM checkpoint.checkpoints WHERE job_id = :j",
                    {"j": v.job_id},
                )
                ids = {row.checkpoint_id for row in result}
            return ids if "ckpt-4" in ids and "ckpt-2" not in ids else set()

        assert await eventually(kept, within=WITHIN) == {"ckpt-1", "ckpt-3", "ckpt-4"}
        retired = await wait_for_audit(rt, v.job_id, "checkpoint.retired")
        assert [r["checkpoint_id"] for r in retired["details"]["retired"]] == ["ckpt-2"]


# --- a mass eviction: messages that arrive together share transactions -----------------------


async def test_a_mass_eviction_applied_in_shared_transactions_ends_every_saga_as_one_alone(
    service: ServiceRuntime,
) -> None:
    """Each step of 24 sagas arrives at once, so the consumers apply them in batches,
    whose prepare hook locks and reads for the whole batch in one statement. Every saga
    must still take exactly the path of the one-at-a-time test above, with the job's
    earlier periodic checkpoint found for those that have one."""
    rt = service
    victims = [victim() for _ in range(24)]
    # Half the jobs took a periodic checkpoint before the eviction was asked for.
    for v in victims[::2]:
        await confirm(rt, v, 10, StageName.PERSISTED)
    await eventually(lambda: _catalogued(rt, len(victims[::2])), within=WITHIN)
    await asyncio.gather(*(request_eviction(rt, v) for v in victims))
    # A second request for victim 0's allocation, among the first ones. The two keys
    # (requests) are applied without an order between them: the one-live-saga index
    # lets exactly one open a saga, whichever it is, and the other is ignored.
    again = f"req-again-{victims[0].job_id}"
    await request_eviction(rt, victims[0], request_id=again)
    requested = {v.job_id: await checkpoint_requested(rt, v) for v in victims}
    request_of = {v.job_id: str(requested[v.job_id].data["request_id"]) for v in victims}
    assert request_of[victims[0].job_id] in (victims[0].request_id, again)
    assert all(request_of[v.job_id] == v.request_id for v in victims[1:])
    # Each saga began with its job's latest checkpoint, read for the whole batch.
    for index, v in enumerate(victims):
        earlier = (await saga_of(rt, v.job_id))["last_confirmed"]
        if index % 2 == 0:
            assert earlier is not None and earlier["checkpoint_id"] == "ckpt-10", v
        else:
            assert earlier is None, v

    await asyncio.gather(*(confirm(rt, v, 100, request_id=request_of[v.job_id]) for v in victims))
    commands = await wait_for(rt, evict_commands(rt), len(victims))
    assert sorted(c.data["job_id"] for c in commands) == sorted(v.job_id for v in victims)
    await asyncio.gather(
        *(workload_stopped(rt, v, str(requested[v.job_id].correlation_id)) for v in victims)
    )
    completed = await wait_for(rt, outcome(rt, T.EVICTION_COMPLETED), len(victims))

    assert sorted(c.data["request_id"] for c in completed) == sorted(request_of.values())
    assert all(c.data["checkpoint"]["checkpoint_id"] == "ckpt-100" for c in completed)
    for v in victims:
        saga_id = str(requested[v.job_id].correlation_id)
        await wait_for_audit(rt, saga_id, "eviction.completed")
        trail = await audit_trail(rt, saga_id)
        steps = [
            (r["action"], r["details"]["to"]) for r in trail if r["action"] != "saga.input_ignored"
        ]
        assert steps == [
            ("checkpoint.requested", "checkpointing"),
            ("checkpoint.confirmed", "confirmed"),
            ("evict", "evicting"),
            ("workload.evicted", "evicted"),
            ("eviction.completed", "completed"),
        ], v
    ignored = await wait_for_audit(
        rt, str(requested[victims[0].job_id].correlation_id), "saga.input_ignored"
    )
    loser = ({victims[0].request_id, again} - {request_of[victims[0].job_id]}).pop()
    assert ignored["details"]["request_id"] == loser
    assert len(await saga_rows(rt)) == len(victims)
    # The messages did share transactions: inbox rows written by one transaction.
    async with rt.uow() as uow:
        shared = await uow.fetch(
            "SELECT count(*) AS n FROM checkpoint.inbox GROUP BY xmin::text HAVING count(*) > 1"
        )
    assert shared, "no two messages were applied in one transaction"


async def _catalogued(rt: ServiceRuntime, count: int) -> bool:
    async with rt.uow() as uow:
        row = await uow.fetchrow("SELECT count(*) AS n FROM checkpoint.checkpoints")
    return row is not None and row["n"] >= count
