"""Inference services with replicas on the real NATS and PostgreSQL: min placed together
or not at all, more up to max as GPUs are lent to inference, scaling inside [min, max],
and replicas placed again when their node fails.

The cluster is one inference node (2 GPUs) and one shared node (4 GPUs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import SMALL_CLUSTER, Admission, Client, with_inventory
from tests.support.waiting import eventually

from gpusched.admission.app import NAME as ADMISSION
from gpusched.contracts.messages import NodeVerb, T
from gpusched.infra.settings import Settings

INVENTORY = SMALL_CLUSTER


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, INVENTORY)


async def service(client: Client, low: int, high: int, gpus: int = 1) -> str:
    return await client.submitted(
        name="chat",
        kind="inference",
        priority_class="inference",
        gpus={"count": gpus},
        replicas={"min": low, "max": high},
    )


async def placed(client: Client, job_id: str, count: int) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        job = await client.job(job_id)
        replicas = job["replicas"]
        return job if job["state"] == "running" and replicas["placed"] == count else None

    return await eventually(check, within=20)


async def grants(client: Client, job_id: str) -> list[dict[str, Any]]:
    found = await client.all_events(client.s.event(ADMISSION, T.ALLOCATION_GRANTED))
    return [e.data for e in found if e.data["job_id"] == job_id]


async def scale(client: Client, job_id: str, replicas: int) -> dict[str, Any]:
    body = json.dumps({"job_id": job_id, "replicas": replicas}).encode()
    return await client.request(client.s.api_jobs_scale, body)


async def test_min_replicas_are_placed_together_or_not_at_all(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=3, high=3)
    # Two inference GPUs for three replicas: none is placed, not two.
    await client.audits("job.waiting", job_id, 1)
    job = await client.job(job_id)
    assert job["state"] == "queued"
    assert job["replicas"] == {
        "min": 3, "max": 3, "target": 3, "placed": 0, "allocation_ids": []
    }  # fmt: skip
    assert await grants(client, job_id) == []
    assert await admission.rows("allocations") == 0
    why = await client.request(client.s.api_jobs_why, json.dumps({"job_id": job_id}).encode())
    assert any("placed together or not at all (0 running)" in r for r in why["reasons"]), why

    await client.reserve("decision-1", [], free_gpus=1)
    job = await placed(client, job_id, 3)
    assert job["replicas"]["allocation_ids"] == [f"{job_id}-r1", f"{job_id}-r2", f"{job_id}-r3"]
    granted = await grants(client, job_id)
    assert sorted(g["allocation_id"] for g in granted) == job["replicas"]["allocation_ids"]
    assert all(len(g["gpus"]) == 1 and g["pool"] == "inference" for g in granted)
    starts = await client.events(client.s.command("agent", T.START_WORKLOAD), 3)
    assert {s.data["allocation_id"] for s in starts} == set(job["replicas"]["allocation_ids"])
    assert len(job["allocated"]) == 3


async def test_more_replicas_grow_up_to_max_as_gpus_are_lent_and_never_on_unlent_shared(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=4)
    job = await placed(client, job_id, 2)
    assert {gpu["node"] for gpu in job["allocated"]} == {"inf-00"}
    assert job["replicas"]["target"] == 4
    await client.audits("job.placed", job_id, 2)
    # Four idle shared GPUs, none lent: the service stays at two.
    assert (await client.job(job_id))["replicas"]["placed"] == 2

    await client.reserve("decision-1", [], free_gpus=1)
    job = await placed(client, job_id, 3)
    await client.reserve("decision-2", [], free_gpus=3)
    job = await placed(client, job_id, 4)
    on_shared = [gpu for gpu in job["allocated"] if gpu["node"] == "shared-00"]
    assert len(on_shared) == 2
    capacity = await admission.capacity()
    assert capacity["shared"].allocated == 2
    assert capacity["shared"].lent == 4  # the other two lent ones wait idle for inference


async def test_a_scale_outside_min_max_is_refused_and_a_scale_down_releases_the_newest(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=2)
    await placed(client, job_id, 2)
    training = await client.submitted(gpus={"count": 1})

    for replicas, code in ((3, "replicas_out_of_range"), (0, "replicas_out_of_range")):
        reply = await scale(client, job_id, replicas)
        assert reply["ok"] is False and reply["error"]["code"] == code, reply
        assert "[1, 2]" in reply["error"]["message"]
    assert (await scale(client, training, 1))["error"]["code"] == "not_a_service"
    assert (await scale(client, "job-000000000000", 1))["error"]["code"] == "not_found"
    assert (await client.request(client.s.api_jobs_scale, b"{}"))["error"]["code"] == "invalid"
    assert (await client.job(job_id))["replicas"]["target"] == 2

    down = await scale(client, job_id, 1)
    assert down["ok"], down
    assert down["replicas"]["target"] == 1
    assert down["replicas"]["allocation_ids"] == [f"{job_id}-r1"]
    released = await client.events(client.s.event(ADMISSION, T.ALLOCATION_RELEASED), 1)
    assert released[0].data["allocation_id"] == f"{job_id}-r2"
    assert released[0].data["reason"] == "scaled_down"
    [evict] = await client.events(client.s.command("agent", T.EVICT_WORKLOAD), 1)
    assert evict.data["allocation_id"] == f"{job_id}-r2"
    job = await client.job(job_id)
    assert job["replicas"]["placed"] == 1 and len(job["allocated"]) == 1
    [audit] = await client.audits("job.scaled", job_id, 1)
    assert audit.data["details"] == {"from": 2, "to": 1, "released": [f"{job_id}-r2"]}

    assert (await scale(client, job_id, 2))["ok"]
    job = await placed(client, job_id, 2)
    assert job["replicas"]["allocation_ids"] == [f"{job_id}-r1", f"{job_id}-r3"]


async def test_replicas_that_cannot_be_are_refused_and_nothing_is_stored(
    admission: Admission, client: Client
) -> None:
    cases = [
        ({"gpus": {"count": 1}, "replicas": {"min": 1, "max": 2}}, "invalid"),  # training
        (
            {"kind": "inference", "priority_class": "inference", "gpus": {"count": 1},
             "replicas": {"min": 3, "max": 2}},
            "invalid",
        ),
        (
            {"kind": "inference", "priority_class": "inference", "gpus": {"count": 1},
             "replicas": {"min": 0, "max": 2}},
            "invalid",
        ),
    ]  # fmt: skip
    for fields, code in cases:
        reply = await client.submit(**fields)
        assert reply["ok"] is False, fields
        assert reply["error"]["code"] == code
        assert reply["error"]["message"]
    assert await admission.rows("jobs") == 0


async def test_replicas_on_a_failed_node_are_placed_again_elsewhere(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=2)
    await placed(client, job_id, 2)
    await client.reserve("decision-1", [], free_gpus=2)
    body = json.dumps({"node": "inf-00", "operator": "ops", "reason": "XID 79"}).encode()
    assert (await client.request(client.s.api_nodes(NodeVerb.FAIL), body))["ok"]

    lost = await client.audits("job.replica_lost", job_id, 2)
    assert {a.data["details"]["allocation_id"] for a in lost} == {f"{job_id}-r1", f"{job_id}-r2"}

    async def elsewhere() -> dict[str, Any] | None:
        job = await client.job(job_id)
        nodes = {gpu["node"] for gpu in job["allocated"]}
        return job if job["replicas"]["placed"] == 2 and nodes == {"shared-00"} else None

    job = await eventually(elsewhere, within=20)
    assert job["replicas"]["allocation_ids"] == [f"{job_id}-r3", f"{job_id}-r4"]
