"""The preemption service's projection of allocations with a share of one GPU (on the real
PostgreSQL): a shared GPU counts once as occupied; its training fractions are victim
candidates that know how many tenants the GPU has (the victim choice takes them
together); a MIG slice is none, and still counts as its GPU's tenant."""

from __future__ import annotations

from datetime import UTC, datetime

from gpusched.contracts.messages import (
    AllocationGranted,
    GpuRef,
    GpuShare,
    JobKind,
    PriorityClassName,
)
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings
from gpusched.preemption import app, store

NOW = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def granted(allocation_id: str, index: int, share: GpuShare | None) -> AllocationGranted:
    return AllocationGranted(
        allocation_id=allocation_id,
        job_id=f"job-{allocation_id}",
        team="vision",
        kind=JobKind.TRAINING,
        priority_class=PriorityClassName.P2_OFFLINE,
        pool="shared",
        gpus=[GpuRef(node="shared-00", index=index, model="A100-80GB")],
        granted_at=NOW,
        attempt=1,
        checkpointable=True,
        share=share,
    )


async def test_fractional_tenants_count_their_gpu_once_and_are_candidates_together(
    settings: Settings,
) -> None:
    rt = ServiceRuntime(app.NAME, app.SCHEMA, settings, migrations_dir(app.__file__))
    await rt.start()
    try:
        async with rt.uow() as uow:
            await store.add_allocation(uow, granted("whole", 0, None))
            for name in ("frac-a", "frac-b"):
                await store.add_allocation(uow, granted(name, 1, GpuShare(milli=400, memory_mib=1)))
            sliced = GpuShare(milli=285, memory_mib=10240, mig_profile="2g.20gb", mig_slice=0)
            await store.add_allocation(uow, granted("slice", 2, sliced))
            await store.add_allocation(uow, granted("frac-c", 2, GpuShare(milli=100, memory_mib=1)))
            await uow.commit()
        async with rt.uow() as uow:
            assert await store.shared_allocated_gpus(uow) == 3  # GPU 0 whole, 1 and 2 shared
            found = {c.allocation_id: c for c in (await store.candidates(uow)).usable}
    finally:
        await rt.close()
    assert sorted(found) == ["frac-a", "frac-b", "frac-c", "whole"]
    assert (found["whole"].share, found["whole"].tenants) == (1.0, 1)
    assert (found["frac-a"].share, found["frac-a"].tenants) == (0.4, 2)
    # The MIG slice is no candidate, but holds GPU 2: frac-c alone cannot free it.
    assert found["frac-c"].tenants == 2
