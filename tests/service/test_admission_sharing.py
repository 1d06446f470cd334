"""GPU sharing in the admission service on the real NATS and PostgreSQL: fractional
GPUs with memory caps, MIG slices and layout changes (commands to the cluster agent,
at most one per hour per GPU), the time-of-day reconciler, and a restart.

The cluster: one inference node (2 x A100-80GB, MIG-capable) and one shared node
(2 x A100-80GB).
"""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, time, timedelta
from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import Admission, Client, start_admission, with_inventory
from tests.support.waiting import eventually

from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA
from gpusched.admission.mig import MigModes
from gpusched.agent.app import start_agent
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import MigConfigured, StopReason, T
from gpusched.domain.inventory import GpuRef
from gpusched.domain.ledger import GpuStatus
from gpusched.domain.sharing import ModeSchedule
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import AgentSettings, Settings

INVENTORY = """
nodes:
  - name: inf-00
    pool: inference
    gpu_model: A100-80GB
    gpus: 2
    cpu_milli: 32000
    memory_mib: 262144
  - name: shared-00
    pool: shared
    gpu_model: A100-80GB
    gpus: 2
    cpu_milli: 32000
    memory_mib: 262144
"""


class SharingClient(Client):
    """The admission client with the sharing calls: submit a share, play the agent's MIG."""

    async def submit_share(self, gpus: dict[str, Any], inference: bool = False) -> dict[str, Any]:
        body: dict[str, Any] = {"name": "share", "team": "vision", "gpus": gpus}
        if inference:
            body |= {"kind": "inference", "priority_class": "inference"}
        reply = await self.nc.request(self.s.api_jobs_submit, json.dumps(body).encode(), 15)
        data: dict[str, Any] = json.loads(reply.data)
        return data

    async def submitted_share(self, gpus: dict[str, Any], inference: bool = False) -> str:
        reply = await self.submit_share(gpus, inference)
        assert reply["ok"], reply
        return str(reply["job_id"])

    async def running(self, job_id: str) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            job = await self.job(job_id)
            return job if job["state"] == "running" else None

        return await eventually(check, within=20)

    async def reasons(self, job_id: str) -> list[str]:
        body = json.dumps({"job_id": job_id}).encode()
        reply = json.loads((await self.nc.request(self.s.api_jobs_why, body, 15)).data)
        return list(reply["reasons"])

    async def at_least(self, subject: str, count: int) -> list[Envelope]:
        async def check() -> list[Envelope] | None:
            found = await self.all_events(subject)
            return found if len(found) >= count else None

        return await eventually(check, within=20)

    async def apply_mig(self, changes: int) -> list[dict[str, Any]]:
        """Play the cluster agent: report the first ``changes`` MIG layout changes applied."""
        commands = await self.at_least(self.s.command("agent", T.MIG_CONFIGURE), changes)
        for command in commands:
            await self.report_applied(command.data)
        return [command.data for command in commands]

    async def report_applied(self, command: dict[str, Any]) -> None:
        """Play the cluster agent: one ``mig.configure`` command applied."""
        await self.publish(
            self.s.event("agent", T.MIG_CONFIGURED),
            T.MIG_CONFIGURED,
            MigConfigured(
                change_id=command["change_id"],
                node=command["node"],
                gpu=command["gpu"],
                profiles=command["profiles"],
                applied_at=datetime.now(UTC),
            ),
        )


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, INVENTORY)


@pytest.fixture
def client_class() -> type[Client]:
    return SharingClient


def granted_subject(c: Client) -> str:
    return c.s.event(ADMISSION, T.ALLOCATION_GRANTED)


# --- fractional GPUs ------------------------------------------------------------------


