"""Requests as a cluster trace states them, through admission on the real NATS and
PostgreSQL: several acceptable GPU models, host CPU and memory, jobs without GPUs.

The cluster: one P100 node (2 GPUs, 16 cores) and one T4 node (2 GPUs, 104 cores).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tests.support.admission import Admission, Client, start_admission, with_inventory

from gpusched.admission.app import NAME as ADMISSION
from gpusched.contracts.messages import StopReason, T
from gpusched.infra.settings import Settings

INVENTORY = """
nodes:
  - name: p100-00
    pool: shared
    gpu_model: P100
    gpus: 2
    cpu_milli: 16000
    memory_mib: 131072
  - name: t4-00
    pool: shared
    gpu_model: T4
    gpus: 2
    cpu_milli: 104000
    memory_mib: 524288
"""


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, INVENTORY)


def cpu_only(cpu_milli: int, name: str = "etl") -> dict[str, Any]:
    return {"name": name, "gpus": {"count": 0}, "host": {"cpu_milli": cpu_milli}}


async def test_a_job_accepting_several_models_runs_on_one_of_them(
    admission: Admission, client: Client
) -> None:
    job = await client.job_in(
        await client.submitted(gpus={"count": 2, "models": ["V100M16", "P100"]}), "running"
    )

    assert {gpu["model"] for gpu in job["allocated"]} == {"P100"}
    assert job["gpus"]["models"] == ["V100M16", "P100"]


async def test_a_job_without_gpus_runs_on_a_node_and_is_billed_the_cpu_it_asked(
    admission: Admission, client: Client
) -> None:
    job_id = await client.submitted(**cpu_only(12_000))

    job = await client.job_in(job_id, "running")
    [granted] = await client.events(client.s.event(ADMISSION, T.ALLOCATION_GRANTED), 1)
    [start] = await client.events(client.s.command("agent", T.START_WORKLOAD), 1)
    assert job["allocated"] == [] and job["node"] in {"p100-00", "t4-00"}
    assert job["host"] == {"cpu_milli": 12_000, "memory_mib": 0}
    assert granted.data["gpus"] == [] and granted.data["node"] == job["node"]
    assert granted.data["cpu_cores"] == "12.000"
    assert start.data["node"] == job["node"]
    [placed] = await client.audits("job.placed", job_id, 1)
    assert "no GPU" in placed.data["reason"]


async def test_host_cpu_held_by_running_jobs_survives_a_restart_and_frees_on_release(
    admission_settings: Settings, client: Client
) -> None:
    first = await start_admission(admission_settings)
    try:
        # 100 of the cluster's 120 cores: whatever node it lands on, no 90-core job fits.
        big = await client.job_in(await client.submitted(**cpu_only(100_000, "big")), "running")
        waiting = await client.submitted(**cpu_only(90_000, "waits"))
        await client.audits("job.waiting", waiting, 1)
    finally:
        await first.stop()

    second = await start_admission(admission_settings)
    try:
        # The rebuilt ledger still holds the running job's CPU.
        assert (await client.job(waiting))["state"] == "queued"
        await client.stopped(big, StopReason.COMPLETED)
        await client.job_in(waiting, "running")
    finally:
        await second.stop()


@pytest.mark.parametrize(
    ("fields", "code", "field"),
    [
        ({"gpus": {"count": 0}}, "invalid", "host"),
        ({"gpus": {"count": 0}, "host": {"cpu_milli": 0}}, "invalid", "host"),
        ({"gpus": {"count": 0, "milli": 500}, "host": {"cpu_milli": 1000}}, "invalid", "gpus"),
        ({"gpus": {"count": 1, "model": "T4", "models": ["P100"]}}, "invalid", "gpus"),
        ({"gpus": {"count": 1, "models": []}}, "invalid", "gpus.models"),
        ({"gpus": {"count": 1}, "host": {"cpu_milli": -1}}, "invalid", "host.cpu_milli"),
        ({"gpus": {"count": 1, "models": ["A10", "H100-80GB"]}}, "unknown_gpu_model", None),
        ({"gpus": {"count": 0}, "host": {"cpu_milli": 200_000}}, "unsatisfiable", None),
        ({"gpus": {"count": 2, "models": ["P100"]}, "host": {"cpu_milli": 40_000}},
         "unsatisfiable", None),
    ],
    ids=["no-gpu-no-host", "no-gpu-empty-host", "no-gpu-with-milli", "model-and-models",
         "empty-models", "negative-cpu", "no-model-of-the-inventory", "cpu-beyond-every-node",
         "cpu-beyond-the-models-nodes"],
)  # fmt: skip
async def test_a_request_the_cluster_cannot_read_or_serve_is_refused_naming_why(
    admission: Admission, client: Client, fields: dict[str, Any], code: str, field: str | None
) -> None:
    reply = await client.submit(**fields)

    assert reply["ok"] is False, reply
    assert reply["error"]["code"] == code
    assert reply["error"].get("field") == field
    assert await admission.rows("jobs") == 0
