"""Hostile requests against the read APIs of the checkpoint and billing services (the
ones `gpusched get`, `why` and `bill` call), on the real NATS and PostgreSQL: each is
refused as bad input naming what is wrong, never an `internal` error, nothing stored
changes, and a valid request right after is served."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import nats
import pytest

from gpusched.billing import app as billing_app
from gpusched.billing.api import job_bill_subject, statement_subject
from gpusched.checkpoint import app as checkpoint_app
from gpusched.checkpoint.api import (
    get_saga_subject,
    job_history_subject,
    latest_checkpoint_subject,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings
from tests.fuzz.service_state import digest
from tests.fuzz.strategies import (
    EXAMPLES,
    HOSTILE_STRINGS,
    MEGABYTE,
    Mutation,
    draw,
    mutations,
    to_json,
)
from tests.support.identity import harness_options

pytestmark = pytest.mark.timeout(120)

REFUSALS = {"invalid", "bad_request"}
NOT_A_REQUEST = [
    b"",
    b"\x00",
    b"not json",
    b"\xff\xfe",
    b"[]",
    b"null",
    b"1e999",
    MEGABYTE.encode(),
]


class Reads:
    def __init__(self, nc: nats.NATS, runtimes: dict[str, ServiceRuntime], prefix: str):
        self.nc = nc
        self.rt = runtimes
        self.s = Subjects(prefix)
        self.prefix = prefix

    async def request(self, subject: str, body: bytes) -> dict[str, Any]:
        reply = await self.nc.request(subject, body, timeout=15)
        answer: dict[str, Any] = json.loads(reply.data)
        return answer

    async def digests(self) -> dict[str, dict[str, str]]:
        return {name: await digest(rt) for name, rt in sorted(self.rt.items())}


@pytest.fixture(scope="module")
async def reads(module_settings: Settings) -> AsyncIterator[Reads]:
    assert module_settings.nats_url is not None
    async with AsyncExitStack() as stack:
        runtimes: dict[str, ServiceRuntime] = {}
        for app in (checkpoint_app, billing_app):
            rt = ServiceRuntime(app.NAME, app.SCHEMA, module_settings, migrations_dir(app.__file__))
            await rt.start()
            await app.build(rt)
            task = asyncio.create_task(rt.run())

            async def stop(rt: ServiceRuntime = rt, task: asyncio.Task[None] = task) -> None:
                rt.request_stop()
                await asyncio.wait_for(task, 20)

            stack.push_async_callback(stop)
            runtimes[app.NAME] = rt
        nc = await nats.connect(module_settings.nats_url, **harness_options(module_settings))
        stack.push_async_callback(nc.drain)
        yield Reads(nc, runtimes, module_settings.subject_prefix)


def endpoints(r: Reads) -> dict[str, tuple[dict[str, Any], dict[str, list[Any]]]]:
    """Each read endpoint: a valid request, and the hostile values of each field."""
    ids = [*HOSTILE_STRINGS, None, 7, True, ["job-1"], {"id": 1}]
    return {
        job_history_subject(r.s): ({"job_id": "job-0123456789ab"}, {"job_id": ids}),
        latest_checkpoint_subject(r.s): (
            {"job_id": "job-0123456789ab"},
            {"job_id": ids, "min_stage": ["sideways", 1, "", *HOSTILE_STRINGS]},
        ),
        get_saga_subject(r.s): ({"job_id": "job-0123456789ab"}, {"job_id": ids}),
        job_bill_subject(r.prefix): ({"job_id": "job-0123456789ab"}, {"job_id": ids}),
        statement_subject(r.prefix): (
            {"team": "vision"},
            {
                "team": [*HOSTILE_STRINGS, "", 3],
                "period_start": ["yesterday", 1e300, "9999-99-99T00:00:00Z", True],
                "period_end": ["2020-01-01T00:00:00", "not a time", -1],
            },
        ),
    }


def refused(reply: dict[str, Any], what: object) -> None:
    assert reply.get("ok") is False, (what, reply)
    assert reply["error"]["code"] in REFUSALS, (what, reply)


async def test_hostile_fields_on_every_read_endpoint_are_refused_and_change_nothing(
    reads: Reads,
) -> None:
    before = await reads.digests()
    for subject, (valid, fields) in endpoints(reads).items():
        for mutation in draw(mutations(fields), max(8, EXAMPLES // 3)):
            assert isinstance(mutation, Mutation)
            refused(await reads.request(subject, to_json(mutation.apply(valid))), mutation)
        # Served: an answer, or `not_found` for a job nobody has heard of.
        answer = await reads.request(subject, to_json(valid))
        assert answer["ok"] is True or answer["error"]["code"] == "not_found", (subject, answer)
    assert await reads.digests() == before


@pytest.mark.parametrize("raw", NOT_A_REQUEST)
async def test_a_body_that_is_not_a_request_is_refused_on_every_read_endpoint(
    reads: Reads, raw: bytes
) -> None:
    for subject in endpoints(reads):
        refused(await reads.request(subject, raw), (subject, raw[:20]))


async def test_a_saga_asked_by_both_keys_or_neither_is_refused(reads: Reads) -> None:
    subject = get_saga_subject(reads.s)
    for body in ({}, {"job_id": "job-1", "saga_id": "saga-1"}):
        refused(await reads.request(subject, to_json(body)), body)
