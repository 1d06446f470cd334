"""Requests built to be awkward, on the real NATS and PostgreSQL: whatever a user or an
operator sends within the request rules, they get an answer of their own, and the
scheduling pass goes on placing everyone else's jobs.

- a job naming many made-up GPU models (and one real one) waits, audited in a short
  reason; one refused for them is answered with its refusal, not `internal`;
- a failure while writing what the pass decided for one job parks that job only;
- a node spec its own inventory event could not name is `invalid_node_spec`;
- a `list` cursor naming no job is refused, not an empty last page.

The cluster is one inference node (2 GPUs) and one shared node (4 GPUs).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import SMALL_CLUSTER, Admission, Client, with_inventory

from gpusched.admission import scheduler as scheduler_module
from gpusched.admission import wire as wire_module
from gpusched.admission import words
from gpusched.admission.app import NAME as ADMISSION
from gpusched.contracts.messages import NodeVerb, T
from gpusched.contracts.validation import TEXT_MAX
from gpusched.infra.settings import Settings

# 31 GPU models no inventory has, each near the 200 characters a name may have.
MADE_UP = [f"X{number:02d}" + "y" * 190 for number in range(31)]
NODE = {
    "name": "shared-01",
    "pool": "shared",
    "gpu_model": "A100-80GB",
    "gpus": 4,
    "cpu_milli": 64000,
    "memory_mib": 524288,
}


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, SMALL_CLUSTER)


async def two_of_four_shared_gpus_busy(client: Client) -> None:
    """A gang of four waits from now on; one of two is placed."""
    await client.job_in(await client.submitted(name="first", gpus={"count": 2}), "running")


# --- many GPU models ---------------------------------------------------------------------


async def test_a_job_naming_many_made_up_gpu_models_waits_and_later_jobs_are_placed(
    admission: Admission, client: Client
) -> None:
    await two_of_four_shared_gpus_busy(client)
    models = ["A100-80GB", *MADE_UP]
    hostile = await client.submitted(name="many", gpus={"count": 4, "models": models})

    [waiting] = await client.audits("job.waiting", hostile, 1)
    reason = waiting.data["reason"]
    assert reason.startswith("needs 4 x any of 32 models (A100-80GB, X00"), reason
    assert "and 29 more) in one gang; free now: shared 2" in reason
    assert len(reason) < TEXT_MAX
    later = await client.submitted(name="later", gpus={"count": 2})
    await client.job_in(later, "running")
    assert (await client.job(hostile))["state"] == "queued"


async def test_a_submit_refused_for_many_unknown_gpu_models_is_answered_with_its_refusal(
    admission: Admission, client: Client
) -> None:
    reply = await client.submit(name="unknown", gpus={"count": 1, "models": MADE_UP})

    assert reply["ok"] is False, reply
    error = reply["error"]
    assert error["code"] == "unknown_gpu_model", error
    assert "and 28 more not in the inventory (known: A100-80GB)" in error["message"]
    [rejected] = await client.audits("job.rejected", "vision", 1)
    assert rejected.data["reason"] == f"unknown_gpu_model: {error['message']}"


# --- one job's failure while the pass writes its decision --------------------------------


async def test_a_failure_writing_one_jobs_placement_parks_that_job_and_others_are_placed(
    admission: Admission, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = wire_module.allocation_granted

    def allocation_granted(*args: Any, **kwargs: Any) -> Any:
        if args[1].spec.name == "boom":
            raise ZeroDivisionError("a bug writing this job's grant")
        return real(*args, **kwargs)

    monkeypatch.setattr(wire_module, "allocation_granted", allocation_granted)
    bad = await client.submitted(name="boom", gpus={"count": 1})

    job = await client.job_in(bad, "parked")
    assert job["parked_reason"] == (
        "the scheduling pass failed on this job: ZeroDivisionError: a bug writing this job's grant"
    )
    [parked] = await client.audits("job.parked", bad, 1)
    assert parked.data["details"]["where"] == "placement"
    good = await client.submitted(name="fine", gpus={"count": 1})
    await client.job_in(good, "running")


async def test_a_failure_auditing_one_job_as_waiting_parks_that_job_and_others_are_placed(
    admission: Admission, client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    def models_words(models: Any) -> str:
        if "boom" in models:
            raise ZeroDivisionError("a bug writing why this job waits")
        return words.models_words(models)

    monkeypatch.setattr(scheduler_module, "models_words", models_words)
    await two_of_four_shared_gpus_busy(client)
    bad = await client.submitted(name="wait", gpus={"count": 4, "models": ["A100-80GB", "boom"]})

    job = await client.job_in(bad, "parked")
    assert "ZeroDivisionError: a bug writing why this job waits" in job["parked_reason"]
    good = await client.submitted(name="fine", gpus={"count": 2})
    await client.job_in(good, "running")


# --- node specs --------------------------------------------------------------------------


async def test_a_node_spec_its_inventory_event_could_not_name_is_an_invalid_node_spec(
    admission: Admission, client: Client
) -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"name": "n" * 300}, "spec.name", "at most 200 characters"),
        ({"name": "a\nb"}, "spec.name", "control character U+000A is not allowed"),
        ({"gpu_model": "A\t100", "gpu_memory_mib": 1}, "spec.gpu_model", "U+0009"),
        ({"gpu_model": "M" * 500, "gpu_memory_mib": 1}, "spec.gpu_model", "at most 200"),
    ]
    for change, field, rule in cases:
        body = {"spec": {**NODE, **change}, "operator": "ops", "reason": "new rack"}
        reply = await client.request(client.s.api_nodes(NodeVerb.ADD), json.dumps(body).encode())

        assert reply["ok"] is False, (change, reply)
        error = reply["error"]
        assert (error["code"], error.get("field")) == ("invalid_node_spec", field), (change, error)
        assert rule in error["message"] and "\n" not in error["message"], error
        assert len(error["message"]) < 200, error

    assert await admission.rows("nodes") == 2
    assert await client.all_events(client.s.event(ADMISSION, T.INVENTORY_CHANGED)) == []
    # The ledger in memory is as committed: the same node, well named, is added.
    body = {"spec": NODE, "operator": "ops", "reason": "new rack"}
    added = await client.request(client.s.api_nodes(NodeVerb.ADD), json.dumps(body).encode())
    assert added["ok"], added
    assert await admission.rows("nodes") == 3


# --- list cursors ------------------------------------------------------------------------


async def list_jobs(client: Client, **body: Any) -> dict[str, Any]:
    return await client.request(client.s.api_jobs_list, json.dumps(body).encode())


async def test_listing_after_a_job_that_does_not_exist_is_refused_naming_the_cursor(
    admission: Admission, client: Client
) -> None:
    for name in ("one", "two"):
        await client.submitted(name=name, gpus={"count": 1})
    first = await list_jobs(client, limit=1)
    assert first["ok"] and first["next"] is not None, first
    second = await list_jobs(client, limit=1, after=first["next"])
    assert second["ok"] and [job["name"] for job in second["jobs"]] == ["one"], second

    unknown = await list_jobs(client, limit=1, after="job-that-never-was")

    assert unknown["ok"] is False, unknown
    error = unknown["error"]
    assert (error["code"], error["field"]) == ("invalid", "after"), error
    assert "no job 'job-that-never-was'" in error["message"] and "\n" not in error["message"]
    other_team = await list_jobs(client, team="nlp", after=first["next"])
    assert other_team["ok"] is False and other_team["error"]["field"] == "after", other_team
