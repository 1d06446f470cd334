"""The elastic-pool controller on the real NATS and PostgreSQL: ledger events and pool
snapshots in, reservations, eviction requests and returns out."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from typing import Any

import pytest
from prometheus_client import REGISTRY
from pydantic import BaseModel
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    CheckpointConfirmed,
    CheckpointInfo,
    CheckpointVerified,
    EvictionAborted,
    EvictionCompleted,
    EvictionRequested,
    GpuRef,
    GpuShare,
    GpusReserved,
    InventoryLoaded,
    InventoryNode,
    JobKind,
    PoolSnapshot,
    PoolState,
    PriorityClassName,
    ReserveForInference,
    ReturnToShared,
    ServiceState,
    StageName,
    T,
)
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import PreemptionSettings, Settings
from gpusched.preemption import app

P0, P1, P2 = PriorityClassName.P0_URGENT, PriorityClassName.P1_NORMAL, PriorityClassName.P2_OFFLINE


# Windows, cooldown and min lend off so one snapshot decides; the min runtime keeps its
# default (the test grants are an hour old).
FAST = PreemptionSettings(
    cooldown_s=0, expand_hold_s=0, shrink_hold_s=0, min_lend_s=0, decide_interval_s=0.1
)


async def running(settings: Settings, knobs: PreemptionSettings) -> AsyncIterator[ServiceRuntime]:
    tuned = settings.model_copy(update={"preemption": knobs})
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, tuned, migrations_dir(app.__file__))
    await runtime.start()
    await app.build(runtime)
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


@pytest.fixture
async def preemption(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    async for runtime in running(settings, FAST):
        yield runtime


@pytest.fixture
async def slow_windows(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    knobs = FAST.model_copy(update={"expand_hold_s": 3600.0, "slo_ms": {"chat": 100.0}})
    async for runtime in running(settings, knobs):
        yield runtime


# --- inputs --------------------------------------------------------------------------------
async def publish(rt: ServiceRuntime, subject: str, envelope: Envelope) -> Envelope:
    await rt.js.publish(subject, envelope.to_bytes())
    return envelope


async def event(
    rt: ServiceRuntime, service: str, message_type: T, data: BaseModel, **kw: str
) -> Envelope:
    envelope = make_envelope(message_type, data, source=service, **kw)
    return await publish(rt, rt.subjects.event(service, message_type), envelope)


def refs(node: str, count: int) -> list[GpuRef]:
    return [GpuRef(node=node, index=i, model="A100-80GB") for i in range(count)]


async def grant(
    rt: ServiceRuntime,
    allocation_id: str,
    priority: PriorityClassName,
    gpus: int = 2,
    *,
    borrowed: bool = False,
) -> None:
    granted = AllocationGranted(
        allocation_id=allocation_id,
        job_id=f"job-{allocation_id}",
        team="research",
        kind=JobKind.TRAINING,
        priority_class=priority,
        pool="shared",
        gpus=refs(f"node-{allocation_id}", gpus),
        granted_at=utcnow() - timedelta(hours=1),
        attempt=1,
        checkpointable=True,
        borrowed=borrowed,
    )
    await event(rt, "admission", T.ALLOCATION_GRANTED, granted)


def snapshot(
    inference_util: float,
    shared_util: float,
    *,
    inference_gpus: int = 4,
    shared_gpus: int = 8,
) -> PoolSnapshot:
    return PoolSnapshot(
        time=utcnow(),
        # Readings of an instant: one taken after a pool change describes the changed pool.
        window_s=0.001,
        pools=[
            PoolState(pool="inference", gpus=inference_gpus, util=inference_util,
                      reporting_gpus=inference_gpus),
            PoolState(pool="shared", gpus=shared_gpus, util=shared_util,
                      reporting_gpus=shared_gpus),
        ],
    )  # fmt: skip


async def send_snapshot(rt: ServiceRuntime, snap: PoolSnapshot) -> Envelope:
    return await event(rt, "ingest", T.POOL_SNAPSHOT, snap)


CHECKPOINT = CheckpointInfo(
    checkpoint_id="c1", step=100, uri="s3://ckpt/c1", bytes=1, sha256="0" * 64,
    stage=StageName.PERSISTED,
)  # fmt: skip


async def verified(
    rt: ServiceRuntime, job_id: str, confirmed_at: datetime | None = None
) -> Envelope:
    """The checkpoint service announces a checkpoint it verified, as it would."""
    announced = CheckpointVerified(
        job_id=job_id, request_id=None, checkpoint=CHECKPOINT,
        confirmed_at=confirmed_at or utcnow(),
    )  # fmt: skip
    return await event(rt, "checkpoint", T.CHECKPOINT_VERIFIED, announced, correlation_id=job_id)


# --- outputs -------------------------------------------------------------------------------
async def commands(rt: ServiceRuntime, target: str, message_type: T, n: int) -> list[Envelope]:
    msgs = await stream_messages(rt.js, rt.subjects.command(target, message_type), n, within=20)
    return [Envelope.from_bytes(m.data) for m in msgs]


async def reserves(rt: ServiceRuntime, n: int) -> list[ReserveForInference]:
    return [
        e.payload(ReserveForInference)
        for e in await commands(rt, "admission", T.RESERVE_FOR_INFERENCE, n)
    ]


async def evictions(rt: ServiceRuntime, n: int) -> list[EvictionRequested]:
    return [
        e.payload(EvictionRequested)
        for e in await commands(rt, "checkpoint", T.EVICTION_REQUESTED, n)
    ]


async def audits(rt: ServiceRuntime, action: str, n: int) -> list[dict[str, Any]]:
    msgs = await stream_messages(rt.js, rt.subjects.audit(action), n, within=20)
    return [Envelope.from_bytes(m.data).data for m in msgs]


# --- synchronisation on the service's own state --------------------------------------------
async def scalar(rt: ServiceRuntime, sql: str) -> object:
    async with rt.uow() as uow:
        return (await uow.execute(sql.format(s=rt.schema))).scalar_one()


async def wait_for(rt: ServiceRuntime, sql: str, expected: object) -> None:
    async def check() -> bool:
        return await scalar(rt, sql) == expected

    await eventually(check, within=20)


async def allocations_known(rt: ServiceRuntime, count: int) -> None:
    await wait_for(rt, "SELECT count(*) FROM {s}.allocations", count)


async def applied(rt: ServiceRuntime, envelope: Envelope) -> None:
    await wait_for(rt, f"SELECT count(*) FROM {{s}}.inbox WHERE message_id = '{envelope.id}'", 1)


# --- behaviour -----------------------------------------------------------------------------
async def test_a_hot_inference_pool_evicts_p2_first_and_waits_while_the_decision_is_in_flight(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p1", P1)
    await grant(preemption, "a-p2", P2)
    await grant(preemption, "a-p0", P0)
    await allocations_known(preemption, 3)

    # 0.95 on 4 GPUs: ceil(0.95 * 4 / 0.7) - 4 = 2 GPUs; the shared pool is fully allocated.
    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=6))

    [reserve] = await reserves(preemption, 1)
    assert (reserve.allocation_ids, reserve.free_gpus) == (["a-p2"], 0)
    [request] = await evictions(preemption, 1)
    assert (request.allocation_id, request.priority_class, request.gpus) == ("a-p2", P2, 2)
    assert request.decision_id == reserve.decision_id
    [expand] = await audits(preemption, "preempt.expand", 1)
    details = expand["details"]
    assert details["inference"] == {"gpus": 4, "util": 0.95, "reporting_gpus": 4}
    assert details["thresholds"]["expand_above"] == 0.8
    candidates = details["candidates"]
    ranked = {c["allocation_id"]: c["reason"] for c in candidates["ranked"]}
    assert ranked["a-p2"].startswith("chosen")
    # a-p1 ranks after the need was met; a-p0 may never be chosen.
    assert candidates["not_needed"]["allocation_ids"] == ["a-p1"]
    ineligible = {c["allocation_id"]: c["reason"] for c in candidates["ineligible"]}
    assert "never preempted" in ineligible["a-p0"]
    assert candidates["ineligible_by_reason"] == {
        "skipped: p0-urgent is never preempted for inference": 1
    }
    assert details["windows"]["expand_hold_s"] == 0
    assert details["replica"].endswith(f":{os.getpid()}")

    # Still hot, but one decision is in flight: nothing new.
    second = await send_snapshot(preemption, snapshot(0.97, 0.9, shared_gpus=6))
    await applied(preemption, second)
    assert await scalar(preemption, "SELECT count(*) FROM {s}.decisions") == 1
    assert await scalar(preemption, "SELECT count(*) FROM {s}.evictions") == 1


async def test_p2_fractions_sharing_a_gpu_are_evicted_together_before_a_p1_whole_gpu_job(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p1", P1, gpus=8)
    for name in ("a-f1", "a-f2"):
        share = AllocationGranted(
            allocation_id=name, job_id=f"job-{name}", team="research", kind=JobKind.TRAINING,
            priority_class=P2, pool="shared", gpus=refs("node-frac", 1),
            granted_at=utcnow() - timedelta(hours=1), attempt=1, checkpointable=True,
            share=GpuShare(milli=500, memory_mib=40960),
        )  # fmt: skip
        await event(preemption, "admission", T.ALLOCATION_GRANTED, share)
    await allocations_known(preemption, 3)

    # 0.85 on 4 GPUs: ceil(0.85 * 4 / 0.7) - 4 = 1 GPU, none idle.
    await send_snapshot(preemption, snapshot(0.85, 0.9, shared_gpus=9))

    [reserve] = await reserves(preemption, 1)
    assert (sorted(reserve.allocation_ids), reserve.free_gpus) == (["a-f1", "a-f2"], 0)
    requests = await evictions(preemption, 2)
    assert sorted((r.allocation_id, r.priority_class, r.share_milli) for r in requests) == [
        ("a-f1", P2, 500), ("a-f2", P2, 500)
    ]  # fmt: skip
    [expand] = await audits(preemption, "preempt.expand", 1)
    ranked = {c["allocation_id"]: c["reason"] for c in expand["details"]["candidates"]["ranked"]}
    assert "one of 2 tenants of GPU node-frac/0 evicted together" in ranked["a-f1"]
    assert expand["details"]["candidates"]["not_needed"]["allocation_ids"] == ["a-p1"]


async def test_an_aborted_eviction_is_replaced_by_another_victim_then_the_pool_shrinks_back(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p1", P1)
    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 2)
    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))
    [first] = await evictions(preemption, 1)
    [reserve] = await reserves(preemption, 1)

    aborted = EvictionAborted(
        saga_id="s1", request_id=first.request_id, allocation_id="a-p2", job_id=first.job_id,
        reason="no checkpoint before the deadline",
    )  # fmt: skip
    await event(preemption, "checkpoint", T.EVICTION_ABORTED, aborted)

    _, second = await evictions(preemption, 2)
    assert (second.allocation_id, second.decision_id) == ("a-p1", first.decision_id)
    _, again = await reserves(preemption, 2)
    assert (again.reservation_id, again.allocation_ids) == (reserve.reservation_id, ["a-p1"])

    # Admission lends a-p1's GPUs, pending until the eviction frees them.
    lent = refs("node-a-p1", 2)
    await event(
        preemption, "admission", T.GPUS_RESERVED,
        GpusReserved(reservation_id=reserve.reservation_id, gpus=lent, pending=lent),
    )  # fmt: skip
    completed = EvictionCompleted(
        saga_id="s2", request_id=second.request_id, allocation_id="a-p1", job_id=second.job_id,
        checkpoint=None,
    )  # fmt: skip
    await event(preemption, "checkpoint", T.EVICTION_COMPLETED, completed)
    await wait_for(preemption, "SELECT count(*) FROM {s}.decisions WHERE status = 'done'", 1)
    await wait_for(preemption, "SELECT count(*) FROM {s}.lent_gpus", 2)

    # Cold: 0.2 on 6 GPUs, shared 0.3 -> return floor((0.4 - 0.2) * 6) = 1 GPU.
    await send_snapshot(preemption, snapshot(0.2, 0.3, inference_gpus=6, shared_gpus=2))
    [returned] = await commands(preemption, "admission", T.RETURN_TO_SHARED, 1)
    back = returned.payload(ReturnToShared)
    assert (back.reservation_id, back.gpus) == (reserve.reservation_id, 1)
    [shrink] = await audits(preemption, "preempt.shrink", 1)
    assert shrink["entity"] == back.decision_id


async def test_p0_urgent_is_never_evicted_and_the_missing_gpus_are_a_shortfall(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p0", P0, gpus=4)
    await allocations_known(preemption, 1)

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))

    [shortfall] = await audits(preemption, "preempt.shortfall", 1)
    details = shortfall["details"]
    assert details["missing_gpus"] == 2
    assert details["victims"] == []
    assert await scalar(preemption, "SELECT count(*) FROM {s}.evictions") == 0
    assert await scalar(preemption, "SELECT count(*) FROM {s}.decisions") == 0


async def test_an_abort_with_no_other_candidate_raises_a_shortfall_and_ends_the_decision(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p2", P2)
    await grant(preemption, "a-p0", P0)
    await allocations_known(preemption, 2)
    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))
    [request] = await evictions(preemption, 1)

    aborted = EvictionAborted(
        saga_id="s1", request_id=request.request_id, allocation_id="a-p2", job_id=request.job_id,
        reason="deadline",
    )  # fmt: skip
    await event(preemption, "checkpoint", T.EVICTION_ABORTED, aborted)

    [shortfall] = await audits(preemption, "preempt.shortfall", 1)
    assert shortfall["entity"] == request.decision_id
    assert shortfall["details"]["missing_gpus"] == 2
    await wait_for(preemption, "SELECT status FROM {s}.decisions", "done")


async def test_idle_shared_gpus_are_lent_before_anything_is_evicted(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 1)

    # 8 shared GPUs, 2 allocated: the 2 needed come from the 6 idle ones.
    await send_snapshot(preemption, snapshot(0.95, 0.2, shared_gpus=8))

    [reserve] = await reserves(preemption, 1)
    assert (reserve.allocation_ids, reserve.free_gpus) == ([], 2)
    await wait_for(preemption, "SELECT status FROM {s}.decisions", "done")
    assert await scalar(preemption, "SELECT count(*) FROM {s}.evictions") == 0


async def test_the_victim_within_a_class_is_the_one_with_least_work_since_its_checkpoint(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-old", P2)
    await grant(preemption, "a-fresh", P2)
    await allocations_known(preemption, 2)
    await verified(preemption, "job-a-fresh")
    await wait_for(
        preemption,
        "SELECT count(*) FROM {s}.allocations WHERE last_checkpoint_at IS NOT NULL",
        1,
    )

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))

    [request] = await evictions(preemption, 1)
    assert request.allocation_id == "a-fresh"


async def test_only_a_verified_checkpoint_counts_for_lost_work_and_the_victim_choice(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-claimed", P2)
    await grant(preemption, "a-verified", P2)
    await allocations_known(preemption, 2)
    # A job's raw claim (which the checkpoint service may yet reject) saves nothing.
    claim = CheckpointConfirmed(
        request_id=None, checkpoint_id="c9", step=900, uri="file:///nowhere/c9", bytes=1,
        sha256="0" * 64, stage=StageName.PERSISTED,
    )  # fmt: skip
    raw = make_envelope(T.CHECKPOINT_CONFIRMED, claim, source="sdk", correlation_id="job-a-claimed")
    await publish(preemption, preemption.subjects.job_events("job-a-claimed"), raw)
    ten_minutes_ago = utcnow() - timedelta(minutes=10)
    await verified(preemption, "job-a-verified", confirmed_at=ten_minutes_ago)
    await wait_for(
        preemption,
        "SELECT count(*) FROM {s}.allocations WHERE last_checkpoint_at IS NOT NULL "
        "AND allocation_id = 'a-verified'",
        1,
    )

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))

    [request] = await evictions(preemption, 1)
    assert request.allocation_id == "a-verified"
    [expand] = await audits(preemption, "preempt.expand", 1)
    [chosen] = expand["details"]["candidates"]["ranked"]
    # 2 GPUs x the 10 minutes since the verified checkpoint (plus the test's own seconds).
    lost = float(chosen["reason"].split(", ")[1].split(" GPU-seconds since last checkpoint")[0])
    assert 1200 <= lost < 1300, chosen["reason"]
    claimed = "SELECT last_checkpoint_at FROM {s}.allocations WHERE allocation_id = 'a-claimed'"
    assert await scalar(preemption, claimed) is None


async def test_borrowed_capacity_is_reclaimed_before_guaranteed_capacity_of_its_class(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-guaranteed", P2)
    await grant(preemption, "a-borrowed", P2, borrowed=True)
    await allocations_known(preemption, 2)
    # The guaranteed job just checkpointed: it would lose less work, but it is in quota.
    await verified(preemption, "job-a-guaranteed")
    await wait_for(
        preemption,
        "SELECT count(*) FROM {s}.allocations WHERE last_checkpoint_at IS NOT NULL",
        1,
    )

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))

    [request] = await evictions(preemption, 1)
    assert request.allocation_id == "a-borrowed"
    [expand] = await audits(preemption, "preempt.expand", 1)
    [chosen] = expand["details"]["candidates"]["ranked"]
    assert "(borrowed)" in chosen["reason"]


async def test_on_equal_lost_work_the_victim_that_frees_a_whole_nvlink_island_goes(
    preemption: ServiceRuntime,
) -> None:
    # Two nodes of two 4-GPU NVLink islands each, as admission's inventory states them.
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    nodes = [
        InventoryNode(name=n, pool="shared", gpu_model="A100-80GB", gpus=8, gpu_groups=groups)
        for n in ("n1", "n2")
    ]
    await event(preemption, "admission", T.INVENTORY_LOADED, InventoryLoaded(nodes=nodes))
    await wait_for(preemption, "SELECT count(*) FROM {s}.gpu_islands", 16)
    granted_at = utcnow() - timedelta(hours=1)

    async def on(
        allocation_id: str, priority: PriorityClassName, node: str, gpus: list[int]
    ) -> None:
        granted = AllocationGranted(
            allocation_id=allocation_id, job_id=f"job-{allocation_id}", team="research",
            kind=JobKind.TRAINING, priority_class=priority, pool="shared",
            gpus=[GpuRef(node=node, index=i, model="A100-80GB") for i in gpus],
            granted_at=granted_at, attempt=1, checkpointable=True,
        )  # fmt: skip
        await event(preemption, "admission", T.ALLOCATION_GRANTED, granted)

    # "split" straddles both islands of n1; "z-island" holds all of n2's island 0. Same
    # class, size and lost work: only the islands tell them apart (the id order would
    # pick "split").
    await on("split", P2, "n1", [2, 3, 4, 5])
    await on("z-island", P2, "n2", [0, 1, 2, 3])
    for name, node, index in (("a", "n1", 0), ("b", "n1", 7), ("c", "n2", 5)):
        await on(name, P0, node, [index])
    await allocations_known(preemption, 5)

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=11))

    [request] = await evictions(preemption, 1)
    assert request.allocation_id == "z-island"
    [expand] = await audits(preemption, "preempt.expand", 1)
    [chosen] = expand["details"]["candidates"]["ranked"]
    assert "frees whole NVLink islands" in chosen["reason"]


async def test_the_same_snapshot_delivered_twice_makes_one_decision(
    preemption: ServiceRuntime,
) -> None:
    # All shared GPUs idle: each decision completes at once, so only the inbox and the
    # windows (a pool change restarts them) keep the copy from deciding again.
    hot = make_envelope(T.POOL_SNAPSHOT, snapshot(0.95, 0.1), source="ingest")
    subject = preemption.subjects.event("ingest", T.POOL_SNAPSHOT)
    await publish(preemption, subject, hot)
    await publish(preemption, subject, hot)
    [first] = await commands(preemption, "admission", T.RESERVE_FOR_INFERENCE, 1)
    marker = await send_snapshot(preemption, snapshot(0.95, 0.1))

    envelopes = await commands(preemption, "admission", T.RESERVE_FOR_INFERENCE, 2)
    assert [e.causation_id for e in envelopes] == [hot.id, marker.id]
    assert first.id == envelopes[0].id


async def test_the_windows_live_in_the_database_and_a_lapse_restarts_them(
    slow_windows: ServiceRuntime,
) -> None:
    rt = slow_windows
    await grant(rt, "a-p2", P2)
    await allocations_known(rt, 1)
    hot = snapshot(0.95, 0.9, shared_gpus=4)
    first = await send_snapshot(rt, hot)
    await applied(rt, first)
    since = await scalar(rt, "SELECT expand_since FROM {s}.controller")
    assert since == hot.time

    # Still hot on the next reading: the window keeps its start.
    again = await send_snapshot(rt, snapshot(0.9, 0.9, shared_gpus=4))
    await applied(rt, again)
    assert await scalar(rt, "SELECT expand_since FROM {s}.controller") == hot.time

    # A P99 above 80% of its SLO is a reason to expand on its own.
    slow = snapshot(0.5, 0.9, shared_gpus=4).model_copy(
        update={"services": [ServiceState(service="chat", p99_ms=90.0, queue_depth=0, requests=9)]}
    )
    slow_env = await send_snapshot(rt, slow)
    await applied(rt, slow_env)
    assert await scalar(rt, "SELECT expand_since FROM {s}.controller") == hot.time

    # One reading inside the band ends the window; nothing was decided meanwhile.
    calm = await send_snapshot(rt, snapshot(0.6, 0.9, shared_gpus=4))
    await applied(rt, calm)
    assert await scalar(rt, "SELECT expand_since FROM {s}.controller") is None
    assert await scalar(rt, "SELECT count(*) FROM {s}.decisions") == 0
    assert await scalar(rt, "SELECT count(*) FROM {s}.outbox") == 0


@pytest.mark.parametrize(
    ("service", "message_type", "subject_kind"),
    [
        ("admission", T.ALLOCATION_GRANTED, "event"),
        ("ingest", T.POOL_SNAPSHOT, "event"),
        ("checkpoint", T.EVICTION_ABORTED, "event"),
        ("checkpoint", T.EVICTION_COMPLETED, "event"),
        ("checkpoint", T.CHECKPOINT_VERIFIED, "event"),
    ],
)
async def test_a_malformed_message_on_each_consumed_subject_is_dead_lettered(
    preemption: ServiceRuntime, service: str, message_type: T, subject_kind: str
) -> None:
    s = preemption.subjects
    subject = s.job_events("j1") if subject_kind == "job" else s.event(service, message_type)
    raw = json.dumps(
        {"id": f"bad-{message_type}", "type": message_type, "source": service,
         "time": "2026-01-01T00:00:00Z", "data": {"unexpected": True}}
    ).encode()  # fmt: skip
    await preemption.js.publish(subject, raw)

    [dead] = await stream_messages(preemption.js, s.dead_letter("preemption"), 1)
    assert dead.data == raw
    assert dead.headers["Gpusched-Original-Subject"] == subject
    assert dead.headers["Gpusched-Reason"] == "malformed"

    # The service still works.
    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 1)


async def test_an_outcome_for_an_eviction_never_requested_is_rejected(
    preemption: ServiceRuntime,
) -> None:
    stray = EvictionCompleted(
        saga_id="s9", request_id="nobody-asked", allocation_id="a9", job_id="j9", checkpoint=None
    )
    await event(preemption, "checkpoint", T.EVICTION_COMPLETED, stray)

    [dead] = await stream_messages(preemption.js, preemption.subjects.dead_letter("preemption"), 1)
    assert dead.headers["Gpusched-Reason"] == "rejected"


# --- one bad input never stops the controller -----------------------------------------------
def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def stored_audits(rt: ServiceRuntime, action: str) -> list[dict[str, Any]]:
    stream = await rt.js.find_stream_name_by_subject(rt.subjects.audit(action))
    info = await rt.js.stream_info(stream, subjects_filter=rt.subjects.audit(action))
    count = sum((info.state.subjects or {}).values())
    if count == 0:
        return []
    msgs = await stream_messages(rt.js, rt.subjects.audit(action), count)
    return [Envelope.from_bytes(m.data).data for m in msgs]


async def send_raw_snapshot(rt: ServiceRuntime, snap: PoolSnapshot, **data: Any) -> Envelope:
    """A snapshot whose data the test overrides past what the model allows."""
    envelope = make_envelope(T.POOL_SNAPSHOT, snap, source="ingest")
    raw = json.loads(envelope.to_bytes())
    raw["data"].update(data)
    await rt.js.publish(rt.subjects.event("ingest", T.POOL_SNAPSHOT), json.dumps(raw).encode())
    return envelope


async def test_a_snapshot_with_an_unreadable_reading_is_dead_lettered_and_the_next_decided_on(
    preemption: ServiceRuntime,
) -> None:
    """The edge refuses a snapshot whose readings break the contract (a missing p99, one
    beyond any clock): it is dead-lettered whole and changes nothing; the controller
    decides on the next readable snapshot (ingest never publishes such a reading)."""
    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 1)
    bad_services = [
        {"service": "chat", "p99_ms": None, "queue_depth": 0, "requests": 5},
        {"service": "search", "p99_ms": 1e15, "queue_depth": 0, "requests": 5},
        {"service": "ok", "p99_ms": 20.0, "queue_depth": 0, "requests": 5},
    ]
    await send_raw_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4), services=bad_services)
    [dead] = await audits(preemption, "message.dead_lettered", 1)
    assert "p99_ms" in dead["reason"]
    assert await stored_audits(preemption, "preempt.expand") == []

    good = [{"service": "ok", "p99_ms": 20.0, "queue_depth": 0, "requests": 5}]
    await send_raw_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4), services=good)
    await reserves(preemption, 1)
    [expand] = await audits(preemption, "preempt.expand", 1)
    assert [s["service"] for s in expand["details"]["services"]] == ["ok"]


async def test_an_allocation_that_cannot_be_read_is_skipped_and_the_rest_are_still_chosen_from(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-bad", P2)
    await grant(preemption, "a-good", P1)
    await allocations_known(preemption, 2)
    # Stored data this version cannot read: a class it does not know.
    async with preemption.uow() as uow:
        await uow.execute(
            f"UPDATE {preemption.schema}.allocations SET priority_class = 'p9-unknown' "
            "WHERE allocation_id = 'a-bad'"
        )
        await uow.commit()

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))

    [request] = await evictions(preemption, 1)
    assert request.allocation_id == "a-good"
    [skipped] = await audits(preemption, "preempt.input_skipped", 1)
    assert skipped["entity"] == "a-bad"
    assert skipped["details"]["kind"] == "allocation"
    assert "p9-unknown" in skipped["reason"]


async def test_a_failing_decision_round_is_audited_once_per_error_and_counted_each_time(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 1)
    before = metric("gpusched_preemption_tick_failures_total", error="IntegrityError")
    # A fault no message caused: every decision the round makes is refused the same way.
    async with preemption.uow() as uow:
        await uow.execute(
            f"ALTER TABLE {preemption.schema}.decisions ADD CONSTRAINT refuse_all CHECK (false)"
        )
        await uow.commit()
    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))

    async def failed_rounds() -> bool:
        counted = metric("gpusched_preemption_tick_failures_total", error="IntegrityError")
        return counted - before >= 5

    await eventually(failed_rounds, within=20)  # rounds run every 0.1 s
    [record] = await stored_audits(preemption, "preempt.tick_failed")
    assert record["entity"] == "controller"
    assert record["details"]["error_type"] == "IntegrityError"
    assert "refuse_all" in record["details"]["error"]

    # The fault goes away: the very next round decides.
    async with preemption.uow() as uow:
        await uow.execute(f"ALTER TABLE {preemption.schema}.decisions DROP CONSTRAINT refuse_all")
        await uow.commit()
    await reserves(preemption, 1)
    assert len(await stored_audits(preemption, "preempt.tick_failed")) == 1


async def test_a_stored_reading_that_cannot_be_read_waits_for_the_next_snapshot(
    preemption: ServiceRuntime,
) -> None:
    await send_snapshot(preemption, snapshot(0.5, 0.5, shared_gpus=4))
    await wait_for(preemption, "SELECT count(*) FROM {s}.controller WHERE reading IS NOT NULL", 1)
    async with preemption.uow() as uow:
        await uow.execute(
            f"UPDATE {preemption.schema}.controller SET reading = "
            "jsonb_set(reading, '{pools}', '\"broken\"')"
        )
        await uow.commit()
    [skipped] = await audits(preemption, "preempt.input_skipped", 1)
    assert skipped["details"]["kind"] == "pool_reading"

    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 1)
    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))
    await reserves(preemption, 1)
    assert await stored_audits(preemption, "preempt.tick_failed") == []


async def test_a_snapshot_dated_far_in_the_future_is_refused_and_later_ones_still_count(
    preemption: ServiceRuntime,
) -> None:
    await grant(preemption, "a-p2", P2)
    await allocations_known(preemption, 1)
    future = snapshot(0.1, 0.1, shared_gpus=4).model_copy(
        update={"time": utcnow() + timedelta(days=365 * 100)}
    )
    await send_snapshot(preemption, future)
    [dead] = await stream_messages(preemption.js, preemption.subjects.dead_letter("preemption"), 1)
    assert dead.headers["Gpusched-Reason"] == "rejected"

    await send_snapshot(preemption, snapshot(0.95, 0.9, shared_gpus=4))
    await reserves(preemption, 1)
