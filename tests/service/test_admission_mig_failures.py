"""A MIG layout change that fails, in the admission service on the real NATS and
PostgreSQL: the agent's failure report and the apply timeout give the GPU back its
previous layout, the replica that waited for the slices is placed elsewhere or told why
it waits, and a report for a change that is no longer pending is ignored and audited.

The cluster: one inference node (2 x A100-80GB, MIG-capable); some tests use one GPU.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from tests.service.test_admission_sharing import SharingClient
from tests.support.admission import Admission, Client, start_admission, with_inventory
from tests.support.waiting import eventually

from gpusched.agent.app import start_agent
from gpusched.contracts.messages import GpuRef as WireGpu
from gpusched.contracts.messages import (
    MigConfigure,
    MigConfigureFailed,
    StartWorkload,
    T,
    WorkloadSpec,
)
from gpusched.domain.inventory import GpuRef
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import AgentSettings, Settings

TWO_GPUS = """
nodes:
  - name: inf-00
    pool: inference
    gpu_model: A100-80GB
    gpus: 2
    cpu_milli: 32000
    memory_mib: 262144
"""

ONE_GPU = TWO_GPUS.replace("gpus: 2", "gpus: 1")


def with_timeout(settings: Settings, seconds: float) -> Settings:
    admission = settings.admission.model_copy(update={"mig_apply_timeout_s": seconds})
    return settings.model_copy(update={"admission": admission})


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, TWO_GPUS)


@pytest.fixture
def client_class() -> type[Client]:
    return SharingClient


async def configures(client: SharingClient, count: int) -> list[dict[str, Any]]:
    found = await client.at_least(client.s.command("agent", T.MIG_CONFIGURE), count)
    return [e.data for e in found]


async def report_failed(client: SharingClient, command: dict[str, Any], error: str) -> None:
    await client.publish(
        client.s.event("agent", T.MIG_CONFIGURE_FAILED),
        T.MIG_CONFIGURE_FAILED,
        MigConfigureFailed(
            change_id=command["change_id"],
            node=command["node"],
            gpu=command["gpu"],
            error=error,
            time=datetime.now(UTC),
        ),
    )


def gpu_of(command: dict[str, Any]) -> GpuRef:
    return GpuRef(command["node"], command["gpu"])


async def waits_for_a_slice(client: SharingClient, job_id: str) -> list[str]:
    async def check() -> list[str] | None:
        reasons = await client.reasons(job_id)
        return reasons if any("no free MIG slice" in r for r in reasons) else None

    return await eventually(check, within=20)


async def test_a_reported_failure_drops_the_slices_and_the_replica_is_placed_on_the_other_gpu(
    admission: Admission, client: SharingClient
) -> None:
    job_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
    (first,) = await configures(client, 1)
    await report_failed(client, first, "GPU busy")
    (failed,) = await client.audits("mig.layout_failed", str(gpu_of(first)), 1)
    assert failed.data["details"]["cause"] == "reported"
    assert failed.data["details"]["error"] == "GPU busy"
    assert failed.data["details"]["restored"] == []
    # The next pass re-lays out the other GPU (the failed one changed < 1 h ago).
    _, second = await configures(client, 2)
    assert gpu_of(second) != gpu_of(first)
    ledger = await admission.ledger()
    assert ledger.layout_of(gpu_of(first)) == ()
    assert not ledger.layout_pending(gpu_of(first))
    assert ledger.layout_changed_at(gpu_of(first)) is not None  # still rations changes
    await client.report_applied(second)
    job = await client.running(job_id)
    assert (job["allocated"][0]["node"], job["allocated"][0]["index"]) == (
        second["node"],
        second["gpu"],
    )


async def test_without_a_report_in_time_the_change_fails_and_the_replica_waits_saying_why(
    settings: Settings, client: SharingClient, tmp_path: Path
) -> None:
    one_gpu = with_timeout(with_inventory(settings, tmp_path, ONE_GPU), 1.0)
    running = await start_admission(one_gpu)
    try:
        job_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        (command,) = await configures(client, 1)
        ref = str(gpu_of(command))
        (failed,) = await client.audits("mig.layout_failed", ref, 1)
        assert failed.data["details"]["cause"] == "timeout"
        assert failed.data["details"]["change_id"] == command["change_id"]
        assert not (await running.ledger()).layout_pending(gpu_of(command))
        reasons = await waits_for_a_slice(client, job_id)
        assert any("at most once per interval" in r for r in reasons)
        assert (await client.job(job_id))["state"] == "queued"
        # A late report of the given-up change: ignored, audited, the GPU stays whole.
        await client.report_applied(command)
        (ignored,) = await client.audits("mig.report_ignored", ref, 1)
        assert ignored.data["details"]["change_id"] == command["change_id"]
        assert (await running.ledger()).layout_of(gpu_of(command)) == ()
        assert (await client.job(job_id))["state"] == "queued"
        assert len(await configures(client, 1)) == 1
    finally:
        await running.stop()


async def test_a_failure_report_for_an_unknown_change_is_ignored_and_audited(
    admission: Admission, client: SharingClient
) -> None:
    await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
    (command,) = await configures(client, 1)
    await report_failed(client, command | {"change_id": "mig-000000000000"}, "GPU busy")
    (ignored,) = await client.audits("mig.report_ignored", str(gpu_of(command)), 1)
    assert "no such change pending" in ignored.data["reason"]
    ledger = await admission.ledger()
    assert ledger.layout_pending(gpu_of(command))  # the real change still awaits its report
    assert await client.all_events(client.s.audit("mig.layout_failed")) == []


async def test_a_restart_keeps_a_pending_change_and_its_report_still_fails_it(
    admission_settings: Settings, client: SharingClient
) -> None:
    first = await start_admission(admission_settings)
    try:
        await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        (command,) = await configures(client, 1)
    finally:
        await first.stop()
    second = await start_admission(admission_settings)
    try:
        assert (await second.ledger()).layout_pending(gpu_of(command))
        await report_failed(client, command, "driver error")
        await client.audits("mig.layout_failed", str(gpu_of(command)), 1)
        assert (await second.ledger()).layout_of(gpu_of(command)) == ()
    finally:
        await second.stop()


async def test_the_simulated_agent_reports_a_change_on_a_down_node_failed(
    admission: Admission, client: SharingClient, admission_settings: Settings, tmp_path: Path
) -> None:
    agent_settings = admission_settings.model_copy(
        update={"agent": AgentSettings(telemetry_interval_s=5.0, workdir=tmp_path / "agent")}
    )
    rt = ServiceRuntime("agent", "agent", agent_settings, None)
    await rt.start()
    agent = await start_agent(rt)
    # The node died and admission has not heard yet: the change cannot be applied.
    agent.down_nodes.add("inf-00")
    task = asyncio.create_task(rt.run())
    try:
        job_id = await client.submitted_share({"count": 1, "memory_gib": 15}, inference=True)
        # One GPU fails, the replica is tried on the other, which fails too.
        reports = await client.at_least(client.s.event("agent", T.MIG_CONFIGURE_FAILED), 2)
        assert {r.data["error"] for r in reports} == {"node inf-00 is down"}
        refs = {GpuRef(r.data["node"], r.data["gpu"]) for r in reports}
        assert refs == {GpuRef("inf-00", 0), GpuRef("inf-00", 1)}
        for ref in refs:
            await client.audits("mig.layout_failed", str(ref), 1)
        assert agent.mig_layouts == {}
        reasons = await waits_for_a_slice(client, job_id)
        assert any("at most once per interval" in r for r in reasons)
    finally:
        await agent.close()
        rt.request_stop()
        await asyncio.wait_for(task, 20)


async def test_the_simulated_agent_refuses_a_change_of_a_gpu_that_still_runs_a_workload(
    client: SharingClient, admission_settings: Settings, tmp_path: Path
) -> None:
    agent_settings = admission_settings.model_copy(
        update={"agent": AgentSettings(telemetry_interval_s=5.0, workdir=tmp_path / "agent")}
    )
    rt = ServiceRuntime("agent", "agent", agent_settings, None)
    await rt.start()
    agent = await start_agent(rt)
    task = asyncio.create_task(rt.run())
    try:
        await client.publish(
            client.s.command("agent", T.START_WORKLOAD),
            T.START_WORKLOAD,
            StartWorkload(
                allocation_id="alloc-busy",
                job_id="job-busy",
                attempt=1,
                gpus=[WireGpu(node="inf-00", index=0, model="A100-80GB")],
                workload=WorkloadSpec(kind="sim", steps=100_000, step_seconds=0.05),
            ),
            source="admission",  # the agent takes workloads from admission only
        )

        async def started() -> bool:
            return "alloc-busy" in agent.running_allocations

        await eventually(started, within=20)
        await client.publish(
            client.s.command("agent", T.MIG_CONFIGURE),
            T.MIG_CONFIGURE,
            MigConfigure(
                change_id="mig-busy",
                node="inf-00",
                gpu=0,
                model="A100-80GB",
                profiles=["7g.80gb"],
            ),
            source="admission",
        )
        (report,) = await client.at_least(client.s.event("agent", T.MIG_CONFIGURE_FAILED), 1)
        assert report.data["change_id"] == "mig-busy"
        assert report.data["error"] == "GPU inf-00/0 still runs allocation alloc-busy"
        assert agent.mig_layouts == {}
    finally:
        await agent.close()
        rt.request_stop()
        await asyncio.wait_for(task, 20)
