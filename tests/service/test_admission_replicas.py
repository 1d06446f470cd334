"""Inference services with replicas on the real NATS and PostgreSQL: min placed together
or not at all, more up to max as GPUs are lent to inference, scaling inside [min, max],
replicas placed again when their node fails, failed replicas replaced after a restart
back-off, and the idle scheduler tick topping services up to their target.

The cluster is one inference node (2 GPUs) and one shared node (4 GPUs).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import SMALL_CLUSTER, Admission, Client, with_inventory
from tests.support.waiting import eventually

from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA
from gpusched.contracts.messages import NodeVerb, StopReason, T
from gpusched.infra.settings import Settings

INVENTORY = SMALL_CLUSTER


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    configured = with_inventory(settings, tmp_path, INVENTORY)
    # A short first restart back-off, so a replacement comes within the test's patience.
    admission = configured.admission.model_copy(update={"replica_restart_first_s": 1.0})
    return configured.model_copy(update={"admission": admission})


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
        "min": 3, "max": 3, "target": 3, "placed": 0, "allocation_ids": [], "failures": 0,
        "restart_at": None,
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


async def replica_stopped(client: Client, job_id: str, number: int, reason: StopReason) -> None:
    await client.stopped({"allocation_id": f"{job_id}-r{number}", "job_id": job_id}, reason)


async def audited(client: Client, action: str, job_id: str) -> list[Any]:
    """The audits of ``action`` about ``job_id`` stored so far (none expected)."""
    found = await client.all_events(client.s.audit(action))
    return [e for e in found if e.data["entity"] == job_id]


async def why(client: Client, job_id: str) -> list[str]:
    reply = await client.request(client.s.api_jobs_why, json.dumps({"job_id": job_id}).encode())
    assert reply["ok"], reply
    reasons: list[str] = reply["reasons"]
    return reasons


async def test_a_failed_replica_is_replaced_with_the_same_shape_and_audited(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=2, high=2)
    await placed(client, job_id, 2)

    await replica_stopped(client, job_id, 1, StopReason.FAILED)
    [restarted] = await client.audits("replica.restarted", job_id, 1)
    details = restarted.data["details"]
    assert details["allocation_id"] == f"{job_id}-r1"
    assert details["failures"] == 1 and details["backoff_s"] == 1.0
    assert "a replacement is placed from" in restarted.data["reason"]

    job = await placed(client, job_id, 2)
    assert job["replicas"]["allocation_ids"] == [f"{job_id}-r2", f"{job_id}-r3"]
    assert job["replicas"]["target"] == 2  # a failure does not lower the target
    [replacement] = [g for g in await grants(client, job_id) if g["allocation_id"].endswith("-r3")]
    assert len(replacement["gpus"]) == 1 and replacement["pool"] == "inference"
    starts = await client.events(client.s.command("agent", T.START_WORKLOAD), 3)
    assert f"{job_id}-r3" in {s.data["allocation_id"] for s in starts}
    assert await audited(client, "job.completed", job_id) == []
    assert await audited(client, "job.failed", job_id) == []


async def test_a_crash_looping_replica_waits_twice_as_long_after_each_failure_in_a_row(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=1)
    await placed(client, job_id, 1)
    for failure, number in enumerate((1, 2, 3), start=1):
        await replica_stopped(client, job_id, number, StopReason.FAILED)
        audits = await client.audits("replica.restarted", job_id, failure)
        if failure < 3:
            job = await placed(client, job_id, 1)
            assert job["replicas"]["allocation_ids"] == [f"{job_id}-r{number + 1}"]
    assert [a.data["details"]["failures"] for a in audits] == [1, 2, 3]
    assert [a.data["details"]["backoff_s"] for a in audits] == [1.0, 2.0, 4.0]
    # The next attempt's time is stored with the service, not kept in memory.
    job = await client.job(job_id)
    assert job["replicas"]["failures"] == 3
    last = audits[-1].data["details"]["restart_at"]
    assert datetime.fromisoformat(job["replicas"]["restart_at"]) == datetime.fromisoformat(last)
    async with admission.rt.uow() as uow:
        stored = (
            await uow.execute(
                f"SELECT replica_restart_at FROM {SCHEMA}.jobs WHERE job_id = :j", {"j": job_id}
            )
        ).scalar_one()
    assert stored == datetime.fromisoformat(last)


async def test_a_completed_replica_lowers_the_target_and_the_last_one_ends_the_service(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=2)
    await placed(client, job_id, 2)

    await replica_stopped(client, job_id, 2, StopReason.COMPLETED)
    [stopped] = await client.audits("job.replica_stopped", job_id, 1)
    assert stopped.data["details"] == {"allocation_id": f"{job_id}-r2", "live": 1}
    job = await client.job(job_id)
    assert job["state"] == "running"
    assert job["replicas"]["target"] == 1 and job["replicas"]["placed"] == 1
    assert await audited(client, "replica.restarted", job_id) == []

    await replica_stopped(client, job_id, 1, StopReason.COMPLETED)
    job = await client.job_in(job_id, "completed")
    assert job["replicas"]["placed"] == 0
    assert len(await grants(client, job_id)) == 2  # no replacement for completed replicas


async def test_the_idle_tick_places_a_missing_replica_without_a_kick(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=2)
    await placed(client, job_id, 2)
    # The stop report kicks a pass while the back-off holds; when it ends nothing kicks,
    # so only an idle tick that looks at running services below target places r3.
    await replica_stopped(client, job_id, 2, StopReason.FAILED)
    await client.audits("replica.restarted", job_id, 1)
    job = await placed(client, job_id, 2)
    assert job["replicas"]["allocation_ids"] == [f"{job_id}-r1", f"{job_id}-r3"]


async def test_a_replacement_that_does_not_fit_leaves_the_service_running_short_and_says_why(
    admission: Admission, client: Client
) -> None:
    job_id = await service(client, low=1, high=2)
    await placed(client, job_id, 2)
    await replica_stopped(client, job_id, 2, StopReason.FAILED)
    await client.audits("replica.restarted", job_id, 1)
    # Another service takes the freed inference GPU while the back-off holds.
    other = await service(client, low=1, high=1)
    await placed(client, other, 1)

    async def short() -> list[str] | None:
        reasons = await why(client, job_id)
        return reasons if not any("back-off" in r for r in reasons) else None

    reasons = await eventually(short, within=20)
    assert reasons[0] == "running 1 of its target 2 replicas: 1 missing", reasons
    assert len(reasons) > 1  # and why the placement finds no GPU
    job = await client.job(job_id)
    assert job["state"] == "running"
    assert job["replicas"]["placed"] == 1 and job["replicas"]["target"] == 2
