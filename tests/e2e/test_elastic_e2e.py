"""End to end, with the controller's windows on (short ones): a surge is absorbed only
after its window, the lent GPUs go back only after the quiet window and the min lend,
and the evicted training job resumes from its checkpoint."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import PriorityClassName, T
from gpusched.infra.settings import Settings
from tests.e2e.test_main_flow import FAST, Cluster, cluster_on, start_stack
from tests.support.identity import harness_options
from tests.support.waiting import eventually

WINDOWS = {
    "GPUSCHED_PREEMPTION__EXPAND_HOLD_S": "2",
    "GPUSCHED_PREEMPTION__SHRINK_HOLD_S": "3",
    "GPUSCHED_PREEMPTION__MIN_LEND_S": "6",
    "GPUSCHED_PREEMPTION__MIN_RUNTIME_S": "2",
    "GPUSCHED_PREEMPTION__DECIDE_INTERVAL_S": "0.25",
    "GPUSCHED_CHECKPOINT__GRACE_S": "30",
}


@pytest.fixture
def stack(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    inventory = Path(__file__).resolve().parents[2] / "deploy" / "inventory" / "demo.yaml"
    assert inventory.exists()
    stack_settings = settings.model_copy(update={"data_dir": tmp_path / "data"})
    yield from start_stack(stack_settings, tmp_path, {**FAST, **WINDOWS})


@pytest.fixture
async def cluster(stack: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack.settings):
        yield c


class Audit:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    async def on_message(self, msg: Msg) -> None:
        self.records.append(Envelope.from_bytes(msg.data).data)

    async def of(self, action: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["action"] == action]


async def running_attempt(cluster: Cluster, job_id: str, attempt: int) -> bool:
    reply = await cluster.api.get(job_id)
    return bool(reply.job and reply.job.state == "running" and reply.job.attempt >= attempt)


async def test_a_surge_held_for_its_window_is_absorbed_then_the_gpus_return_and_training_resumes(
    cluster: Cluster,
) -> None:
    assert cluster.settings.nats_url
    audit = Audit()
    nc = await nats.connect(cluster.settings.nats_url, **harness_options(cluster.settings))
    await nc.subscribe(f"{cluster.subjects.prefix}.audit.>", cb=audit.on_message)
    try:
        offline = await cluster.submit("offline", PriorityClassName.P2_OFFLINE, 8)
        normal = await cluster.submit("normal", PriorityClassName.P1_NORMAL, 16)
        urgent = await cluster.submit("urgent", PriorityClassName.P0_URGENT, 16)
        for job in (offline, normal, urgent):
            await eventually(lambda job=job: running_attempt(cluster, job, 1), within=30)

        await cluster.demand(22.0)  # ceil(22 / 0.7) - 24 = 8 GPUs: the p2 job exactly
        [expand] = await eventually(lambda: audit.of("preempt.expand"), within=60)
        windows = expand["details"]["windows"]
        assert windows["expand_held_s"] >= windows["expand_hold_s"] == 2
        assert expand["details"]["victims"]
        await eventually(
            lambda: _now(cluster.bus.of(T.EVICTION_COMPLETED, job_id=offline)), within=60
        )
        assert [e["job_id"] for e in cluster.bus.of(T.EVICT_WORKLOAD)] == [offline]

        await cluster.demand(2.0)
        [shrink] = await eventually(lambda: audit.of("preempt.shrink"), within=60)
        details = shrink["details"]
        assert details["windows"]["shrink_held_s"] >= 3
        # Only GPUs lent at least min_lend_s ago went back.
        lent_at = {r["reservation_id"]: r["lent_at"] for r in details["reservations"]}
        for reservation_id, _ in details["returns"]:
            lent = datetime.fromisoformat(lent_at[reservation_id])
            assert (datetime.fromisoformat(shrink["time"]) - lent).total_seconds() >= 6
        await eventually(lambda: _now(cluster.bus.of(T.GPUS_RETURNED)), within=60)
        await eventually(lambda: running_attempt(cluster, offline, 2), within=60)
        reply = await cluster.api.get(offline)
        assert reply.job and reply.job.resume_from
        # One expansion, one shrink: no evict/restore cycle while the load was steady.
        assert len(await audit.of("preempt.expand")) == 1
        assert not cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=urgent)
        assert not cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=normal)
        assert json.dumps(shrink)  # the record is plain JSON for `gpusched audit`
    finally:
        await nc.close()


async def _now(value: Any) -> Any:
    return value
