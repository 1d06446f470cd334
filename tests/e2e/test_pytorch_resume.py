"""End to end with a real PyTorch training loop (examples/torch_train.py).

Every service runs as a real process; the simulated cluster agent launches the script
as a `process` workload. An inference surge makes the control plane ask it for a
checkpoint; it saves one, the agent terminates it, and when the surge is over a new
process resumes from that checkpoint. The result must be bit-for-bit the one of a run
that was never interrupted.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusched.cli.stack import Stack
from gpusched.contracts.messages import GpuRequest, PriorityClassName, SubmitJob, T, WorkloadSpec
from gpusched.infra.settings import Settings
from tests.e2e.test_main_flow import Cluster, _stack_settings, cluster_on, start_stack
from tests.support.waiting import eventually

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install -e '.[torch]'; `make test` does)"
)

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "torch_train.py"
STEPS = 500
STEP_SECONDS = "0.04"


@pytest.fixture
def stack_torch(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    extra = {
        "GPUSCHED_CHECKPOINT__GRACE_S": "60",
        # Preemptible from its first step: the run is seconds long, not hours.
        "GPUSCHED_PREEMPTION__MIN_RUNTIME_S": "0",
        # A process workload is a capability an operator gives: no quotas file here.
        "GPUSCHED_ADMISSION__ALLOW_PROCESS_WORKLOADS_WITHOUT_QUOTAS": "true",
        # The test's interpreter (with torch) and its result path may be where only the
        # test's user can read them: under root, the agent is allowed to keep it.
        "GPUSCHED_AGENT__RUN_AS": "root",
        "GPUSCHED_AGENT__ALLOW_ROOT_WORKLOADS": "true",
    }
    yield from start_stack(_stack_settings(settings, tmp_path), tmp_path, extra)


@pytest.fixture
async def torch_cluster(stack_torch: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack_torch.settings):
        yield c


async def _uninterrupted(result: Path) -> None:
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(SCRIPT), "--standalone", "--steps", str(STEPS), "--result", str(result)
    )
    assert await process.wait() == 0


async def test_a_pytorch_job_evicted_in_a_surge_resumes_to_exactly_the_uninterrupted_result(
    torch_cluster: Cluster, tmp_path: Path
) -> None:
    cluster = torch_cluster
    reference, result = tmp_path / "uninterrupted.pt", tmp_path / "resumed.pt"
    baseline = asyncio.create_task(_uninterrupted(reference))

    reply = await cluster.api.submit(
        SubmitJob(
            name="torch",
            team="e2e",
            priority_class=PriorityClassName.P2_OFFLINE,
            gpus=GpuRequest(count=8),
            workload=WorkloadSpec(
                kind="process",
                argv=[
                    "python", str(SCRIPT), "--steps", str(STEPS),
                    "--step-seconds", STEP_SECONDS, "--result", str(result),
                ],
            ),
        )
    )  # fmt: skip
    assert reply.ok and reply.job_id
    job = reply.job_id
    # The rest of the shared pool is taken, so the surge can only be served by the p2 job.
    others = [
        await cluster.submit("p1", PriorityClassName.P1_NORMAL, 16),
        await cluster.submit("p0", PriorityClassName.P0_URGENT, 16),
    ]
    for j in (job, *others):
        await eventually(lambda j=j: _state_is(cluster, j, "running"), within=60)
    # Training for real (torch imported, steps done) before the surge.
    await eventually(lambda: _progress_at_least(cluster, job, 20), within=60)

    await cluster.demand(22.0)
    [completed] = await eventually(
        lambda: _now(cluster.bus.of(T.EVICTION_COMPLETED, job_id=job)), within=60
    )
    checkpoint = completed["checkpoint"]
    assert 0 < checkpoint["step"] < STEPS, "the eviction came after the run had finished"
    [request] = cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=job)
    evict_at = cluster.bus.index(T.EVICT_WORKLOAD, job_id=job)
    assert evict_at is not None and any(
        i < evict_at
        for i, d in cluster.bus.confirmations(job)
        if d["request_id"] == request["request_id"]
        and d["checkpoint_id"] == checkpoint["checkpoint_id"]
    )
    # The agent terminated the process itself, for this saga.
    [stopped] = cluster.bus.of(T.WORKLOAD_STOPPED, saga_id=completed["saga_id"])
    assert stopped["reason"] == "evicted"
    assert not result.exists()

    await cluster.demand(2.0)
    await eventually(lambda: _attempt_running(cluster, job, 2), within=90)
    # The new process announces where it resumed from once torch is imported.
    started = await eventually(
        lambda: _now([
            d for _, _, t, d, corr in cluster.bus.messages
            if t == T.JOB_STARTED and corr == job and d.get("resumed_from")
        ]),
        within=60,
    )  # fmt: skip
    assert started[-1]["resumed_from"] == checkpoint["checkpoint_id"]
    await eventually(lambda: _now(cluster.bus.of(T.JOB_COMPLETED, job_id=job)), within=90)
    await baseline

    expected = torch.load(reference, weights_only=True)
    got = torch.load(result, weights_only=True)
    assert got["steps"] == expected["steps"] == STEPS
    assert torch.equal(got["loss"], expected["loss"])
    assert expected["params"].keys() == got["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name


async def _state_is(cluster: Cluster, job_id: str, state: str) -> bool:
    return await cluster.state(job_id) == state


async def _attempt_running(cluster: Cluster, job_id: str, attempt: int) -> bool:
    reply = await cluster.api.get(job_id)
    return bool(reply.job and reply.job.state == "running" and reply.job.attempt >= attempt)


async def _progress_at_least(cluster: Cluster, job_id: str, step: int) -> bool:
    return any(
        t == T.JOB_PROGRESS and corr == job_id and d.get("step", 0) >= step
        for _, _, t, d, corr in cluster.bus.messages
    )


async def _now(value: Any) -> Any:
    return value
