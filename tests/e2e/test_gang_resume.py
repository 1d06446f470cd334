"""End to end with a real torchrun gang: 2 ranks, FSDP2-sharded state, gloo on CPU.

Every service runs as a real process; the simulated cluster agent launches torchrun
(examples/torchrun_train.py) as a `process` workload. An inference surge makes the
control plane ask the gang for a checkpoint; every rank saves its shards with
torch.distributed.checkpoint, rank 0 confirms the manifest once, the checkpoint service
verifies every file, the agent stops the gang, and when the surge is over a new gang
resumes from that checkpoint. The result must be bit-for-bit the one of a gang that
was never interrupted. Once on the local filesystem (with async_save), once on an
S3-compatible server (moto's server mode) that the service verifies by reading it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from gpusched.cli.stack import Stack
from gpusched.contracts.messages import GpuRequest, PriorityClassName, SubmitJob, T, WorkloadSpec
from gpusched.infra.settings import Settings
from gpusched.sdk.storage import Location
from tests.e2e.test_main_flow import Cluster, _stack_settings, cluster_on, start_stack
from tests.e2e.test_pytorch_resume import _attempt_running, _now, _progress_at_least, _state_is
from tests.support.gang import EXAMPLE, finished, launched, torchrun
from tests.support.waiting import eventually

torch = pytest.importorskip(
    "torch", reason="PyTorch is not installed (pip install -e '.[torch]'; `make test` does)"
)

STEPS = 400
STEP_SECONDS = "0.05"
_AWS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL",
        "AWS_EC2_METADATA_DISABLED")  # fmt: skip


def _gang_stack(settings: Settings, tmp_path: Path, extra: dict[str, str]) -> Iterator[Stack]:
    env = {
        "GPUSCHED_CHECKPOINT__GRACE_S": "90",
        "GPUSCHED_PREEMPTION__MIN_RUNTIME_S": "0",
        "GPUSCHED_ADMISSION__ALLOW_PROCESS_WORKLOADS_WITHOUT_QUOTAS": "true",
        "GPUSCHED_AGENT__RUN_AS": "root",
        "GPUSCHED_AGENT__ALLOW_ROOT_WORKLOADS": "true",
        # torchrun's own stop after SIGTERM, then the workers' client flush.
        **extra,
    }
    yield from start_stack(_stack_settings(settings, tmp_path), tmp_path, env)


@pytest.fixture
def stack_local(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    yield from _gang_stack(settings, tmp_path, {})


@pytest.fixture
def stack_s3(settings: Settings, tmp_path: Path, s3: dict[str, str]) -> Iterator[Stack]:
    yield from _gang_stack(
        settings,
        tmp_path,
        {
            **s3,
            "GPUSCHED_CHECKPOINT__VERIFY_SCHEMES": '["file", "s3"]',
            "GPUSCHED_AGENT__WORKLOAD_ENV": json.dumps(list(_AWS)),
        },
    )


@pytest.fixture
async def local_cluster(stack_local: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack_local.settings):
        yield c


@pytest.fixture
async def s3_cluster(stack_s3: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack_s3.settings):
        yield c


@pytest.mark.timeout(420)
async def test_a_torchrun_gang_evicted_in_a_surge_resumes_every_rank_to_the_uninterrupted_result(
    local_cluster: Cluster, tmp_path: Path
) -> None:
    checkpoint = await _surge_evict_resume(local_cluster, tmp_path, "--async-save")
    assert checkpoint["uri"].startswith("file:///")


@pytest.mark.timeout(420)
async def test_the_same_gang_checkpointing_to_s3_resumes_from_there_to_the_same_result(
    s3_cluster: Cluster, tmp_path: Path
) -> None:
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    Location.of(f"s3://{bucket}").fs.mkdir(bucket)
    checkpoint = await _surge_evict_resume(
        s3_cluster, tmp_path, "--checkpoints", f"s3://{bucket}/gang"
    )
    assert checkpoint["uri"].startswith(f"s3://{bucket}/gang/step-")
    manifest = Location.of(checkpoint["uri"])
    assert manifest.fs.exists(manifest.path)


async def _surge_evict_resume(cluster: Cluster, tmp_path: Path, *options: str) -> dict[str, object]:
    reference, result = tmp_path / "uninterrupted.pt", tmp_path / "resumed.pt"
    log = tmp_path / "uninterrupted.log"
    argv = torchrun(EXAMPLE, "--standalone", "--steps", str(STEPS), "--result", str(reference))
    async with launched(argv, {}, log) as baseline:
        job = await _submit(cluster, result, options)
        others = [
            await cluster.submit("p1", PriorityClassName.P1_NORMAL, 16),
            await cluster.submit("p0", PriorityClassName.P0_URGENT, 16),
        ]
        for j in (job, *others):
            await eventually(lambda j=j: _state_is(cluster, j, "running"), within=90)
        await eventually(lambda: _progress_at_least(cluster, job, 20), within=120)

        await cluster.demand(22.0)
        [completed] = await eventually(
            lambda: _now(cluster.bus.of(T.EVICTION_COMPLETED, job_id=job)), within=120
        )
        checkpoint = completed["checkpoint"]
        assert 0 < checkpoint["step"] < STEPS, "the eviction came after the run had finished"
        # Exactly one confirmation per stage for the request: rank 0 spoke for the gang.
        [request] = cluster.bus.of(T.CHECKPOINT_REQUESTED, job_id=job)
        answers = [
            d for _, d in cluster.bus.confirmations(job) if d["request_id"] == request["request_id"]
        ]
        assert sorted(d["stage"] for d in answers) == ["persisted", "snapshotted"]
        assert {d["kind"] for d in answers} == {"manifest"}
        assert {d["checkpoint_id"] for d in answers} == {checkpoint["checkpoint_id"]}
        [stopped] = cluster.bus.of(T.WORKLOAD_STOPPED, saga_id=completed["saga_id"])
        assert stopped["reason"] == "evicted"
        assert not result.exists()

        await cluster.demand(2.0)
        await eventually(lambda: _attempt_running(cluster, job, 2), within=120)
        started = await eventually(
            lambda: _now([
                d for _, _, t, d, corr in cluster.bus.messages
                if t == T.JOB_STARTED and corr == job and d.get("resumed_from")
            ]),
            within=120,
        )  # fmt: skip
        assert started[-1]["resumed_from"] == checkpoint["checkpoint_id"]
        await eventually(lambda: _now(cluster.bus.of(T.JOB_COMPLETED, job_id=job)), within=180)
        assert await finished(baseline, log, 120) == 0

    expected = torch.load(reference, weights_only=True)
    got = torch.load(result, weights_only=True)
    assert got["steps"] == expected["steps"] == STEPS
    assert expected["params"].keys() == got["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name
    return dict(checkpoint)


async def _submit(cluster: Cluster, result: Path, options: tuple[str, ...]) -> str:
    argv = torchrun(EXAMPLE, "--steps", str(STEPS), "--step-seconds", STEP_SECONDS,
                    "--result", str(result), *options)  # fmt: skip
    argv[0] = "python"  # the agent runs its own interpreter
    reply = await cluster.api.submit(
        SubmitJob(
            name="gang",
            team="e2e",
            priority_class=PriorityClassName.P2_OFFLINE,
            gpus=GpuRequest(count=8),
            workload=WorkloadSpec(kind="process", argv=argv),
        )
    )
    assert reply.ok and reply.job_id, reply
    return reply.job_id