async def test_a_gpu_of_training_fractions_goes_to_inference_once_both_tenants_are_evicted(
    admission: Admission, client: SharingClient
) -> None:
    first = await client.running(await client.submitted_share({"count": 1, "milli": 400}))
    second = await client.running(await client.submitted_share({"count": 1, "milli": 500}))
    assert first["allocated"] == second["allocated"]
    held = first["allocated"][0]
    ref = GpuRef(held["node"], held["index"])

    await client.reserve("decision-1", [first["allocation_id"], second["allocation_id"]])

    [reserved] = await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)
    assert [(g["node"], g["index"]) for g in reserved.data["gpus"]] == [(ref.node, ref.index)]
    assert reserved.data["pending"] == reserved.data["gpus"]  # both tenants still train
    for job, saga in ((first, "saga-1"), (second, "saga-2")):
        await client.stopped(job, StopReason.EVICTED, saga)
        await client.eviction_completed(job, saga)
        await client.job_in(job["job_id"], "queued")
        slot = (await admission.ledger()).gpu(ref)
        if job is first:  # the other tenant holds it yet, and nobody joins it
            assert (slot.status, slot.reserved_for) == (GpuStatus.SHARED, "res-1")
    assert (slot.status, slot.reserved_for) == (GpuStatus.RESERVED_INFERENCE, "res-1")
    audited = await client.at_least(client.s.audit("allocation.released"), 2)
    kept = {e.data["entity"]: e.data["details"]["kept_for_inference"] for e in audited}
    assert kept == {first["job_id"]: [], second["job_id"]: [str(ref)]}
    # What the other services read: the first release left the GPU held by the second.
    released = await client.events(client.s.event(ADMISSION, T.ALLOCATION_RELEASED), 2)
    still = {e.data["job_id"]: e.data["still_held"] for e in released}
    assert [(g["node"], g["index"]) for g in still[first["job_id"]]] == [(ref.node, ref.index)]
    assert still[second["job_id"]] == []


async def test_a_restart_between_the_tenants_evictions_keeps_the_gpu_pending_for_inference(
    admission_settings: Settings, client: SharingClient
) -> None:
    first_run = await start_admission(admission_settings)
    try:
        first = await client.running(await client.submitted_share({"count": 1, "milli": 400}))
        second = await client.running(await client.submitted_share({"count": 1, "milli": 500}))
        held = first["allocated"][0]
        ref = GpuRef(held["node"], held["index"])
        await client.reserve("decision-1", [first["allocation_id"], second["allocation_id"]])
        await client.events(client.s.event(ADMISSION, T.GPUS_RESERVED), 1)
        await client.stopped(first, StopReason.EVICTED, "saga-1")
        await client.eviction_completed(first, "saga-1")
        await client.job_in(first["job_id"], "queued")
    finally:
        await first_run.stop()
    second_run = await start_admission(admission_settings)
    try:
        slot = (await second_run.ledger()).gpu(ref)
        assert (slot.status, slot.reserved_for) == (GpuStatus.SHARED, "res-1")
        on_it = {
            a.allocation_id
            for a in (await second_run.ledger()).allocations.values()
            if ref in a.gpus
        }
        assert on_it == {second["allocation_id"]}
        # A new fraction that would fit beside the last tenant does not join it; the
        # evicted one queues for training elsewhere (the other shared GPU).
        newcomer = await client.running(await client.submitted_share({"count": 1, "milli": 100}))
        assert [(g["node"], g["index"]) for g in newcomer["allocated"]] != [(ref.node, ref.index)]
        await client.stopped(second, StopReason.EVICTED, "saga-2")
        await client.eviction_completed(second, "saga-2")
        await client.job_in(second["job_id"], "queued")

        async def given_to_inference() -> bool:
            slot = (await second_run.ledger()).gpu(ref)
            return (slot.status, slot.reserved_for) == (GpuStatus.RESERVED_INFERENCE, "res-1")

        await eventually(given_to_inference, within=20)
        audited = await client.at_least(client.s.audit("allocation.released"), 2)
        kept = {e.data["entity"]: e.data["details"]["kept_for_inference"] for e in audited}
        assert kept == {first["job_id"]: [], second["job_id"]: [str(ref)]}
    finally:
        await second_run.stop()


async def test_a_fractional_job_is_granted_its_share_and_a_second_tenant_lands_on_its_gpu(
    admission: Admission, client: SharingClient
) -> None:
    first = await client.submitted_share({"count": 1, "milli": 400})
    second = await client.submitted_share({"count": 1, "milli": 500, "memory_gib": 30})
    one, two = await client.running(first), await client.running(second)
    assert one["allocated"] == two["allocated"]
    assert one["share"] == {
        "milli": 400, "memory_mib": 32768, "mig_profile": None, "mig_slice": None,
    }  # fmt: skip
    grants = {e.data["job_id"]: e.data for e in await client.at_least(granted_subject(client), 2)}
    assert grants[second]["share"]["milli"] == 500
    assert grants[second]["share"]["memory_mib"] == 30 * 1024
    starts = await client.at_least(client.s.command("agent", T.START_WORKLOAD), 2)
    assert {e.data["share"]["milli"] for e in starts} == {400, 500}
    placed = await client.at_least(client.s.audit("job.placed"), 2)
    assert any("400/1000 share" in e.data["reason"] for e in placed)
    ledger = await admission.ledger()
    assert len(ledger.shared) == 1


