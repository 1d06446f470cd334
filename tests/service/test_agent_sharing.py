"""The cluster agent's process workload of a fractional tenant sees its limits the way
NVIDIA MPS takes them (a real child process, no bus needed)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from gpusched.agent.workloads import ProcessWorkload
from gpusched.contracts.messages import GpuRef, GpuShare, StartWorkload, StopReason, WorkloadSpec

_DUMP_ENV = (
    "import json, os, sys; "
    "json.dump({k: v for k, v in os.environ.items() if k.startswith('CUDA_MPS')}, "
    "open(sys.argv[1], 'w'))"
)


async def test_a_fractional_workload_sees_its_mps_compute_share_and_memory_cap(
    tmp_path: Path,
) -> None:
    seen = tmp_path / "env.json"
    start = StartWorkload(
        allocation_id="alloc-frac",
        job_id="job-frac",
        attempt=1,
        gpus=[GpuRef(node="inf-00", index=1, model="A100-80GB")],
        workload=WorkloadSpec(kind="process", argv=[sys.executable, "-c", _DUMP_ENV, str(seen)]),
        share=GpuShare(milli=400, memory_mib=32768),
    )
    workload = ProcessWorkload(
        start, nats_url="nats://127.0.0.1:1", prefix="t", workdir=tmp_path, base_env={}
    )
    await workload.launch()
    result = await workload.wait()

    assert result.reason is StopReason.COMPLETED
    assert json.loads(seen.read_text()) == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "40",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=32768M",
    }
