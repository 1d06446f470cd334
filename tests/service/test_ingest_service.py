"""Ingest on the real NATS and PostgreSQL: GPU samples and ledger events in, pool
snapshots out."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timedelta

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import BaseModel
from tests.support.waiting import stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import (
    AllocationReleased,
    GpuReading,
    GpuRef,
    GpuSample,
    GpusReserved,
    GpusReturned,
    InferenceStats,
    InventoryLoaded,
    InventoryNode,
    PoolSnapshot,
    PoolState,
    T,
)
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest import app

INVENTORY = InventoryLoaded(
    nodes=[
        InventoryNode(name="inf-1", pool="inference", gpu_model="A100-80GB", gpus=2),
        InventoryNode(name="sh-1", pool="shared", gpu_model="A100-80GB", gpus=2),
    ]
)


@pytest.fixture
async def ingest(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    fast = settings.model_copy(
        update={"ingest": IngestSettings(window_s=30.0, snapshot_interval_s=0.1)}
    )
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, fast, migrations_dir(app.__file__))
    await runtime.start()
    await app.build(runtime)
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


async def publish(rt: ServiceRuntime, subject: str, message_type: str, data: BaseModel) -> None:
    await rt.js.publish(subject, make_envelope(message_type, data, source="test").to_bytes())


async def admission_event(rt: ServiceRuntime, message_type: T, data: BaseModel) -> None:
    await publish(rt, rt.subjects.event("admission", message_type), message_type, data)


async def gpu_sample(
    rt: ServiceRuntime, node: str, utils: dict[int, float], at: datetime | None = None
) -> None:
    sample = GpuSample(
        node=node,
        time=at or utcnow(),
        gpus=[
            GpuReading(index=i, util=u, mem_used_mib=1000, mem_total_mib=81920)
            for i, u in utils.items()
        ],
    )
    await publish(rt, rt.subjects.telemetry_gpu(node), T.GPU_SAMPLE, sample)


def pools(snapshot: PoolSnapshot) -> dict[str, PoolState]:
    return {pool.pool: pool for pool in snapshot.pools}


async def snapshot_where(
    rt: ServiceRuntime, matching: Callable[[PoolSnapshot], bool], within: float = 20.0
) -> PoolSnapshot:
    """The first snapshot on the bus that matches; fails with the last one seen."""
    sub = await rt.js.subscribe(
        rt.subjects.event("ingest", T.POOL_SNAPSHOT),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        manual_ack=False,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last: PoolSnapshot | None = None
    try:
        while (remaining := deadline - loop.time()) > 0:
            try:
                msg = await sub.next_msg(timeout=remaining)
            except NatsTimeout:
                break
            last = Envelope.from_bytes(msg.data).payload(PoolSnapshot)
            if matching(last):
                return last
    finally:
        await sub.unsubscribe()
    raise AssertionError(f"no matching snapshot in {within}s (last: {last!r})")


def sizes(inference: int, shared: int) -> Callable[[PoolSnapshot], bool]:
    def check(snapshot: PoolSnapshot) -> bool:
        by_pool = pools(snapshot)
        return by_pool["inference"].gpus == inference and by_pool["shared"].gpus == shared

    return check


async def test_a_snapshot_holds_each_pools_mean_utilization_over_the_window(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    now = utcnow()
    await gpu_sample(ingest, "inf-1", {0: 0.9, 1: 0.7}, now - timedelta(seconds=2))
    await gpu_sample(ingest, "inf-1", {0: 0.7, 1: 0.9}, now)
    # sh-1/1 reported only before the window: it is left out, not counted as idle.
    await gpu_sample(ingest, "sh-1", {1: 1.0}, now - timedelta(seconds=120))
    await gpu_sample(ingest, "sh-1", {0: 0.3}, now)
    stats = InferenceStats(
        service="chat", time=now, window_s=10, requests=500, queue_depth=7, p50_ms=20, p99_ms=180
    )
    await publish(ingest, ingest.subjects.telemetry_inference("chat"), T.INFERENCE_STATS, stats)

    snapshot = await snapshot_where(
        ingest,
        lambda s: (
            pools(s)["inference"].reporting_gpus == 2
            and pools(s)["shared"].reporting_gpus == 1
            and bool(s.services)
        ),
    )

    inference, shared = pools(snapshot)["inference"], pools(snapshot)["shared"]
    assert (inference.gpus, inference.util) == (2, pytest.approx(0.8))
    assert (shared.gpus, shared.util) == (2, pytest.approx(0.3))
    assert snapshot.window_s == 30.0
    [chat] = snapshot.services
    assert (chat.service, chat.p99_ms, chat.queue_depth, chat.requests) == ("chat", 180, 7, 500)


async def test_a_lent_gpu_serves_inference_once_training_has_released_it(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    await gpu_sample(ingest, "inf-1", {0: 0.9, 1: 0.9})
    await gpu_sample(ingest, "sh-1", {0: 0.3, 1: 0.5})
    await snapshot_where(ingest, lambda s: sum(p.reporting_gpus for p in s.pools) == 4)

    # sh-1/0 was free and is lent at once; sh-1/1 still runs training.
    sh0, sh1 = (
        GpuRef(node="sh-1", index=0, model="A100"),
        GpuRef(node="sh-1", index=1, model="A100"),
    )
    await admission_event(
        ingest, T.GPUS_RESERVED, GpusReserved(reservation_id="r1", gpus=[sh0, sh1], pending=[sh1])
    )
    lent = await snapshot_where(ingest, sizes(inference=3, shared=1))
    assert pools(lent)["inference"].util == pytest.approx((0.9 + 0.9 + 0.3) / 3)
    assert pools(lent)["shared"].util == pytest.approx(0.5)

    released = AllocationReleased(
        allocation_id="a1", job_id="j1", team="ml", gpus=[sh1], released_at=utcnow(), reason="x"
    )
    await admission_event(ingest, T.ALLOCATION_RELEASED, released)
    await snapshot_where(ingest, sizes(inference=4, shared=0))

    await admission_event(
        ingest, T.GPUS_RETURNED, GpusReturned(reservation_id="r1", gpus=[sh0, sh1])
    )
    await snapshot_where(ingest, sizes(inference=2, shared=2))


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        json.dumps(
            {"id": "bad-1", "type": "gpu.sample", "source": "agent", "time": "2026-01-01T00:00:00Z",
             "data": {"node": "sh-1", "time": "2026-01-01T00:00:00Z",
                      "gpus": [{"index": 0, "util": 1.5, "mem_used_mib": 1, "mem_total_mib": 2}]}}
        ).encode(),
    ],
    ids=["garbage", "util-out-of-range"],
)  # fmt: skip
async def test_malformed_telemetry_is_dead_lettered_and_ingest_keeps_snapshotting(
    ingest: ServiceRuntime, raw: bytes
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    subject = ingest.subjects.telemetry_gpu("sh-1")
    await ingest.js.publish(subject, raw)

    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.data == raw
    assert dead.headers["Gpusched-Original-Subject"] == subject
    assert dead.headers["Gpusched-Reason"] == "malformed"

    await gpu_sample(ingest, "sh-1", {0: 0.4})
    snapshot = await snapshot_where(ingest, lambda s: pools(s)["shared"].reporting_gpus == 1)
    assert pools(snapshot)["shared"].util == pytest.approx(0.4)


async def test_malformed_ledger_event_is_dead_lettered(ingest: ServiceRuntime) -> None:
    subject = ingest.subjects.event("admission", T.GPUS_RESERVED)
    bad = make_envelope(T.GPUS_RESERVED, InventoryLoaded(nodes=[]), source="admission")
    await ingest.js.publish(subject, bad.to_bytes())

    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.headers["Gpusched-Reason"] == "malformed"
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    await gpu_sample(ingest, "inf-1", {0: 0.6})
    await snapshot_where(ingest, sizes(inference=2, shared=2))


async def test_no_snapshot_is_emitted_while_nothing_reported(ingest: ServiceRuntime) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    # Samples of a node outside the inventory have no pool and do not count either.
    await gpu_sample(ingest, "stranger", {0: 0.9})

    with pytest.raises(AssertionError, match="no matching snapshot"):
        await snapshot_where(ingest, lambda s: True, within=1.5)

    await gpu_sample(ingest, "inf-1", {1: 0.5})
    first = await snapshot_where(ingest, lambda s: True)
    assert [(p.pool, p.gpus, p.reporting_gpus) for p in first.pools] == [
        ("inference", 2, 1),
        ("shared", 2, 0),
    ]


async def test_a_sample_for_a_gpu_the_node_does_not_have_is_dead_lettered_unstored(
    ingest: ServiceRuntime,
) -> None:
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    await gpu_sample(ingest, "inf-1", {0: 0.5})
    await snapshot_where(ingest, lambda s: pools(s)["inference"].reporting_gpus == 1)

    # inf-1 has two GPUs: index 5 is no GPU of it.
    await gpu_sample(ingest, "inf-1", {5: 0.9})

    [dead] = await stream_messages(ingest.js, ingest.subjects.dead_letter("ingest"), 1)
    assert dead.headers["Gpusched-Reason"] == "rejected"
    assert "no GPU index 5" in dead.headers["Gpusched-Error"]
    async with ingest.uow() as uow:
        rows = await uow.execute("SELECT count(*) AS n FROM ingest.samples WHERE idx = 5")
        assert rows.one().n == 0


async def test_bad_rows_stored_before_validation_neither_linger_nor_blind_the_snapshot(
    ingest: ServiceRuntime,
) -> None:
    """Rows the edge refuses today may be in a database written by an older version: a
    sample dated 9999 is pruned, and a service whose latest stats are not finite is set
    aside while the other services are still reported."""
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    now = utcnow()
    async with ingest.uow() as uow:
        await uow.execute(
            "INSERT INTO ingest.samples (node, idx, time, util, mem_used_mib, mem_total_mib) "
            "VALUES ('inf-1', 0, '9999-01-01T00:00:00Z', 0.99, 1, 2)"
        )
        await uow.execute(
            "INSERT INTO ingest.service_stats "
            "(service, time, window_s, requests, queue_depth, p50_ms, p99_ms) "
            "VALUES ('broken', :t, 10, 1, 0, 1, 'Infinity'), ('chat', :t, 10, 5, 1, 2, 30)",
            {"t": now},
        )
        await uow.commit()

    snapshot = await snapshot_where(ingest, lambda s: bool(s.services))

    assert [s.service for s in snapshot.services] == ["chat"]
    assert pools(snapshot)["inference"].reporting_gpus == 0
    async with ingest.uow() as uow:
        rows = await uow.execute("SELECT count(*) AS n FROM ingest.samples")
        assert rows.one().n == 0


async def test_a_sample_from_a_node_outside_the_inventory_is_retried_then_dead_lettered(
    settings: Settings,
) -> None:
    quick = settings.model_copy(
        update={
            "ingest": IngestSettings(window_s=30.0, snapshot_interval_s=0.1),
            "bus": settings.bus.model_copy(update={"max_deliver": 2, "nak_delay_s": 0.1}),
        }
    )
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, quick, migrations_dir(app.__file__))
    await runtime.start()
    await app.build(runtime)
    task = asyncio.create_task(runtime.run())
    try:
        await admission_event(runtime, T.INVENTORY_LOADED, INVENTORY)
        await gpu_sample(runtime, "stranger", {0: 0.9})

        [dead] = await stream_messages(runtime.js, runtime.subjects.dead_letter("ingest"), 1)
        assert dead.headers["Gpusched-Original-Subject"] == runtime.subjects.telemetry_gpu(
            "stranger"
        )
        assert "not in the inventory" in dead.headers["Gpusched-Error"]
        async with runtime.uow() as uow:
            rows = await uow.execute("SELECT count(*) AS n FROM ingest.samples")
            assert rows.one().n == 0
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 15)


async def test_scraped_dcgm_readings_take_the_bus_samples_path_into_the_snapshot(
    ingest: ServiceRuntime,
) -> None:
    """Exporter text parsed by ingest.dcgm and stored through accept_samples: a known
    node lands in the snapshot, an unknown one is refused, not stored."""
    from pathlib import Path

    from gpusched.ingest import dcgm, handlers

    text = (Path(__file__).parents[1] / "unit" / "data" / "dcgm-exporter.txt").read_text()
    series = dcgm.parse_exporter_text(text)
    known = dcgm.samples_from_series(series, utcnow(), node="sh-1").samples
    stranger = dcgm.samples_from_series(series, utcnow()).samples  # Hostname node-a
    await admission_event(ingest, T.INVENTORY_LOADED, INVENTORY)
    for _ in range(50):
        async with ingest.uow() as uow:
            if await handlers.store.node_gpus(uow, "sh-1") is not None:
                break
        await asyncio.sleep(0.1)
    async with ingest.uow() as uow:
        refused = await handlers.accept_samples(uow, known + stranger)
        await uow.commit()

    assert list(refused) == ["node-a"]
    snapshot = await snapshot_where(ingest, lambda s: pools(s)["shared"].reporting_gpus == 2)
    assert pools(snapshot)["shared"].util == pytest.approx((0.87 + 0.5) / 2)
