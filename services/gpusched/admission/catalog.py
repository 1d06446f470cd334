"""What the cluster could ever give a job, from its inventory: the admission checks.

Pure: built from the inventory the ledger was restored from, so a submission is judged
against the GPUs the service actually schedules, not against the file on disk.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from typing import Protocol

from gpusched.contracts import errors, messages
from gpusched.contracts.messages import ApiError, GpuRequest, HostRequest, SubmitJob
from gpusched.domain.inventory import GpuRef, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import JobKind, PriorityClass
from gpusched.domain.quota import AboveMax, QuotaBook
from gpusched.domain.sharing import Overcommit, ShareAsk, mig_capable, smallest_profile

from .words import NAMED_KNOWN, models_words, some_of

WHOLE_GPU_MILLI = 1000
_MIB_PER_GIB = 1024
_HOST_SHARE_QUANTUM = Decimal("0.001")


class ErrorCode(StrEnum):
    INVALID = "invalid"
    UNKNOWN_GPU_MODEL = "unknown_gpu_model"
    UNSATISFIABLE = "unsatisfiable"
    UNSUPPORTED = "unsupported"
    NOT_FOUND = "not_found"
    UNKNOWN_TEAM = "unknown_team"
    OVER_QUOTA = "over_quota"
    PRIORITY_NOT_ALLOWED = "priority_not_allowed"
    NOT_HELD = "not_held"
    # The job is in a state the request cannot apply to (e.g. cancel a completed job).
    CONFLICT = "conflict"
    # A capability the team was not given (e.g. process workloads).
    FORBIDDEN = errors.FORBIDDEN


class Request(Protocol):
    """What placement reads of a job's request: a submitted ``SubmitJob``, or the
    ``queue.Ask`` a queued job keeps."""

    @property
    def kind(self) -> messages.JobKind: ...

    @property
    def gpus(self) -> GpuRequest: ...

    @property
    def host(self) -> HostRequest | None: ...


def refuse(code: ErrorCode, message: str) -> ApiError:
    return ApiError(code=code, message=message)


# Home pools whose GPUs a job of each kind may ever hold. Inference reaches shared GPUs
# only once they are lent to it, but all of them may be lent.
_REACHABLE: dict[JobKind, tuple[Pool, ...]] = {
    JobKind.TRAINING: (Pool.SHARED, Pool.TRAINING),
    JobKind.INFERENCE: (Pool.INFERENCE, Pool.SHARED),
}


@dataclass(frozen=True, slots=True)
class _Group:
    """GPUs that may form one gang: one home pool, one model."""

    pool: Pool
    model: str
    memory_mib: int  # the smallest GPU of the group, so a memory check never overpromises
    count: int


class Catalog:
    def __init__(
        self,
        inventory: Inventory,
        quotas: QuotaBook | None = None,
        overcommit: Overcommit | None = None,
        mig_change_interval: timedelta = timedelta(hours=1),
        *,
        process_without_quotas: bool = False,
    ) -> None:
        self.quotas = quotas
        self.process_without_quotas = process_without_quotas
        self.overcommit = overcommit or Overcommit()
        self.mig_change_interval = mig_change_interval
        self._inventory: Inventory | None = None
        self.follow(inventory)

    def follow(self, inventory: Inventory) -> None:
        """Judge against this inventory from now on (a node was added or removed)."""
        if self._inventory is inventory:
            return
        self._inventory = inventory
        self._nodes: dict[str, NodeSpec] = {node.name: node for node in inventory.nodes}
        counts: dict[tuple[Pool, str], list[int]] = {}
        # (home pool, model) with MIG-enabled GPUs, and their memory; from the nodes of
        # now, so a node added later (the Kubernetes agent's) may give MIG slices too.
        self._mig: dict[tuple[Pool, str], int] = {}
        for node in inventory.nodes:
            for gpu in node.gpus:
                counts.setdefault((node.pool, gpu.model), []).append(gpu.memory_mib)
                if mig_capable(gpu.model) if node.mig is None else node.mig:
                    key = (node.pool, gpu.model)
                    self._mig[key] = min(self._mig.get(key, gpu.memory_mib), gpu.memory_mib)
        self._groups = tuple(
            _Group(pool, model, min(memories), len(memories))
            for (pool, model), memories in sorted(counts.items())
        )
        self.models = frozenset(group.model for group in self._groups)

    def refusal(self, job: SubmitJob) -> ApiError | None:
        """Why the job can never be admitted as asked, or None if it may be queued."""
        kind = JobKind(job.kind.value)
        priority = PriorityClass(job.priority_class.value)
        if priority.kind is not kind:
            return refuse(
                ErrorCode.INVALID,
                f"priority class {priority} is for {priority.kind} jobs, not {kind}",
            )
        if job.replicas is not None and kind is not JobKind.INFERENCE:
            return refuse(
                ErrorCode.INVALID,
                "replicas are for inference services: a training job is one gang "
                "(use gpus.count for its size)",
            )
        gpus = job.gpus
        if gpus.min_count is not None and gpus.min_count > gpus.count:
            return refuse(
                ErrorCode.INVALID,
                f"gpus.min_count ({gpus.min_count}) must not exceed gpus.count ({gpus.count})",
            )
        if _fraction(job) and gpus.count != 1:
            return refuse(
                ErrorCode.INVALID,
                f"a fraction of a GPU (milli={gpus.milli}) is for one GPU: set gpus.count to 1 "
                f"(not {gpus.count}), or ask whole GPUs (milli {WHOLE_GPU_MILLI})",
            )
        # A spec of several models may name some this cluster lacks; not all of them.
        unknown = [model for model in gpus.accepted if model not in self.models]
        if unknown and len(unknown) == len(gpus.accepted):
            return refuse(
                ErrorCode.UNKNOWN_GPU_MODEL,
                f"GPU model(s) {some_of([repr(model) for model in unknown])} not in the "
                f"inventory (known: {some_of(sorted(self.models), most=NAMED_KNOWN)})",
            )
        if (refusal := self._capability_refusal(job)) is not None:
            return refusal
        if gpus.count == 0:
            return self._quota_refusal(job, priority, []) or self._host_refusal(kind, job)
        if (refusal := self._host_refusal(kind, job)) is not None:
            return refusal
        groups = self._fitting(kind, job)
        if (refusal := self._quota_refusal(job, priority, groups)) is not None:
            return refusal
        largest = max((group.count for group in groups), default=0)
        if gpus.count > largest:
            wanted = _describe(job)
            if not groups:
                reason = "no GPU in the pools it may use fits it"
            else:
                reason = f"the largest gang the {kind} pools could ever give is {largest} GPUs"
            return refuse(
                ErrorCode.UNSATISFIABLE, f"asks {gpus.count} GPUs ({wanted}), but {reason}"
            )
        return None

    def _host_refusal(self, kind: JobKind, job: SubmitJob) -> ApiError | None:
        """A job whose host CPU or memory no node it may use could ever give."""
        host = job.host
        if host is None or not (host.cpu_milli or host.memory_mib):
            return None
        accepted = job.gpus.accepted
        per_node = max(job.gpus.count, 1)
        fits = [
            node
            for node in self._nodes.values()
            if node.pool in _REACHABLE[kind]
            and (not accepted or node.gpus[0].model in accepted)
            and node.cpu_milli * per_node >= host.cpu_milli * min(per_node, len(node.gpus))
            and node.memory_mib * per_node >= host.memory_mib * min(per_node, len(node.gpus))
        ]
        if fits:
            return None
        return refuse(
            ErrorCode.UNSATISFIABLE,
            f"asks {host.cpu_milli / 1000:g} CPU cores and {host.memory_mib} MiB of host memory"
            f"{' per node' if per_node > 1 else ''}, more than any node it may use has",
        )

    def _capability_refusal(self, job: SubmitJob) -> ApiError | None:
        """A `process` workload is a command the cluster agent runs for the team: only
        for teams an operator allowed (allow_process in the quotas file)."""
        if job.workload.kind != "process":
            return None
        if self.quotas is None:
            if self.process_without_quotas:
                return None
            return refuse(
                ErrorCode.FORBIDDEN,
                f"team {job.team} may not submit process workloads: they are off without "
                f"a quotas file; ask an operator to set allow_process for team {job.team} in "
                "the quotas file (or allow_process_workloads_without_quotas)",
            )
        team = self.quotas.team(job.team)
        if team is None or team.allow_process:
            return None  # an unknown team is refused next, naming the known ones
        return refuse(
            ErrorCode.FORBIDDEN,
            f"team {job.team} may not submit process workloads; ask an operator to set "
            f"allow_process for team {job.team} in the quotas file",
        )

    def _quota_refusal(
        self, job: SubmitJob, priority: PriorityClass, groups: list[_Group]
    ) -> ApiError | None:
        if self.quotas is None:
            return None
        team = self.quotas.team(job.team)
        if team is None:
            return refuse(
                ErrorCode.UNKNOWN_TEAM,
                f"team {job.team!r} has no quota (known teams: "
                f"{some_of(sorted(self.quotas.teams), most=NAMED_KNOWN)}); "
                "ask an operator to add it",
            )
        if not team.allows(priority) and team.above_max is AboveMax.REJECT:
            return refuse(
                ErrorCode.PRIORITY_NOT_ALLOWED,
                f"team {job.team} may use priority classes up to {team.max_priority}, "
                f"not {priority}; resubmit with {team.max_priority} or lower",
            )
        models = sorted({group.model for group in groups})
        most = team.largest_max(models)
        if models and job.gpus.count > most:
            return refuse(
                ErrorCode.OVER_QUOTA,
                f"asks {job.gpus.count} GPUs, but team {job.team} may hold at most {most} of "
                f"{some_of(models, ' or ')} (its max, borrowing included)",
            )
        return None

    def held_for_approval(self, job: SubmitJob) -> bool:
        """Above the team's max priority class, where its policy holds rather than rejects."""
        if self.quotas is None:
            return False
        team = self.quotas.team(job.team)
        priority = PriorityClass(job.priority_class.value)
        return team is not None and not team.allows(priority)

    def share_ask(self, job: Request, now: datetime | None) -> ShareAsk | None:
        """Part of one GPU, or None for whole GPUs: a fraction (milli < 1000), or a MIG
        slice for an inference job of one GPU asking less memory than a MIG GPU has."""
        gpus = job.gpus
        if not gpus.count:
            return None
        memory = None if gpus.memory_gib is None else math.ceil(gpus.memory_gib * _MIB_PER_GIB)
        if _fraction(job):
            return ShareAsk(gpus.milli, memory, self.overcommit)
        if self._mig_models(job) and memory is not None:
            return ShareAsk(None, memory, self.overcommit, now, self.mig_change_interval)
        return None

    def _mig_models(self, job: Request) -> dict[str, int]:
        """MIG models (with their memory) a MIG slice for this job may come from."""
        gpus = job.gpus
        if (
            job.kind.value != JobKind.INFERENCE
            or gpus.count != 1
            or gpus.milli is not None
            or gpus.memory_gib is None
        ):
            return {}
        return {
            model: memory
            for (pool, model), memory in self._mig.items()
            if pool is Pool.INFERENCE
            and (not gpus.accepted or model in gpus.accepted)
            and gpus.memory_gib * _MIB_PER_GIB < memory
            and smallest_profile(model, gpus.memory_gib) is not None
        }

    def models_to_try(self, job: Request) -> tuple[str, ...]:
        """The GPU models a placement may use (empty: any): the accepted ones that hold
        the job's GPU memory in the pools it may use. Which of them is the ledger's
        choice (its placement score weighs each model's scarcity); a job without GPUs
        names none."""
        if not job.gpus.count:
            return ()
        if mig := self._mig_models(job):
            # A MIG slice: the smallest MIG GPUs first, as for whole GPUs.
            return tuple(sorted(mig, key=lambda model: (mig[model], model)))
        accepted = job.gpus.accepted
        if job.gpus.memory_gib is None and self.quotas is None:
            return accepted
        fitting = {group.model for group in self._fitting(JobKind(job.kind.value), job)}
        return tuple(sorted(fitting))

    def host_share(
        self, gpus: Iterable[GpuRef], milli: int = WHOLE_GPU_MILLI
    ) -> tuple[Decimal, Decimal]:
        """CPU cores and memory GB that come with these GPUs: each node's share per GPU
        (times ``milli``/1000 for a part of one GPU)."""
        cores = memory_gb = Decimal(0)
        for ref in gpus:
            node = self._nodes[ref.node]
            per_gpu = Decimal(milli) / WHOLE_GPU_MILLI / len(node.gpus)
            cores += Decimal(node.cpu_milli) / WHOLE_GPU_MILLI * per_gpu
            memory_gb += Decimal(node.memory_mib) / _MIB_PER_GIB * per_gpu
        return cores.quantize(_HOST_SHARE_QUANTUM), memory_gb.quantize(_HOST_SHARE_QUANTUM)

    def _fitting(self, kind: JobKind, job: Request) -> list[_Group]:
        memory = job.gpus.memory_gib
        # A fraction's memory cap may exceed one GPU's memory by the overcommit factor.
        factor = self.overcommit.factor(kind is JobKind.TRAINING) if _fraction(job) else 1.0
        return [
            group
            for group in self._groups
            if group.pool in _REACHABLE[kind]
            and (not job.gpus.accepted or group.model in job.gpus.accepted)
            and (memory is None or group.memory_mib * factor >= memory * _MIB_PER_GIB)
        ]


def _fraction(job: Request) -> bool:
    return job.gpus.milli is not None and job.gpus.milli < WHOLE_GPU_MILLI


def submission_warnings(job: SubmitJob) -> list[str]:
    warnings: list[str] = []
    if not job.gang:
        warnings.append("gang=false is not supported yet: the job is placed as one gang")
    return warnings


def _describe(job: SubmitJob) -> str:
    parts = [models_words(job.gpus.accepted)]
    if job.gpus.memory_gib is not None:
        parts.append(f">= {job.gpus.memory_gib:g} GiB each")
    return ", ".join(parts)