async def test_a_training_tenant_refuses_memory_overcommit(
    admission: Admission, client: SharingClient
) -> None:
    first = await client.submitted_share({"count": 1, "milli": 300, "memory_gib": 50})
    second = await client.submitted_share({"count": 1, "milli": 300, "memory_gib": 40})
    one, two = await client.running(first), await client.running(second)
    # 90 GiB on an 80 GiB GPU: only inference tenants may overcommit (1.2x).
    assert one["allocated"] != two["allocated"]


async def test_bad_fractions_are_refused_with_a_clear_error_and_nothing_stored(
    admission: Admission, client: SharingClient
) -> None:
    two = await client.submit_share({"count": 2, "milli": 500})
    assert two["error"]["code"] == "invalid" and "count to 1" in two["error"]["message"]
    zero = await client.submit_share({"count": 1, "milli": 0})
    assert zero["error"]["code"] == "invalid"
    too_big = await client.submit_share({"count": 1, "milli": 1001})
    assert too_big["error"]["code"] == "invalid"
    # 100 GiB: more than one 80 GiB GPU gives even with the 1.2x inference overcommit.
    huge = await client.submit_share({"count": 1, "milli": 500, "memory_gib": 100}, inference=True)
    assert huge["error"]["code"] == "unsatisfiable"
    # 90 GiB would fit inference's 96 GiB, but training never overcommits.
    training = await client.submit_share({"count": 1, "milli": 500, "memory_gib": 90})
    assert training["error"]["code"] == "unsatisfiable"
    async with admission.rt.uow() as uow:
        assert (await uow.execute(f"SELECT count(*) FROM {SCHEMA}.jobs")).scalar_one() == 0


# --- MIG ---------------------------------------------------------------------------------


async def test_a_15_gib_replica_gets_a_2g_20gb_slice_after_a_mig_configure_to_the_agent(
    admission: Admission, client: SharingClient
) -> None:
    job_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
    (configure,) = await client.at_least(client.s.command("agent", T.MIG_CONFIGURE), 1)
    assert configure.data["profiles"] == ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"]
    changed = await client.at_least(client.s.audit("mig.layout_changed"), 1)
    assert "next change allowed from" in changed[0].data["reason"]
    # Its slices wait for the agent's report: the replica is not started before it.
    assert (await client.job(job_id))["state"] == "queued"
    assert await client.all_events(client.s.command("agent", T.START_WORKLOAD)) == []
    await client.apply_mig(1)
    job = await client.running(job_id)
    assert job["share"]["mig_profile"] == "2g.20gb"
    assert job["share"]["milli"] == 285  # 2 of 7 compute slices
    assert (configure.data["node"], configure.data["gpu"]) == (
        job["allocated"][0]["node"],
        job["allocated"][0]["index"],
    )
    applied = await client.at_least(client.s.audit("mig.layout_applied"), 1)
    assert applied[0].data["details"]["change_id"] == configure.data["change_id"]
    grants = await client.at_least(granted_subject(client), 1)
    assert grants[0].data["share"]["mig_profile"] == "2g.20gb"
    # A second replica takes the next slice of the same layout: no second change.
    second = await client.running(
        await client.submitted_share({"count": 1, "memory_gib": 12}, inference=True)
    )
    assert second["allocated"] == job["allocated"]
    assert second["share"]["mig_slice"] == 1
    assert len(await client.all_events(client.s.command("agent", T.MIG_CONFIGURE))) == 1


async def test_a_second_layout_change_of_a_gpu_within_the_hour_is_deferred(
    admission_settings: Settings, client: SharingClient, tmp_path: Path
) -> None:
    path = tmp_path / "one-gpu.yaml"
    path.write_text(
        "nodes:\n  - {name: inf-00, pool: inference, gpu_model: A100-80GB, gpus: 1, "
        "cpu_milli: 32000, memory_mib: 262144}\n"
    )
    admission = admission_settings.admission.model_copy(update={"inventory_path": path})
    running = await start_admission(admission_settings.model_copy(update={"admission": admission}))
    try:
        small_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        await client.apply_mig(1)
        small = await client.running(small_id)
        await client.stopped(small, StopReason.COMPLETED)

        async def gpu_empty() -> bool:
            return not (await running.ledger()).allocations

        await eventually(gpu_empty, within=20)
        # 40 GiB needs a 3g.40gb, which the new layout lacks; the GPU changed < 1 h ago.
        large = await client.submitted_share({"count": 1, "memory_gib": 40}, inference=True)

        async def waiting() -> list[str] | None:
            reasons = await client.reasons(large)
            return reasons if any("no free MIG slice" in r for r in reasons) else None

        reasons = await eventually(waiting, within=20)
        assert any("at most once per interval" in r for r in reasons)
        assert (await client.job(large))["state"] == "queued"
        assert len(await client.all_events(client.s.command("agent", T.MIG_CONFIGURE))) == 1
    finally:
        await running.stop()


