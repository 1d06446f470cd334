"""Hostile requests against the real admission API (NATS + PostgreSQL): every one gets
an `invalid` error naming the field, nothing stored changes, and a valid request right
after is served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest

from gpusched.contracts.messages import NodeVerb
from gpusched.contracts.subjects import Subjects
from gpusched.infra.settings import Settings
from tests.fuzz.service_state import digest
from tests.fuzz.strategies import (
    EXAMPLES,
    HOSTILE_NUMBERS,
    HOSTILE_STRINGS,
    MEGABYTE,
    SUBMIT,
    SUBMIT_FIELDS,
    Mutation,
    draw,
    mutations,
    to_json,
)
from tests.support.admission import (
    SMALL_CLUSTER,
    Admission,
    Client,
    start_admission,
    with_inventory,
)
from tests.support.identity import harness_options

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
async def admission(module_settings: Settings) -> AsyncIterator[Admission]:
    assert module_settings.data_dir is not None
    module_settings.data_dir.mkdir(parents=True, exist_ok=True)
    running = await start_admission(
        with_inventory(module_settings, Path(module_settings.data_dir), SMALL_CLUSTER)
    )
    yield running
    await running.stop()


@pytest.fixture(scope="module")
async def client(module_settings: Settings, admission: Admission) -> AsyncIterator[Client]:
    assert module_settings.nats_url is not None
    nc = await nats.connect(module_settings.nats_url, **harness_options(module_settings))
    yield Client(nc, nc.jetstream(), Subjects(module_settings.subject_prefix))
    await nc.drain()


async def settled(admission: Admission) -> dict[str, str]:
    """The digest once the service is quiet: the same over QUIET_S, longer than the
    scheduling interval (1 s), so a pass still to come cannot change it afterwards (two
    equal readings 0.2 s apart could both come before a job just submitted was placed)."""
    last = await digest(admission.rt)
    quiet = 0.0
    for _ in range(100):
        await asyncio.sleep(0.2)
        now = await digest(admission.rt)
        quiet = quiet + 0.2 if now == last else 0.0
        if quiet >= QUIET_S:
            return now
        last = now
    return last


QUIET_S = 1.6


def refused_for(reply: dict[str, Any], field: str, what: object) -> None:
    assert reply["ok"] is False, (what, reply)
    error = reply["error"]
    assert error["code"] == "invalid", (what, error)
    named = error["field"] or ""
    assert named == field or named.startswith(f"{field}."), (what, error)


async def test_every_hostile_submit_is_invalid_naming_its_field_and_changes_nothing(
    admission: Admission, client: Client
) -> None:
    before = await settled(admission)
    assert {"jobs", "outbox", "inbox"} <= before.keys()
    for mutation in draw(mutations(SUBMIT_FIELDS), EXAMPLES):
        reply = await client.request(client.s.api_jobs_submit, to_json(mutation.apply(SUBMIT)))
        refused_for(reply, mutation.path, mutation)
    assert await digest(admission.rt) == before

    job_id = await client.submitted(**SUBMIT)
    assert (await client.job(job_id))["name"] == "fuzz"


async def test_a_submit_from_a_newer_client_with_unknown_fields_is_served(
    client: Client,
) -> None:
    body = {**SUBMIT, "name": "newer", "future_option": {"x": [1, 2]}, "labels": ["a"]}
    body["gpus"] = {**SUBMIT["gpus"], "interconnect": "nvlink"}
    reply = await client.request(client.s.api_jobs_submit, json.dumps(body).encode())
    assert reply["ok"], reply


@pytest.mark.parametrize(
    "raw", [b"", b"\x00", b"not json", b"\xff\xfe\xfd", b"[]", b"null", b"1e999", MEGABYTE.encode()]
)
async def test_a_body_that_is_not_a_request_is_invalid(
    admission: Admission, client: Client, raw: bytes
) -> None:
    before = await settled(admission)
    reply = await client.request(client.s.api_jobs_submit, raw)
    assert reply["ok"] is False
    assert reply["error"]["code"] == "invalid"
    assert await digest(admission.rt) == before


async def test_hostile_job_and_node_requests_are_invalid_naming_the_field(
    admission: Admission, client: Client
) -> None:
    s = client.s
    job_id = await client.submitted(**{**SUBMIT, "name": "target"})
    endpoints: dict[str, tuple[dict[str, Any], dict[str, list[Any]]]] = {
        s.api_jobs_get: ({"job_id": job_id}, {"job_id": [*HOSTILE_STRINGS, None]}),
        s.api_jobs_why: ({"job_id": job_id}, {"job_id": HOSTILE_STRINGS}),
        s.api_jobs_approve: (
            {"job_id": job_id, "operator": "ops"},
            {"job_id": HOSTILE_STRINGS, "operator": [*HOSTILE_STRINGS, ""]},
        ),
        s.api_jobs_scale: (
            {"job_id": job_id, "replicas": 1},
            {"job_id": HOSTILE_STRINGS, "replicas": HOSTILE_NUMBERS},
        ),
        s.api_jobs_list: (
            {"team": "vision", "limit": 10},
            {
                "team": [*HOSTILE_STRINGS, "two words"],
                "states": [["sleeping"], "queued", [1], None],
                "priority_class": ["p9-never", 1, *HOSTILE_STRINGS],
                "limit": [*HOSTILE_NUMBERS, 0, 501],
                "after": HOSTILE_STRINGS,
            },
        ),
        s.api_nodes(NodeVerb.DRAIN): (
            {"node": "shared-00", "operator": "ops"},
            {"node": HOSTILE_STRINGS, "operator": HOSTILE_STRINGS, "reason": HOSTILE_STRINGS},
        ),
    }
    before = await settled(admission)
    for subject, (valid, fields) in endpoints.items():
        for mutation in draw(mutations(fields), 12):
            assert isinstance(mutation, Mutation)
            reply = await client.request(subject, to_json(mutation.apply(valid)))
            refused_for(reply, mutation.path, (subject, mutation))
    assert await digest(admission.rt) == before

    assert (await client.job(job_id))["state"] in {"queued", "running"}


NODE_SPEC: dict[str, Any] = {
    "name": "fuzz-node",
    "pool": "shared",
    "gpu_model": "A100-80GB",
    "gpus": 4,
    "cpu_milli": 64000,
    "memory_mib": 524288,
}
NODE_SPEC_FIELDS: dict[str, list[Any]] = {
    "spec.name": [*HOSTILE_STRINGS, ""],
    "spec.pool": [*HOSTILE_STRINGS, "nowhere"],
    "spec.gpu_model": HOSTILE_STRINGS,
    "spec.gpus": [*HOSTILE_NUMBERS, 0, 1025],
    "spec.cpu_milli": HOSTILE_NUMBERS,
    "spec.memory_mib": HOSTILE_NUMBERS,
    "spec.count": [*HOSTILE_NUMBERS, 0],
    "operator": [*HOSTILE_STRINGS, ""],
}


async def test_a_hostile_node_spec_is_refused_without_an_internal_error_or_a_change(
    admission: Admission, client: Client
) -> None:
    """A node spec is a free-form document checked by the inventory's own parser: it is
    refused as `invalid` (the edge) or `invalid_node_spec` (the parser), never
    `internal`, and no node is added."""
    subject = client.s.api_nodes(NodeVerb.ADD)
    valid = {"spec": NODE_SPEC, "operator": "ops", "reason": "fuzz"}
    before = await settled(admission)
    for mutation in draw(mutations(NODE_SPEC_FIELDS), EXAMPLES):
        reply = await client.request(subject, to_json(mutation.apply(valid)))
        assert reply["ok"] is False, (mutation, reply)
        assert reply["error"]["code"] in {"invalid", "invalid_node_spec"}, (mutation, reply)
    assert await digest(admission.rt) == before

    reply = await client.request(subject, to_json(valid))
    assert reply["ok"], reply
