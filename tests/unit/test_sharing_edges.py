"""What the edges make of a share of a GPU: billing charges the share, the cluster agent
turns it into NVIDIA MPS limits. Pure functions, no I/O."""

from __future__ import annotations

from gpusched.agent.workloads import mps_environment
from gpusched.billing.handlers import gpu_milli_by_model
from gpusched.contracts.messages import GpuRef, GpuShare

A100 = [GpuRef(node="n0", index=3, model="A100-80GB")]


def test_billing_charges_a_fraction_its_milli_and_a_mig_slice_its_compute_slices() -> None:
    assert gpu_milli_by_model(A100) == {"A100-80GB": 1000}
    assert gpu_milli_by_model(A100, GpuShare(milli=250, memory_mib=20480)) == {"A100-80GB": 250}
    slice_2g = GpuShare(milli=285, memory_mib=20480, mig_profile="2g.20gb", mig_slice=0)
    assert gpu_milli_by_model(A100, slice_2g) == {"A100-80GB": 285}


def test_a_fraction_becomes_an_mps_thread_percentage_and_pinned_memory_limit() -> None:
    env = mps_environment(GpuShare(milli=255, memory_mib=20480))
    assert env == {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "26",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
    }
    assert (
        mps_environment(GpuShare(milli=1, memory_mib=1))["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "1"
    )


def test_whole_gpus_and_mig_slices_get_no_mps_limits() -> None:
    assert mps_environment(None) == {}
    mig = GpuShare(milli=142, memory_mib=10240, mig_profile="1g.10gb", mig_slice=2)
    assert mps_environment(mig) == {}
