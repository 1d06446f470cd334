"""The admission service on the real NATS and PostgreSQL: the jobs API, placement, the
ledger commands of the preemption service, and workload/eviction results.

The cluster is one inference node (2 GPUs) and one shared node (4 GPUs), all A100-80GB.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import (
    SMALL_CLUSTER,
    Admission,
    Client,
    start_admission,
    with_inventory,
)
from tests.support.waiting import eventually, stream_messages

from gpusched.admission import app as admission_app
from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA, InventoryUnavailable, assemble
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.messages import (
    EvictionAborted,
    ReserveForInference,
    StopReason,
    T,
)
from gpusched.domain.inventory import Pool
from gpusched.domain.ledger import PoolCapacity
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

INVENTORY = SMALL_CLUSTER


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, INVENTORY)


def shared(capacity: dict[Pool, PoolCapacity]) -> tuple[int, int, int]:
    c = capacity[Pool.SHARED]
    return c.allocated, c.reserved, c.free


async def evict(client: Client, job: dict[str, Any], order: str, saga_id: str = "saga-1") -> None:
    """What the saga and the agent report when `job` is evicted, in either order."""
    if order == "stopped-first":
        await client.stopped(job, StopReason.EVICTED, saga_id)
        await client.job_in(job["job_id"], "preempted")
        await client.eviction_completed(job, saga_id)
    else:
        await client.eviction_completed(job, saga_id)
        await client.audits("eviction.recorded", job["job_id"], 1)
        assert (await client.job(job["job_id"]))["state"] == "running"
        await client.stopped(job, StopReason.EVICTED, saga_id)


# --- the jobs API and placement ---------------------------------------------------------


async def test_the_inventory_is_loaded_and_announced_on_first_start(
    admission: Admission, client: Client
) -> None:
    [loaded] = await client.events(client.s.event(ADMISSION, T.INVENTORY_LOADED), 1)
    assert loaded.data["nodes"] == [
        {"name": "inf-00", "pool": "inference", "gpu_model": "A100-80GB", "gpus": 2,
         "gpu_groups": []},
        {"name": "shared-00", "pool": "shared", "gpu_model": "A100-80GB", "gpus": 4,
         "gpu_groups": []},
    ]  # fmt: skip
    assert shared(await admission.capacity()) == (0, 0, 4)


async def test_a_submitted_job_is_placed_and_its_workload_started(
    admission: Admission, client: Client
) -> None:
    reply = await client.submit(name="resnet", gpus={"count": 2, "model": "A100-80GB"})
    assert reply["ok"] is True
    job_id = reply["job_id"]
    assert job_id.startswith("job-") and len(job_id) == len("job-") + 12

    [granted] = await client.events(client.s.event(ADMISSION, T.ALLOCATION_GRANTED), 1)
    [start] = await client.events(client.s.command("agent", T.START_WORKLOAD), 1)
    gpus = [{"node": "shared-00", "index": i, "model": "A100-80GB"} for i in (0, 1)]
    assert granted.data["job_id"] == job_id
    assert granted.data["gpus"] == gpus
    assert granted.data["pool"] == "shared"
    assert granted.data["attempt"] == 1
    assert granted.data["resume_from"] is None
    assert granted.data["cpu_cores"] == "32.000"  # half of the node: 2 of its 4 GPUs
    assert start.data["allocation_id"] == granted.data["allocation_id"]
    assert start.data["gpus"] == gpus
    assert start.data["attempt"] == 1

    job = await client.job_in(job_id, "running")
    assert job["allocated"] == gpus
    assert job["allocation_id"] == granted.data["allocation_id"]
    assert job["attempt"] == 1
    [placed] = await client.audits("job.placed", job_id, 1)
    assert placed.data["details"]["nodes"] == ["shared-00"]
    assert placed.data["details"]["spans_nodes"] is False


async def test_an_inference_job_is_placed_in_the_inference_pool(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(
        name="llm-serving", kind="inference", priority_class="inference", gpus={"count": 2}
    )
    job = await client.job_in(job_id, "running")
    assert {gpu["node"] for gpu in job["allocated"]} == {"inf-00"}


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "invalid"),
        (b'{"name": "x", "team": "vision"}', "invalid"),
        (b'{"name": "x", "team": "vision team", "gpus": {"count": 1}}', "invalid"),
        (b'{"name": "x", "team": "vision", "gpus": {"count": 1}, "priority_class": "inference"}',
         "invalid"),
        (b'{"name": "x", "team": "vision", "gpus": {"count": 1, "model": "H100-80GB"}}',
         "unknown_gpu_model"),
        (b'{"name": "x", "team": "vision", "gpus": {"count": 5}}', "unsatisfiable"),
        (b'{"name": "x", "team": "vision", "gpus": {"count": 1, "memory_gib": 100}}',
         "unsatisfiable"),
        (b'{"name": "x", "team": "vision", "gpus": {"count": 2, "milli": 500}}', "invalid"),
    ],
    ids=["bad-json", "no-gpus", "bad-team", "class-of-other-kind", "unknown-model",
         "more-gpus-than-any-pool", "more-memory-than-any-gpu", "fractional"],
)  # fmt: skip
async def test_a_bad_submission_is_refused_with_a_code_and_stores_nothing(
    admission: Admission, client: Client, body: bytes, code: str
) -> None:
    reply = await client.request(client.s.api_jobs_submit, body)

    assert reply["ok"] is False
    assert reply["error"]["code"] == code
    assert reply["error"]["message"]
    assert await admission.rows("jobs") == 0
    assert await admission.rows("allocations") == 0


async def test_a_job_of_the_whole_shared_pool_and_whole_gpus_is_accepted(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(gpus={"count": 4, "milli": 1000})
    assert (await client.job_in(job_id, "running"))["attempt"] == 1


async def test_the_same_idempotency_key_returns_the_same_job(
    admission: Admission, client: Client
) -> None:
    first = await client.submitted(idempotency_key="nightly-42")
    again = await client.submitted(idempotency_key="nightly-42")
    other_team = await client.submitted(idempotency_key="nightly-42", team="speech")

    assert again == first
    assert other_team != first
    assert await admission.rows("jobs") == 2


async def test_getting_an_unknown_job_is_not_found(admission: Admission, client: Client) -> None:
    reply = await client.request(client.s.api_jobs_get, b'{"job_id": "job-000000000000"}')
    assert reply["ok"] is False
    assert reply["error"]["code"] == "not_found"


async def test_a_job_that_does_not_fit_waits_queued_and_is_placed_when_another_is_released(
    admission: Admission, client: Client
) -> None:
    big = await client.job_in(await client.submitted(name="big", gpus={"count": 4}), "running")
    small_id = await client.submitted(name="small", gpus={"count": 2})
    [waiting] = await client.audits("job.waiting", small_id, 1)
    assert "free now: shared 0" in waiting.data["reason"]
    assert (await client.job(small_id))["state"] == "queued"

    await client.stopped(big, StopReason.COMPLETED)

    small = await client.job_in(small_id, "running")
    assert (await client.job(big["job_id"]))["state"] == "completed"
    [released] = await client.events(client.s.event(ADMISSION, T.ALLOCATION_RELEASED), 1)
    assert released.data["allocation_id"] == big["allocation_id"]
    assert released.data["reason"] == "completed"
    assert len(released.data["gpus"]) == 4
    assert small["allocated"][0]["node"] == "shared-00"
    # The wait was audited once, not on every scheduling pass.
    assert len(await client.audits("job.waiting", small_id, 1)) == 1


# --- lending to inference and giving back ----------------------------------------------


@pytest.mark.parametrize("order", ["stopped-first", "outcome-first"])
async def test_gpus_reserved_for_inference_stay_reserved_and_the_evicted_job_is_requeued(
    admission: Admission, client: Client, order: str
) -> None:
    victim = await client.job_in(await client.submitted(name="victim", gpus={"count": 4}),
                                 "running")  # fmt: skip
    other_id = await client.submitted(name="other", gpus={"count": 2}, priority_class="p2-offline")
    await client.audits("job.waiting", other_id, 1)

    await client.reserve("decision-1", [victim["allocation_id"]])
    [reserved] = await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)
    assert len(reserved.data["gpus"]) == 4
    assert reserved.data["pending"] == reserved.data["gpus"]

    await evict(client, victim, order)

    requeued = await client.job_in(victim["job_id"], "queued")
    assert requeued["resume_from"]["checkpoint_id"] == "ckpt-7"
    assert requeued["latest_checkpoint"]["checkpoint_id"] == "ckpt-7"
    assert requeued["allocated"] == []
    [released] = await client.events(client.s.event(ADMISSION, T.ALLOCATION_RELEASED), 1)
    assert released.data["reason"] == "evicted"
    # A pass after the requeue looked at both jobs: neither got the lent GPUs.
    await client.audits("job.waiting", victim["job_id"], 1)
    assert (await client.job(other_id))["state"] == "queued"
    assert shared(await admission.capacity()) == (0, 4, 0)


async def test_a_victim_whose_eviction_is_aborted_keeps_its_gpus_and_they_return_to_training(
    admission: Admission, client: Client
) -> None:
    victim = await client.job_in(await client.submitted(name="victim", gpus={"count": 4}),
                                 "running")  # fmt: skip
    await client.reserve("decision-1", [victim["allocation_id"]])
    await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)

    await client.publish(
        client.s.event("checkpoint", T.EVICTION_ABORTED),
        T.EVICTION_ABORTED,
        EvictionAborted(
            saga_id="saga-1", request_id="req-1", allocation_id=victim["allocation_id"],
            job_id=victim["job_id"], reason="deadline_aborted",
        ),
    )  # fmt: skip

    [returned] = await client.events(client.s.event(ADMISSION, T.GPUS_RETURNED), 1)
    assert len(returned.data["gpus"]) == 4
    assert (await client.job(victim["job_id"]))["state"] == "running"
    # When the job ends on its own, its GPUs are free for training, not lent.
    await client.stopped(victim, StopReason.COMPLETED)
    await client.job_in(victim["job_id"], "completed")
    assert shared(await admission.capacity())[1] == 0


async def test_gpus_returned_to_shared_resume_the_preempted_job_from_its_checkpoint(
    admission: Admission, client: Client
) -> None:
    victim = await client.job_in(await client.submitted(name="victim", gpus={"count": 4}),
                                 "running")  # fmt: skip
    await client.reserve("decision-1", [victim["allocation_id"]])
    await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)
    await evict(client, victim, "stopped-first")
    await client.job_in(victim["job_id"], "queued")

    await client.return_gpus("decision-2", 4)

    [returned] = await client.events(client.s.event(ADMISSION, T.GPUS_RETURNED), 1)
    assert len(returned.data["gpus"]) == 4
    resumed = await client.job_in(victim["job_id"], "running")
    assert resumed["attempt"] == 2
    assert resumed["allocation_id"] != victim["allocation_id"]
    _, start = await client.events(client.s.command("agent", T.START_WORKLOAD), 2)
    assert start.data["attempt"] == 2
    assert start.data["resume_from"]["checkpoint_id"] == "ckpt-7"
    _, granted = await client.events(client.s.event(ADMISSION, T.ALLOCATION_GRANTED), 2)
    assert granted.data["resume_from"]["checkpoint_id"] == "ckpt-7"
    assert granted.data["attempt"] == 2


async def test_reserving_lends_idle_shared_gpus_and_reports_what_it_could_not(
    admission: Admission, client: Client
) -> None:
    running = await client.job_in(await client.submitted(gpus={"count": 1}), "running")

    await client.reserve("decision-1", ["alloc-unknown"], free_gpus=5)

    [reserved] = await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)
    assert len(reserved.data["gpus"]) == 3  # every idle shared GPU, not the running one
    assert reserved.data["pending"] == []
    [audit] = await client.audits("gpus.reserved", "res-1", 1)
    assert audit.data["details"]["unknown_allocations"] == ["alloc-unknown"]
    assert audit.data["details"]["free_given"] == 3
    assert shared(await admission.capacity()) == (1, 3, 0)
    assert (await client.job(running["job_id"]))["state"] == "running"


# --- durability and delivery -------------------------------------------------------------


async def test_a_restarted_service_rebuilds_the_same_ledger_from_the_database(
    admission_settings: Settings, client: Client
) -> None:
    first = await start_admission(admission_settings)
    try:
        running = await client.job_in(await client.submitted(gpus={"count": 2}), "running")
        await client.reserve("decision-1", [], free_gpus=1)
        await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)
        before = await first.capacity()
        assert shared(before) == (2, 1, 1)
    finally:
        await first.stop()

    second = await start_admission(admission_settings)
    try:
        assert await second.capacity() == before
        # The rebuilt ledger still holds the running job's GPUs and the lent one.
        waiting = await client.submitted(name="too-big-now", gpus={"count": 2})
        await client.audits("job.waiting", waiting, 1)
        fits = await client.job_in(await client.submitted(gpus={"count": 1}), "running")
        assert fits["allocated"][0] not in running["allocated"]
        assert len(await client.all_events(client.s.event(ADMISSION, T.INVENTORY_LOADED))) == 1
    finally:
        await second.stop()


async def test_two_replicas_share_one_ledger_and_never_give_a_gpu_twice(
    admission_settings: Settings, client: Client
) -> None:
    replicas = [await start_admission(admission_settings) for _ in range(2)]
    try:
        job_ids = [await client.submitted(name=f"j{i}", gpus={"count": 1}) for i in range(6)]

        async def states() -> dict[str, list[dict[str, Any]]]:
            jobs = [await client.job(job_id) for job_id in job_ids]
            return {
                state: [job for job in jobs if job["state"] == state]
                for state in ("running", "queued", "completed")
            }

        async def split(running: int, queued: int) -> dict[str, list[dict[str, Any]]] | None:
            now = await states()
            return now if (len(now["running"]), len(now["queued"])) == (running, queued) else None

        first = await eventually(lambda: split(4, 2), within=20)
        # Releases land on either replica (one durable consumer); placements on the leader.
        for job in first["running"][:2]:
            await client.stopped(job, StopReason.COMPLETED)
        second = await eventually(lambda: split(4, 0), within=20)

        held = [(g["node"], g["index"]) for job in second["running"] for g in job["allocated"]]
        assert len(held) == len(set(held)) == 4
        assert [shared(await r.capacity()) for r in replicas] == [(4, 0, 0), (4, 0, 0)]
    finally:
        for replica in replicas:
            await replica.stop()


def _malformed(message_type: str) -> bytes:
    return json.dumps(
        {"id": f"bad-{message_type}", "type": message_type, "source": "test",
         "time": "2026-01-01T00:00:00Z", "data": {"allocation_id": 7}}
    ).encode()  # fmt: skip


@pytest.mark.parametrize(
    ("service", "kind", "message_type"),
    [
        ("admission", "command", T.RESERVE_FOR_INFERENCE),
        ("admission", "command", T.RETURN_TO_SHARED),
        ("agent", "event", T.WORKLOAD_STOPPED),
        ("checkpoint", "event", T.EVICTION_COMPLETED),
        ("checkpoint", "event", T.EVICTION_FORCED),
        ("checkpoint", "event", T.EVICTION_ABORTED),
        ("checkpoint", "event", T.EVICTION_CANCELLED),
    ],
)
async def test_a_malformed_message_on_a_consumed_subject_is_dead_lettered_and_changes_nothing(
    admission: Admission, client: Client, service: str, kind: str, message_type: str
) -> None:
    job = await client.job_in(await client.submitted(gpus={"count": 2}), "running")
    before = await admission.capacity()
    subject = (
        client.s.command(service, message_type)
        if kind == "command"
        else client.s.event(service, message_type)
    )

    await client.js.publish(subject, _malformed(message_type))

    [dead] = await stream_messages(client.js, client.s.dead_letter(ADMISSION), 1, within=20)
    assert dead.headers is not None
    assert dead.headers["Gpusched-Original-Subject"] == subject
    assert dead.headers["Gpusched-Reason"] == "malformed"
    assert await admission.capacity() == before
    assert (await client.job(job["job_id"]))["state"] == "running"


async def test_a_workload_stopped_for_an_unknown_allocation_is_dead_lettered(
    admission: Admission, client: Client
) -> None:
    ghost = {"allocation_id": "alloc-000000000000", "job_id": "job-000000000000"}
    await client.stopped(ghost, StopReason.COMPLETED)

    [dead] = await stream_messages(client.js, client.s.dead_letter(ADMISSION), 1, within=20)
    assert dead.headers is not None
    assert dead.headers["Gpusched-Reason"] == "rejected"
    # The refused transaction left the ledger as it was: the next job fits as before.
    job = await client.job_in(await client.submitted(gpus={"count": 4}), "running")
    assert len(job["allocated"]) == 4


async def test_the_same_envelope_delivered_twice_has_one_effect(
    admission: Admission, client: Client
) -> None:
    command = make_envelope(
        T.RESERVE_FOR_INFERENCE,
        ReserveForInference(reservation_id="res-1", decision_id="decision-1", free_gpus=1),
        source="test",
    )
    subject = client.s.command(ADMISSION, T.RESERVE_FOR_INFERENCE)
    # No Nats-Msg-Id: JetStream stores both copies, so only the service can dedupe.
    await client.js.publish(subject, command.to_bytes())
    await client.js.publish(subject, command.to_bytes())
    await client.reserve("decision-2", [], free_gpus=1)

    first, second = await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 2)
    assert first.causation_id == command.id
    assert second.causation_id != command.id
    assert len(await client.all_events(client.s.event(ADMISSION, T.GPUS_RESERVED))) == 2
    assert shared(await admission.capacity()) == (0, 2, 2)


async def test_a_missing_inventory_file_stops_the_start_with_a_clear_error(
    admission_settings: Settings, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere.yaml"
    settings = admission_settings.model_copy(
        update={"admission": admission_settings.admission.model_copy(
            update={"inventory_path": missing})}
    )  # fmt: skip
    rt = ServiceRuntime(ADMISSION, SCHEMA, settings, migrations_dir(admission_app.__file__))
    await rt.start()
    try:
        with pytest.raises(InventoryUnavailable, match=r"nowhere\.yaml"):
            await assemble(rt)
    finally:
        await rt.close()


# --- quotas, priority governance, why ------------------------------------------------------

QUOTAS = """
teams:
  vision:
    max_priority: p1-normal
    above_max: reject
    gpus:
      A100-80GB: {guaranteed: 2, max: 3}
  research:
    max_priority: p2-offline
    above_max: hold
    allow_process: true
    gpus:
      "*": {guaranteed: 1, max: 4}
