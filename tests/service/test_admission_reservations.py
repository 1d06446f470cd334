"""Stored reservations and grouped submits, on the real NATS and PostgreSQL.

The cluster is one inference node (2 GPUs) and one shared node (4 GPUs), all
A100-80GB: a 2-GPU job on the shared node leaves 2 free, and a 4-GPU gang waits.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from tests.service.test_admission_service import admission_settings, start_with, why
from tests.support.admission import Admission, Client
from tests.support.waiting import eventually

from gpusched.admission import store
from gpusched.admission.app import SCHEMA
from gpusched.contracts.messages import StopReason
from gpusched.domain.ledger import Ledger
from gpusched.infra.settings import Settings

# Fixtures shared with the admission service tests (a fresh database and prefix each).
__all__ = ["admission_settings"]


async def reservations_stored(running: Admission) -> list[tuple[str, list[str]]]:
    async with running.rt.uow() as uow:
        rows = await uow.execute(f"SELECT job_id, nodes FROM {SCHEMA}.reservations")
        return [(row.job_id, list(row.nodes)) for row in rows]


def slots(ledger: Ledger) -> list[tuple[str, int, str, str | None]]:
    return [
        (slot.ref.node, slot.ref.index, str(slot.status), slot.allocation_id)
        for slot in ledger.gpus
    ]


async def a_gang_reserving_the_shared_node(client: Client) -> tuple[dict[str, Any], str]:
    small = await client.submitted(name="small", gpus={"count": 2})
    small_job = await client.job_in(small, "running")
    big = await client.submitted(name="big", gpus={"count": 4})
    await client.audits("job.reserving", big, 1)
    return small_job, big


async def test_a_reservation_survives_an_admission_restart_and_keeps_its_node_for_the_gang(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings, reserve_after_s=0.5, starve_after_s=3600)
    try:
        small_job, big = await a_gang_reserving_the_shared_node(client)
        before = (await client.job(big))["reservation"]
        assert before["nodes"] == ["shared-00"]
        assert "shared-00" in before["reason"]
    finally:
        await running.stop()

    running = await start_with(admission_settings, reserve_after_s=0.5, starve_after_s=3600)
    try:
        # Two GPUs are free, but the restarted service still holds them for the gang.
        late = await client.submitted(name="late", gpus={"count": 1})
        await client.audits("job.waiting", late, 1)
        assert (await client.job(late))["state"] == "queued"
        assert (await client.job(big))["reservation"] == before
        assert await reservations_stored(running) == [(big, ["shared-00"])]
        explained = await why(client, late)
        assert any(f"held for the waiting gang {big}" in line for line in explained["reasons"])
        own = await why(client, big)
        assert own["reasons"][0].startswith("reservation: holds node shared-00")
        # Taken once, before the restart: the new leader found it stored.
        assert len(await client.audits("job.reserving", big, 1)) == 1

        await client.stopped(small_job, StopReason.COMPLETED)

        placed = await client.job_in(big, "running")
        assert len(placed["allocated"]) == 4
        assert placed["reservation"] is None
        [released] = await client.audits("job.reservation_released", big, 1)
        assert released.data["details"]["end"] == "placed"
        assert await reservations_stored(running) == []
    finally:
        await running.stop()


async def test_a_reservation_ends_when_its_gang_waited_too_long_and_backfill_gets_the_node(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings, reserve_after_s=0.5, starve_after_s=4.0)
    try:
        _, big = await a_gang_reserving_the_shared_node(client)
        late = await client.submitted(name="late", gpus={"count": 1})
        await client.audits("job.waiting", late, 1)

        [released] = await client.audits("job.reservation_released", big, 1)

        assert released.data["details"]["end"] == "timed_out"
        await client.job_in(late, "running")
        assert (await client.job(big))["reservation"] is None
        assert await reservations_stored(running) == []
    finally:
        await running.stop()


async def test_concurrent_submits_sharing_an_idempotency_key_get_one_stored_job(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings)
    try:
        bodies = [
            json.dumps(
                {"name": f"burst-{n}", "team": "vision", "gpus": {"count": 4},
                 "idempotency_key": f"burst-{n % 20}"}
            ).encode()
            for n in range(40)
        ]  # fmt: skip

        replies = await asyncio.gather(
            *(client.request(client.s.api_jobs_submit, body) for body in bodies)
        )

        assert all(reply["ok"] for reply in replies), replies
        by_key: dict[int, set[str]] = {}
        for n, reply in enumerate(replies):
            by_key.setdefault(n % 20, set()).add(reply["job_id"])
        assert all(len(ids) == 1 for ids in by_key.values()), by_key
        assert await running.rows("jobs") == 20
        for ids in by_key.values():
            assert (await client.job(ids.pop()))["state"] in {"queued", "running"}
        submitted = await client.audits("job.submitted", replies[0]["job_id"], 1)
        assert len(submitted) == 1
    finally:
        await running.stop()


async def test_a_submit_the_database_refuses_fails_alone_and_its_group_is_still_stored(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings)
    try:
        good = [
            json.dumps({"name": f"good-{n}", "team": "vision", "gpus": {"count": 4}}).encode()
            for n in range(10)
        ]
        # PostgreSQL cannot store a NUL character; the edge refuses it before the group's
        # INSERT is tried, so the rest of the group is stored and the NUL is `invalid`.
        bad = json.dumps({"name": "bad\u0000name", "team": "vision", "gpus": {"count": 4}})

        replies = await asyncio.gather(
            *(client.request(client.s.api_jobs_submit, body) for body in [*good, bad.encode()])
        )

        assert [reply["ok"] for reply in replies] == [True] * 10 + [False]
        assert replies[-1]["error"]["code"] == "invalid"
        assert replies[-1]["error"]["field"] == "name"
        assert await running.rows("jobs") == 10
        for reply in replies[:10]:
            assert (await client.job(reply["job_id"]))["name"].startswith("good-")
    finally:
        await running.stop()


async def test_placements_written_together_leave_the_ledger_in_memory_equal_to_the_database(
    admission_settings: Settings, client: Client
) -> None:
    running = await start_with(admission_settings)
    try:
        replies = await asyncio.gather(
            *(client.submit(name=f"one-{n}", gpus={"count": 1}) for n in range(6))
        )
        ids = [reply["job_id"] for reply in replies]

        async def four_running() -> list[dict[str, Any]] | None:
            jobs = [await client.job(job_id) for job_id in ids]
            running_jobs = [job for job in jobs if job["state"] == "running"]
            return running_jobs if len(running_jobs) == 4 else None

        placed = await eventually(four_running, within=20)
        assert {gpu["node"] for job in placed for gpu in job["allocated"]} == {"shared-00"}
        placed_ids = {job["job_id"] for job in placed}

        async with running.rt.uow() as uow:
            memory = await running.service.keeper.read(uow)
            _, stored = await store.load_ledger(uow)
        assert slots(memory) == slots(stored)
        assert memory.allocations.keys() == stored.allocations.keys()
        assert {a.job_id for a in stored.allocations.values()} == placed_ids
        granted = await client.events(client.s.event("admission", "allocation.granted"), 4)
        assert {event.correlation_id for event in granted} == placed_ids
    finally:
        await running.stop()

    restarted = await start_with(admission_settings)
    try:
        async with restarted.rt.uow() as uow:
            rebuilt = await restarted.service.keeper.read(uow)
        assert slots(rebuilt) == slots(memory)
    finally:
        await restarted.stop()
