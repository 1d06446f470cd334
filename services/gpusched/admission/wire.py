"""The messages admission emits, built from ledger events and job records."""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from gpusched.contracts import messages as m
from gpusched.domain import ledger as d
from gpusched.domain.inventory import GpuRef, Inventory, NodeSpec

from .credentials import Issued
from .store import JobRecord


def share(granted: d.AllocationGranted | d.Allocation) -> m.GpuShare | None:
    held = granted.share
    if held is None:
        return None
    return m.GpuShare(
        milli=held.milli, memory_mib=held.memory_mib, mig_profile=held.profile, mig_slice=held.slice
    )


def gpus(refs: Iterable[GpuRef], ledger: d.Ledger) -> list[m.GpuRef]:
    return [m.GpuRef(node=ref.node, index=ref.index, model=ledger.gpu(ref).model) for ref in refs]


def allocation_granted(
    granted: d.AllocationGranted,
    job: JobRecord,
    attempt: int,
    ledger: d.Ledger,
    host_share: tuple[Decimal, Decimal],
) -> m.AllocationGranted:
    cpu_cores, memory_gb = host_share
    spec = job.spec
    return m.AllocationGranted(
        allocation_id=granted.allocation_id,
        job_id=granted.job_id,
        team=granted.team,
        kind=m.JobKind(granted.kind.value),
        priority_class=m.PriorityClassName(granted.priority_class.value),
        pool=granted.pool,
        gpus=gpus(granted.gpus, ledger),
        granted_at=granted.granted_at,
        attempt=attempt,
        checkpointable=spec.checkpointable,
        resume_from=job.resume_from,
        workload=spec.workload,
        cpu_cores=cpu_cores,
        memory_gb=memory_gb,
        borrowed=granted.borrowed,
        share=share(granted),
    )


def start_workload(
    granted: d.AllocationGranted,
    job: JobRecord,
    attempt: int,
    ledger: d.Ledger,
    credentials: Issued | None = None,
) -> m.StartWorkload:
    return m.StartWorkload(
        allocation_id=granted.allocation_id,
        job_id=granted.job_id,
        attempt=attempt,
        gpus=gpus(granted.gpus, ledger),
        workload=job.spec.workload,
        resume_from=job.resume_from,
        share=share(granted),
        credentials=None if credentials is None else credentials.creds,
        credentials_expire_at=None if credentials is None else credentials.expire_at,
    )


def allocation_released(
    released: d.AllocationReleased, reason: str, ledger: d.Ledger
) -> m.AllocationReleased:
    return m.AllocationReleased(
        allocation_id=released.allocation_id,
        job_id=released.job_id,
        team=released.team,
        gpus=gpus(released.gpus, ledger),
        released_at=released.released_at,
        reason=reason,
    )


def inventory_loaded(inventory: Inventory) -> m.InventoryLoaded:
    return m.InventoryLoaded(nodes=[inventory_node(node) for node in inventory.nodes])


def inventory_node(node: NodeSpec) -> m.InventoryNode:
    return m.InventoryNode(
        name=node.name,
        pool=node.pool,
        # A node's GPUs share a model in every inventory format we read.
        gpu_model=node.gpus[0].model,
        gpus=len(node.gpus),
        gpu_groups=[list(group) for group in node.gpu_groups],
    )