"""


@pytest.fixture
async def governed(admission_settings: Settings, tmp_path: Path) -> AsyncIterator[Admission]:
    path = tmp_path / "quotas.yaml"
    path.write_text(QUOTAS)
    settings = admission_settings.model_copy(
        update={"admission": admission_settings.admission.model_copy(
            update={"quotas_path": path})}
    )  # fmt: skip
    running = await start_admission(settings)
    yield running
    await running.stop()


async def why(client: Client, job_id: str) -> dict[str, Any]:
    body = json.dumps({"job_id": job_id}).encode()
    return await client.request(client.s.api_jobs_why, body)


async def test_a_team_borrows_idle_gpus_up_to_its_max_and_the_grant_marks_them_borrowed(
    governed: Admission, client: Client
) -> None:
    within = await client.submitted(name="within", gpus={"count": 2})
    await client.job_in(within, "running")
    beyond = await client.submitted(name="beyond", gpus={"count": 1})
    await client.job_in(beyond, "running")
    over = await client.submitted(name="over", gpus={"count": 1})

    granted = await client.events(client.s.event(ADMISSION, T.ALLOCATION_GRANTED), 2)
    assert [(g.data["job_id"], g.data["borrowed"]) for g in granted] == [
        (within, False),
        (beyond, True),
    ]
    await client.audits("job.waiting", over, 1)
    explained = await why(client, over)
    assert explained["ok"] and explained["state"] == "queued"
    assert any(
        reason.startswith("quota: team vision holds 3 A100-80GB GPUs")
        for reason in explained["reasons"]
    ), explained
    # Another team is not held back by vision's quota: it takes the last free GPU.
    other = await client.submitted(name="other", team="research", priority_class="p2-offline")
    explained = await why(client, other)
    assert any(reason.startswith("capacity: 2 x A100-80GB wanted, 1 free") for reason in
               explained["reasons"]), explained  # fmt: skip


async def test_bad_submissions_get_a_clear_code_and_nothing_is_stored(
    governed: Admission, client: Client
) -> None:
    cases = {
        "unknown_team": {"team": "nobody"},
        "over_quota": {"gpus": {"count": 4}},
        "priority_not_allowed": {"priority_class": "p0-urgent"},
        "invalid": {"gpus": {"count": 1, "milli": 1500}},
    }
    for code, fields in cases.items():
        reply = await client.submit(**fields)
        assert reply["ok"] is False and reply["error"]["code"] == code, (code, reply)
        assert reply["error"]["message"]
    assert await governed.rows("jobs") == 0
    rejected = await client.audits("job.rejected", "nobody", 1)
    assert "unknown_team" in rejected[0].data["reason"]


PROCESS = {"kind": "process", "argv": ["python", "train.py"]}


async def test_a_process_workload_of_a_team_not_allowed_it_is_forbidden_stored_nowhere_and_audited(
    governed: Admission, client: Client
) -> None:
    reply = await client.submit(name="forged", workload=PROCESS, gpus={"count": 1})

    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == "forbidden"
    assert "ask an operator to set allow_process for team vision" in reply["error"]["message"]
    assert await governed.rows("jobs") == 0
    [rejected] = await client.audits("job.rejected", "vision", 1)
    assert rejected.data["reason"].startswith("forbidden: team vision may not submit process")
    assert rejected.data["details"]["workload"] == "process"
    assert rejected.data["details"]["code"] == "forbidden"
    # The team the quotas file allows it is admitted; a sim workload needs nothing.
    allowed = await client.submitted(
        name="script", team="research", priority_class="p2-offline", workload=PROCESS
    )
    await client.submitted(name="sim", gpus={"count": 1})
    assert (await client.job(allowed))["state"] in {"queued", "running"}


async def test_without_a_quotas_file_process_workloads_are_forbidden_unless_the_setting_allows(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings)
    try:
        reply = await client.submit(workload=PROCESS)
        assert reply["ok"] is False and reply["error"]["code"] == "forbidden", reply
        assert "allow_process" in reply["error"]["message"]
        assert await running.rows("jobs") == 0
        await client.audits("job.rejected", "vision", 1)
    finally:
        await running.stop()

    running = await start_with(admission_settings, allow_process_workloads_without_quotas=True)
    try:
        await client.submitted(workload=PROCESS)
    finally:
        await running.stop()


async def test_a_job_above_its_teams_max_priority_is_held_until_an_operator_approves_it(
    governed: Admission, client: Client
) -> None:
    job_id = await client.submitted(
        name="urgent", team="research", priority_class="p0-urgent", gpus={"count": 1}
    )
    held = await client.job(job_id)
    assert held["state"] == "held"
    assert any("held for approval" in warning for warning in held["warnings"])
    explained = await why(client, job_id)
    assert explained["state"] == "held" and "gpusched approve" in explained["reasons"][0]

    approve = json.dumps({"job_id": job_id, "operator": "ops-ann", "reason": "deadline"})
    reply = await client.request(client.s.api_jobs_approve, approve.encode())

    assert reply["ok"] is True
    await client.job_in(job_id, "running")
    [audit] = await client.audits("job.approved", job_id, 1)
    assert audit.data["details"] == {"operator": "ops-ann", "reason": "deadline"}
    again = await client.request(client.s.api_jobs_approve, approve.encode())
    assert again["ok"] is False and again["error"]["code"] == "not_held"


async def start_with(admission_settings: Settings, **admission: Any) -> Admission:
    settings = admission_settings.model_copy(
        update={"admission": admission_settings.admission.model_copy(update=admission)}
    )
    return await start_admission(settings)


async def test_a_gang_that_waited_holds_its_node_so_small_jobs_cannot_starve_it(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings, reserve_after_s=0.5, starve_after_s=3600)
    try:
        small = await client.submitted(name="small", gpus={"count": 2})
        small_job = await client.job_in(small, "running")
        big = await client.submitted(name="big", gpus={"count": 4})
        [reserving] = await client.audits("job.reserving", big, 1)
        assert reserving.data["details"]["node"] == "shared-00"

        # Two GPUs are free, but they are held for the gang that waits for four.
        late = await client.submitted(name="late", gpus={"count": 1})
        await client.audits("job.waiting", late, 1)
        assert (await client.job(late))["state"] == "queued"
        await client.stopped(small_job, StopReason.COMPLETED)

        placed = await client.job_in(big, "running")
        assert len(placed["allocated"]) == 4
    finally:
        await running.stop()


async def test_a_job_that_waited_too_long_is_offered_fewer_gpus_if_it_allows(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings, reserve_after_s=3600, starve_after_s=0.5)
    try:
        small = await client.submitted(name="small", gpus={"count": 2})
        await client.job_in(small, "running")
        flexible = await client.submitted(name="flexible", gpus={"count": 4, "min_count": 2})

        placed = await client.job_in(flexible, "running")

        assert len(placed["allocated"]) == 2
        assert any("offered 2 of 4 GPUs" in warning for warning in placed["warnings"])
    finally:
        await running.stop()


async def test_a_gang_is_placed_inside_one_nvlink_island_read_back_from_the_database(
    admission_settings: Settings, client: Client, tmp_path: Path
) -> None:
    path = tmp_path / "islands.yaml"
    path.write_text(INVENTORY + "    nvlink_islands: [[0, 2], [1, 3]]\n")
    running = await start_with(admission_settings, inventory_path=path)
    try:
        job_id = await client.submitted(name="pair", gpus={"count": 2})

        placed = await client.job_in(job_id, "running")

        assert [(gpu["node"], gpu["index"]) for gpu in placed["allocated"]] == [
            ("shared-00", 0),
            ("shared-00", 2),
        ]
    finally:
        await running.stop()
