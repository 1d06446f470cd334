"""One job cannot stop the cluster, on the real NATS and PostgreSQL: a job whose stored
row does not parse or whose placement raises is parked (reason in get and why, audited)
and the jobs after it are still placed; the README's MIG service gets its layout and
replicas; `cancel` ends queued, running and parked jobs; a workload interrupted by the
cluster agent (its stop report, or its restart without it) is requeued.

The cluster is one inference node (2 GPUs) and one shared node (4 GPUs), except for the
MIG test, which runs on the demo inventory (deploy/inventory/demo.yaml).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import SMALL_CLUSTER, Admission, Client, with_inventory
from tests.support.waiting import eventually

from gpusched.admission import planning as planning_module
from gpusched.admission.app import SCHEMA
from gpusched.admission.parking import PARKED
from gpusched.contracts.messages import (
    AgentReady,
    MigConfigured,
    StopReason,
    T,
    WorkloadStarted,
)
from gpusched.infra.settings import Settings

DEMO_INVENTORY = Path(__file__).parents[2] / "deploy" / "inventory" / "demo.yaml"


@pytest.fixture
def admission_settings(
    settings: Settings, tmp_path: Path, request: pytest.FixtureRequest
) -> Settings:
    # The MIG test runs on the demo inventory, as the README's example does.
    demo = "_mig_" in request.node.name
    inventory = DEMO_INVENTORY.read_text() if demo else SMALL_CLUSTER
    return with_inventory(settings, tmp_path, inventory)


async def why(client: Client, job_id: str) -> list[str]:
    reply = await client.request(client.s.api_jobs_why, json.dumps({"job_id": job_id}).encode())
    assert reply["ok"], reply
    return list(reply["reasons"])


async def cancel(client: Client, job_id: str, reason: str = "") -> dict[str, Any]:
    body = {"job_id": job_id, "operator": "alice", "reason": reason}
    return await client.request(client.s.api_jobs_cancel, json.dumps(body).encode())


async def waiting(client: Client, job_id: str) -> None:
    """The job was looked at by a pass and left queued."""
    await client.audits("job.waiting", job_id, 1)
    assert (await client.job(job_id))["state"] == "queued"


async def poison(admission: Admission, job_id: str) -> None:
    """A value the spec model refuses, written straight into the stored row."""
    async with admission.rt.uow() as uow:
        await uow.execute(
            f"UPDATE {SCHEMA}.jobs SET spec = jsonb_set(spec, '{{workload,step_seconds}}', "
            "'null') WHERE job_id = :id",
            {"id": job_id},
        )
        await uow.commit()
    admission.service.scheduler.kick()


# --- parking -----------------------------------------------------------------------------


async def test_a_job_whose_stored_row_cannot_be_read_is_parked_and_the_queue_goes_on(
    admission: Admission, client: Client
) -> None:
    before = PARKED.labels("unreadable")._value.get()
    first = await client.submitted(gpus={"count": 2})
    await client.job_in(first, "running")
    # Two shared GPUs left: a gang of four waits, then its row goes bad.
    bad = await client.submitted(gpus={"count": 4})
    await waiting(client, bad)
    await poison(admission, bad)

    job = await client.job_in(bad, "parked")
    assert "stored row cannot be read" in job["parked_reason"]
    assert any(w.startswith("the stored job spec cannot be read") for w in job["warnings"])
    [parked] = await client.audits("job.parked", bad, 1)
    assert parked.data["details"]["where"] == "unreadable"
    reasons = await why(client, bad)
    assert reasons[0].startswith("parked:") and not any("fits now" in r for r in reasons)
    assert PARKED.labels("unreadable")._value.get() == before + 1

    good = await client.submitted(gpus={"count": 2})
    await client.job_in(good, "running")
    assert (await client.job(bad))["state"] == "parked"


async def test_a_job_whose_placement_raises_is_parked_and_a_job_after_it_is_placed(
    admission: Admission, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find = planning_module.find

    def find(*args: Any, **kwargs: Any) -> Any:
        job = args[2]
        if job.spec.name == "boom":
            raise ZeroDivisionError("a bug on this job's path")
        return real_find(*args, **kwargs)

    monkeypatch.setattr(planning_module, "find", find)
    bad = await client.submitted(name="boom", gpus={"count": 1})
    job = await client.job_in(bad, "parked")
    assert job["parked_reason"] == (
        "the scheduling pass failed on this job: ZeroDivisionError: a bug on this job's path"
    )
    good = await client.submitted(name="fine", gpus={"count": 1})
    await client.job_in(good, "running")
    reasons = await why(client, bad)
    assert reasons[0] == f"parked: {job['parked_reason']}"
    assert f"gpusched approve {bad}" in reasons[1] and f"gpusched cancel {bad}" in reasons[1]

    # Fixed: an operator's approve retries it, and it is placed.
    monkeypatch.setattr(planning_module, "find", real_find)
    body = {"job_id": bad, "operator": "alice", "reason": "fixed"}
    approved = await client.request(client.s.api_jobs_approve, json.dumps(body).encode())
    assert approved["ok"], approved
    await client.audits("job.unparked", bad, 1)
    placed = await client.job_in(bad, "running")
    assert placed["parked_reason"] is None


async def test_the_readme_mig_service_gets_its_layout_and_replicas_and_the_queue_goes_on(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(
        name="embed",
        team="search",
        kind="inference",
        priority_class="inference",
        gpus={"count": 1, "memory_gib": 15},
        replicas={"min": 2, "max": 6},
    )
    [configure] = await client.events(client.s.command("agent", T.MIG_CONFIGURE), 1)
    assert configure.data["profiles"] == ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"]
    # Waiting for the layout: never "it fits now".
    reasons = await why(client, job_id)
    assert not any("fits now" in r for r in reasons), reasons
    # A training job submitted after it is placed: the pass is not stuck on the service.
    training = await client.submitted(name="train", gpus={"count": 2})
    await client.job_in(training, "running")

    await client.publish(
        client.s.event("agent", T.MIG_CONFIGURED),
        T.MIG_CONFIGURED,
        MigConfigured(
            change_id=configure.data["change_id"],
            node=configure.data["node"],
            gpu=configure.data["gpu"],
            profiles=configure.data["profiles"],
            applied_at=datetime.now(UTC),
        ),
    )

    async def three_replicas() -> dict[str, Any] | None:
        job = await client.job(job_id)
        return job if job["replicas"]["placed"] >= 3 else None

    job = await eventually(three_replicas, within=20)
    assert job["state"] == "running"
    assert {share["mig_profile"] for share in [job["share"]] if share} <= {"2g.20gb"}
    assert await client.all_events(client.s.audit("job.parked")) == []


# --- cancel ------------------------------------------------------------------------------


async def test_a_queued_job_is_cancelled_at_once_and_never_placed(
    admission: Admission, client: Client
) -> None:
    running = await client.submitted(gpus={"count": 4})
    await client.job_in(running, "running")
    queued = await client.submitted(gpus={"count": 2})
    await waiting(client, queued)

    reply = await cancel(client, queued, "wrong data set")
    assert reply == {"ok": True, "job_id": queued, "state": "cancelled", "error": None}
    [audit] = await client.audits("job.cancelled", queued, 1)
    assert audit.data["reason"] == "cancelled by alice: wrong data set"
    assert audit.data["details"]["operator"] == "alice"

    await client.stopped(await client.job(running), StopReason.COMPLETED)
    await client.job_in(running, "completed")
    assert (await client.job(queued))["state"] == "cancelled"
    again = await cancel(client, queued)
    assert again["ok"] is False and again["error"]["code"] == "conflict"
    unknown = await cancel(client, "job-000000000000")
    assert unknown["ok"] is False and unknown["error"]["code"] == "not_found"
    hostile = await cancel(client, "job-\u202e0000")
    assert hostile["ok"] is False
    assert (hostile["error"]["code"], hostile["error"]["field"]) == ("invalid", "job_id")


async def test_a_running_job_is_evicted_by_force_and_cancelled_when_its_workload_stops(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(gpus={"count": 4})
    job = await client.job_in(job_id, "running")

    reply = await cancel(client, job_id, "runaway")
    assert reply["ok"] and reply["state"] == "cancelling"
    [evict] = await client.events(client.s.command("agent", T.EVICT_WORKLOAD), 1)
    assert evict.data == {
        "allocation_id": job["allocation_id"], "job_id": job_id,
        "saga_id": f"cancel-{job_id}", "forced": True,
    }  # fmt: skip
    assert (await client.job(job_id))["state"] == "cancelling"

    # The agent stops it and says so.
    await client.stopped(job, StopReason.EVICTED, saga_id=f"cancel-{job_id}")
    await client.job_in(job_id, "cancelled")
    [audit] = await client.audits("job.cancelled", job_id, 1)
    assert audit.data["reason"] == "cancelled by alice: runaway"
    capacity = await admission.capacity()
    assert capacity[next(p for p in capacity if p == "shared")].allocated == 0


async def test_a_parked_job_can_be_cancelled(admission: Admission, client: Client) -> None:
    first = await client.submitted(gpus={"count": 2})
    await client.job_in(first, "running")
    bad = await client.submitted(gpus={"count": 4})
    await waiting(client, bad)
    await poison(admission, bad)
    await client.job_in(bad, "parked")

    reply = await cancel(client, bad, "bad row")
    assert reply["ok"] and reply["state"] == "cancelled"
    await client.audits("job.cancelled", bad, 1)
    assert (await client.job(bad))["state"] == "cancelled"


# --- interrupted workloads ---------------------------------------------------------------


async def test_an_interrupted_workload_is_requeued_and_placed_again_as_its_next_attempt(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(gpus={"count": 2})
    job = await client.job_in(job_id, "running")
    assert job["attempt"] == 1

    await client.stopped(job, StopReason.INTERRUPTED)
    [requeued] = await client.audits("job.requeued", job_id, 1)
    assert "interrupted" in requeued.data["reason"]

    async def second_attempt() -> dict[str, Any] | None:
        again = await client.job(job_id)
        return again if again["state"] == "running" and again["attempt"] == 2 else None

    again = await eventually(second_attempt, within=20)
    assert again["allocation_id"] != job["allocation_id"]


async def test_an_agent_restart_interrupts_only_the_started_workloads_it_no_longer_runs(
    admission: Admission, client: Client
) -> None:
    started = await client.submitted(gpus={"count": 2})
    one = await client.job_in(started, "running")
    unstarted = await client.submitted(gpus={"count": 2})
    two = await client.job_in(unstarted, "running")
    await client.publish(
        client.s.event("agent", T.WORKLOAD_STARTED),
        T.WORKLOAD_STARTED,
        WorkloadStarted(
            allocation_id=one["allocation_id"],
            job_id=started,
            node="shared-00",
            started_at=datetime.now(UTC),
        ),
    )

    async def recorded() -> bool:
        async with admission.rt.uow() as uow:
            result = await uow.execute(
                f"SELECT started_at FROM {SCHEMA}.allocations WHERE allocation_id = :id",
                {"id": one["allocation_id"]},
            )
            return result.scalar_one() is not None

    await eventually(recorded, within=20)
    await client.publish(
        client.s.event("agent", T.AGENT_READY),
        T.AGENT_READY,
        AgentReady(agent_id="agent-1", nodes=["shared-00"], running=[], time=datetime.now(UTC)),
    )
    [ready] = await client.audits("agent.ready", "agent-1", 1)
    assert ready.data["details"]["interrupted"] == [one["allocation_id"]]
    await client.audits("job.requeued", started, 1)

    async def second_attempt() -> dict[str, Any] | None:
        again = await client.job(started)
        return again if again["state"] == "running" and again["attempt"] == 2 else None

    await eventually(second_attempt, within=20)
    # Its start command is still in the stream: the agent starts it, nothing to undo.
    still = await client.job(unstarted)
    assert (still["state"], still["allocation_id"]) == ("running", two["allocation_id"])


async def test_cancelling_a_service_stops_every_replica_and_ends_when_the_last_stops(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(
        name="chat", kind="inference", priority_class="inference", gpus={"count": 1},
        replicas={"min": 2, "max": 2},
    )  # fmt: skip

    async def both() -> dict[str, Any] | None:
        job = await client.job(job_id)
        return job if job["replicas"]["placed"] == 2 else None

    job = await eventually(both, within=20)
    reply = await cancel(client, job_id)
    assert reply["ok"] and reply["state"] == "cancelling"
    evicts = await client.events(client.s.command("agent", T.EVICT_WORKLOAD), 2)
    replicas = job["replicas"]["allocation_ids"]
    assert sorted(e.data["allocation_id"] for e in evicts) == sorted(replicas)
    assert {(e.data["saga_id"], e.data["forced"]) for e in evicts} == {(f"cancel-{job_id}", True)}

    first, second = replicas
    await client.stopped({"job_id": job_id, "allocation_id": first}, StopReason.EVICTED)
    await client.audits("allocation.released", job_id, 1)
    assert (await client.job(job_id))["state"] == "cancelling"
    await client.stopped({"job_id": job_id, "allocation_id": second}, StopReason.EVICTED)
    await client.job_in(job_id, "cancelled")
    # No replica is placed again for a cancelled service.
    assert (await client.job(job_id))["replicas"]["placed"] == 0
    assert len(await client.all_events(client.s.command("agent", T.START_WORKLOAD))) == 2


async def test_a_stopped_workload_whose_job_cannot_be_read_frees_its_gpus_and_parks_the_job(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(gpus={"count": 4})
    job = await client.job_in(job_id, "running")
    await poison(admission, job_id)

    await client.stopped(job, StopReason.COMPLETED)
    parked = await client.job_in(job_id, "parked")
    assert "stored row cannot be read" in parked["parked_reason"]
    [audit] = await client.audits("job.parked", job_id, 1)
    assert audit.data["details"]["where"] == "settle"
    # Its GPUs are free again: a job after it gets all four.
    good = await client.submitted(gpus={"count": 4})
    await client.job_in(good, "running")


async def test_a_running_service_whose_top_up_raises_keeps_its_replicas_and_is_paused(
    admission: Admission, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    job_id = await client.submitted(
        name="chat", kind="inference", priority_class="inference", gpus={"count": 1},
        replicas={"min": 1, "max": 3},
    )  # fmt: skip

    async def two() -> dict[str, Any] | None:
        job = await client.job(job_id)
        return job if job["state"] == "running" and job["replicas"]["placed"] == 2 else None

    await eventually(two, within=20)
    real_find = planning_module.find

    def find(*args: Any, **kwargs: Any) -> Any:
        if args[2].job_id == job_id:
            raise KeyError("a bug in the top-up")
        return real_find(*args, **kwargs)

    monkeypatch.setattr(planning_module, "find", find)
    training = await client.submitted(gpus={"count": 2})
    await client.job_in(training, "running")
    [audit] = await client.audits("replica.topup_failed", job_id, 1)
    assert "KeyError" in audit.data["reason"]
    job = await client.job(job_id)
    assert (job["state"], job["replicas"]["placed"]) == ("running", 2)
    assert job["replicas"]["restart_at"] is not None