async def test_a_restart_keeps_mig_layouts_their_change_times_and_tenants(
    admission_settings: Settings, client: SharingClient
) -> None:
    first = await start_admission(admission_settings)
    try:
        job_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        await client.apply_mig(1)
        job = await client.running(job_id)
        fraction = await client.running(await client.submitted_share({"count": 1, "milli": 250}))
        # 40 GiB needs a 3g.40gb: the other GPU is re-laid out, not yet reported applied.
        large_id = await client.submitted_share({"count": 1, "memory_gib": 40}, inference=True)
        await client.at_least(client.s.command("agent", T.MIG_CONFIGURE), 2)
        before = await first.ledger()
    finally:
        await first.stop()
    second = await start_admission(admission_settings)
    try:
        after = await second.ledger()
        ref = GpuRef(job["allocated"][0]["node"], job["allocated"][0]["index"])
        assert after.layout_of(ref) == before.layout_of(ref) != ()
        assert after.layout_changed_at(ref) == before.layout_changed_at(ref)
        assert after.shared == before.shared
        assert set(after.allocations) == {job["allocation_id"], fraction["allocation_id"]}
        pending = GpuRef("inf-00", 1 - ref.index)
        assert after.layout_pending(pending) and after.layout_of(pending) == ("3g.40gb",) * 2
        again = await client.running(
            await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        )
        assert again["allocated"] == job["allocated"] and again["share"]["mig_slice"] == 1
        assert (await client.job(large_id))["state"] == "queued"
        await client.apply_mig(2)
        large = await client.running(large_id)
        assert large["share"]["mig_profile"] == "3g.40gb"
        assert len(await client.all_events(client.s.command("agent", T.MIG_CONFIGURE))) == 2
    finally:
        await second.stop()


async def test_the_day_mode_slices_empty_inference_gpus_once_within_the_hourly_limit(
    admission: Admission, client: SharingClient
) -> None:
    modes = MigModes(
        admission.rt.uow,
        admission.service.keeper,
        ModeSchedule(time(0, 0), time.max),  # day all day
        timedelta(hours=1),
        admission.service.scheduler.kick,
    )
    assert await modes.reconcile() == 2
    configures = await client.at_least(client.s.command("agent", T.MIG_CONFIGURE), 2)
    assert {tuple(e.data["profiles"]) for e in configures} == {("1g.10gb",) * 7}
    assert {e.data["node"] for e in configures} == {"inf-00"}  # training keeps whole GPUs
    assert await modes.reconcile() == 0
    # Night wants whole GPUs back, but not before an hour has passed.
    night = MigModes(
        admission.rt.uow,
        admission.service.keeper,
        ModeSchedule(time(0, 0), time(0, 0)),  # never day
        timedelta(hours=1),
        admission.service.scheduler.kick,
    )
    assert await night.reconcile() == 0
    job_id = await client.submitted_share({"count": 1, "memory_gib": 8}, True)
    await client.apply_mig(2)
    job = await client.running(job_id)
    assert job["share"]["mig_profile"] == "1g.10gb"


async def test_the_cluster_agent_applies_the_layout_and_the_replica_then_starts_there(
    admission: Admission, client: SharingClient, admission_settings: Settings, tmp_path: Path
) -> None:
    agent_settings = admission_settings.model_copy(
        update={"agent": AgentSettings(telemetry_interval_s=5.0, workdir=tmp_path / "agent")}
    )
    rt = ServiceRuntime("agent", "agent", agent_settings, None)
    await rt.start()
    agent = await start_agent(rt)
    task = asyncio.create_task(rt.run())
    try:
        job_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        job = await client.running(job_id)
        ref = GpuRef(job["allocated"][0]["node"], job["allocated"][0]["index"])
        assert agent.mig_layouts[ref] == ("2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb")
        assert job["share"]["mig_profile"] == "2g.20gb"

        async def started() -> bool:
            return job["allocation_id"] in agent.running_allocations

        await eventually(started, within=20)
    finally:
        await agent.close()
        rt.request_stop()
        await asyncio.wait_for(task, 20)
