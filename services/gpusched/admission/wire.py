"""The messages admission emits, built from ledger events and job records."""

from __future__ import annotations

from collections.abc import Iterable
from decimal import Decimal

from gpusched.contracts import messages as m
from gpusched.domain import ledger as d
from gpusched.domain.inventory import GpuRef, Inventory, NodeSpec

from .credentials import Issued
from .store import JobRecord

_QUANTUM = Decimal("0.001")


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
    """``host_share``: the CPU cores and memory GB that come with its GPUs, billed when
    the job stated no host CPU and memory of its own (else what it holds is billed)."""
    cpu_cores, memory_gb = host_share
    spec = job.spec
    held = granted.allocation.host_held().values()
    if held and any(cpu or memory for cpu, memory in held):
        cpu_cores = (Decimal(sum(cpu for cpu, _ in held)) / 1000).quantize(_QUANTUM)
        memory_gb = (Decimal(sum(memory for _, memory in held)) / 1024).quantize(_QUANTUM)
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
        node=granted.node,
    )


def placed_words(granted: d.AllocationGranted) -> str:
    """What a grant holds, for the audit record of its placement."""
    if granted.node is not None:
        return f"host CPU and memory on node {granted.node} in the {granted.pool} pool (no GPU)"
    return f"{len(granted.gpus)} x {granted.model} free in the {granted.pool} pool"


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
        node=granted.node,
        credentials=None if credentials is None else credentials.creds,
        credentials_expire_at=None if credentials is None else credentials.expire_at,
    )


def allocation_released(
    released: d.AllocationReleased, reason: str, ledger: d.Ledger
) -> m.AllocationReleased:
    # `ledger` is after the release: a tenant left on a GPU is another allocation's.
    shared = ledger.shared
    held = [ref for ref in released.gpus if ref in shared and shared[ref].tenants]
    return m.AllocationReleased(
        allocation_id=released.allocation_id,
        job_id=released.job_id,
        team=released.team,
        gpus=gpus(released.gpus, ledger),
        released_at=released.released_at,
        reason=reason,
        still_held=gpus(held, ledger),
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
