"""Two preemption replicas as real processes: one leads and decides; SIGKILL it and the
other takes over within 5 s, with no decision made twice and none lost.

A decision here is an expansion onto idle shared GPUs (it completes at once), and a
pool change restarts the expand window, so a steady hot load makes one decision per
window: two decisions closer than the window would be a double decision, and a
window that ran across the kill must still end in a decision, by the survivor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import sys
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from tests.support.identity import harness_options, service_env
from tests.support.waiting import eventually

from gpusched.cli.stack import prepare
from gpusched.contracts.envelope import make_envelope, utcnow
from gpusched.contracts.messages import PoolSnapshot, PoolState, T
from gpusched.contracts.subjects import Subjects
from gpusched.infra.db import create_engine
from gpusched.infra.settings import Settings
from gpusched.infra.supervisor import ProcessSpec, Supervisor

HOLD_S = 2.0
# The snapshots' averaging window: after a decision, the next window opens with the
# first reading whose window began after it.
WINDOW_S = 1.0
REPLICAS = ("preemption-a", "preemption-b")
ENV = {
    "GPUSCHED_PREEMPTION__COOLDOWN_S": "0",
    "GPUSCHED_PREEMPTION__EXPAND_HOLD_S": str(HOLD_S),
    "GPUSCHED_PREEMPTION__DECIDE_INTERVAL_S": "0.2",
    "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
    "GPUSCHED_LOG_LEVEL": "WARNING",
}


def hot_snapshot() -> PoolSnapshot:
    return PoolSnapshot(
        time=utcnow(),
        window_s=WINDOW_S,
        pools=[
            PoolState(pool="inference", gpus=24, util=0.95, reporting_gpus=24),
            PoolState(pool="shared", gpus=40, util=0.0, reporting_gpus=40),
        ],
    )


@pytest.fixture
async def replicas(settings: Settings, tmp_path: Path) -> AsyncIterator[Supervisor]:
    assert settings.nats_url and settings.database_url
    await prepare(settings, ("preemption",))
    argv = [sys.executable, "-m", "gpusched.cli.main", "service", "preemption"]
    supervisor = Supervisor(
        [ProcessSpec(name, argv) for name in REPLICAS],
        env={
            "GPUSCHED_NATS_URL": settings.nats_url,
            "GPUSCHED_DATABASE_URL": settings.database_url,
            "GPUSCHED_SUBJECT_PREFIX": settings.subject_prefix,
            "GPUSCHED_DATA_DIR": str(settings.data_dir.resolve()),
            **service_env(settings),  # each replica connects as preemption itself
            **ENV,
        },
        log_dir=tmp_path / "logs",
    )
    await asyncio.to_thread(supervisor.start)
    try:
        yield supervisor
    finally:
        await asyncio.to_thread(supervisor.stop)


async def hot_load(settings: Settings) -> None:
    """A steady surge, as ingest would report it, four times a second."""
    assert settings.nats_url
    subject = Subjects(settings.subject_prefix).event("ingest", T.POOL_SNAPSHOT)
    nc = await nats.connect(settings.nats_url, **harness_options(settings))
    try:
        js = nc.jetstream()
        while True:
            env = make_envelope(T.POOL_SNAPSHOT, hot_snapshot(), source="ingest")
            await js.publish(subject, env.to_bytes())
            await asyncio.sleep(0.25)
    finally:
        await nc.close()


async def decisions(engine: AsyncEngine) -> list[tuple[datetime, str, datetime]]:
    """(time, deciding replica, start of the window it ended) of every decision."""
    async with engine.connect() as conn:
        rows = await conn.execute(
            text(
                "SELECT time, inputs->>'replica' AS replica, "
                "(inputs->'windows'->>'expand_since')::timestamptz AS since "
                "FROM preemption.decisions ORDER BY time"
            )
        )
        return [(r.time, r.replica, r.since) for r in rows]


async def test_a_killed_leader_is_replaced_within_five_seconds_without_a_double_or_lost_decision(
    settings: Settings, replicas: Supervisor
) -> None:
    assert settings.database_url
    engine = create_engine(settings.database_url, pool_size=1)
    load = asyncio.create_task(hot_load(settings))
    try:
        pids = {name: replicas.pid(name) for name in REPLICAS}

        async def made(n: int) -> list[Any]:
            found = await decisions(engine)
            return found if len(found) >= n else []

        # Two decisions by the leader: it holds the lease.
        before = await eventually(lambda: made(2), within=60)
        leader_id = before[0][1]
        [leader] = [n for n, pid in pids.items() if leader_id.endswith(f":{pid}")]
        [survivor] = [n for n in REPLICAS if n != leader]
        assert {replica for _, replica, _ in before} == {leader_id}

        # Kill it in the middle of the next window.
        await asyncio.sleep(WINDOW_S + HOLD_S / 2)
        replicas.kill(leader)
        killed_at = utcnow()
        done = len(await decisions(engine))
        after = await eventually(lambda: made(done + 1), within=15)
        first_after = next(d for d in after[done:] if d[0] > killed_at)
        took_over, by, window_start = first_after

        assert by.endswith(f":{pids[survivor]}")
        assert took_over - killed_at < timedelta(seconds=5)
        assert replicas.returncode(survivor) is None
        # Every window ended in exactly one decision: none closer than the window.
        times = [t for t, _, _ in after]
        assert all(b - a >= timedelta(seconds=HOLD_S) for a, b in itertools.pairwise(times))
        # The window the survivor ended began before the kill: kept in the database,
        # not restarted by the new leader (no lost decision).
        assert window_start < killed_at
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load
        await engine.dispose()
