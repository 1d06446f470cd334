"""Payload schemas, one pydantic model per message type, and the type registry.

Public contracts (DESIGN §4) come first; internal service-to-service messages after.
Every field is built from the types in `validation` (finite numbers, ranges, strict
numbers, string rules). Public models are tolerant readers: unknown optional fields are
ignored, so a newer producer is not dead-lettered by an older consumer. Internal models
forbid unknown fields, so a typo between our own services is an error.
"""

from __future__ import annotations

from decimal import Decimal
from enum import StrEnum
from typing import Annotated, Final, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gpusched.contracts.subjects import check_token, node_token
from gpusched.contracts.validation import (
    MAX_WORKLOAD_SECONDS,
    Argv,
    Attempt,
    Bytes,
    Count,
    CpuMilli,
    Credentials,
    Document,
    Fraction,
    GpuAsk,
    GpuCount,
    GpuIndex,
    Id,
    Instant,
    Latency,
    MiB,
    Milli,
    Name,
    ObservedAt,
    Power,
    Reason,
    Seconds,
    Step,
    Steps,
    StepSeconds,
    StrictFlag,
    Team,
    Temperature,
    Text,
    Uri,
    check_document,
)


class Wire(BaseModel):
    """An internal message: unknown fields are refused."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Public(Wire):
    """A public message: read tolerantly, unknown optional fields are ignored."""

    model_config = ConfigDict(frozen=True, extra="ignore", allow_inf_nan=False)


# ======================================================================================
# Public: job control (control plane -> job) on <p>.jobs.<job_id>.control
# ======================================================================================
# The envelope version of checkpoint.confirmed that adds `kind` (directory checkpoints).
CHECKPOINT_CONFIRMED_MANIFEST_VERSION: Final = 2


class StageName(StrEnum):
    SNAPSHOTTED = "snapshotted"
    PERSISTED = "persisted"


class CheckpointRequested(Public):
    request_id: Id
    job_id: Id
    reason: Text
    deadline: Instant
    stage_required: StageName


class PreemptionCancelled(Public):
    request_id: Id


class Resume(Public):
    checkpoint_id: Id
    uri: Uri


# ======================================================================================
# Public: job events (job -> control plane) on <p>.jobs.<job_id>.events
# ======================================================================================
class JobStarted(Public):
    job_id: Id
    attempt: Attempt
    resumed_from: Id | None = None


class JobProgress(Public):
    # Frameworks add their metrics: kept, as long as they are finite and bounded.
    model_config = ConfigDict(frozen=True, extra="allow", allow_inf_nan=False)
    step: Step

    @model_validator(mode="after")
    def _metrics_are_clean(self) -> JobProgress:
        if len(self.__pydantic_extra__ or {}) > 64:
            raise ValueError("at most 64 metrics")
        check_document(self.__pydantic_extra__ or {})
        return self


class CheckpointKind(StrEnum):
    """What a confirmation's uri, bytes and sha256 describe."""

    FILE = "file"  # the checkpoint itself: one object
    # A directory checkpoint (e.g. torch.distributed.checkpoint's shards): the uri names
    # its manifest (contracts.manifest), bytes and sha256 are those of the manifest, and
    # the manifest lists every file with its size and sha256.
    MANIFEST = "manifest"


class CheckpointConfirmed(Public):
    """v1: one file. v2 adds `kind` (default `file`, so a v1 message reads as v2 with
    kind=file); producers send v2 only for a manifest, so a single-file confirmation
    is still v1 and reads the same on a control plane that knows only v1."""

    request_id: Id | None
    checkpoint_id: Id
    step: Step
    uri: Uri
    bytes: Bytes
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    stage: StageName
    kind: CheckpointKind = CheckpointKind.FILE

    @property
    def version(self) -> int:
        """The envelope version this payload needs (the oldest that can carry it)."""
        return CHECKPOINT_CONFIRMED_MANIFEST_VERSION if self.kind is CheckpointKind.MANIFEST else 1


class CheckpointFailed(Public):
    request_id: Id | None
    error: Text


class JobCompleted(Public):
    job_id: Id
    step: Step | None = None


class JobFailed(Public):
    job_id: Id
    error: Text


# ======================================================================================
# Public: telemetry
# ======================================================================================
class GpuReading(Public):
    index: GpuIndex
    util: Fraction
    mem_used_mib: MiB
    mem_total_mib: MiB = Field(gt=0)
    temp_c: Temperature | None = None
    power_w: Power | None = None

    @model_validator(mode="after")
    def _used_within_total(self) -> GpuReading:
        if self.mem_used_mib > self.mem_total_mib:
            raise ValueError(
                f"mem_used_mib ({self.mem_used_mib}) exceeds mem_total_mib ({self.mem_total_mib})"
            )
        return self


class GpuSample(Public):
    node: Id
    time: ObservedAt
    gpus: list[GpuReading] = Field(max_length=1024)

    @field_validator("node")
    @classmethod
    def _node_has_token(cls, v: str) -> str:
        node_token(v)  # its telemetry subject names it
        return v

    @field_validator("gpus")
    @classmethod
    def _indexes_unique(cls, v: list[GpuReading]) -> list[GpuReading]:
        seen: set[int] = set()
        for reading in v:
            if reading.index in seen:
                raise ValueError(f"GPU index {reading.index} appears twice")
            seen.add(reading.index)
        return v


class InferenceStats(Public):
    service: Id
    time: ObservedAt
    window_s: Seconds = Field(gt=0)
    requests: Count
    queue_depth: Count
    p50_ms: Latency
    p99_ms: Latency

    @field_validator("service")
    @classmethod
    def _service_is_token(cls, v: str) -> str:
        return check_token(v, "service")


# ======================================================================================
# Public: audit on <p>.audit.<action>, stored in the stream <PREFIX>_AUDIT
# ======================================================================================
class AuditRecord(Public):
    action: Id
    actor: Name  # the service (or operator) that decided
    entity: Name  # what it is about: a job, allocation, saga, node ...
    reason: Text
    details: Document = Field(default_factory=dict)
    time: Instant


# ======================================================================================
# Public: jobs API (request/reply) on <p>.api.jobs.submit|get
# ======================================================================================
class JobKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"


class PriorityClassName(StrEnum):
    INFERENCE = "inference"
    P0_URGENT = "p0-urgent"
    P1_NORMAL = "p1-normal"
    P2_OFFLINE = "p2-offline"


# A GPU model as the inventory names it: never empty.
GpuModelName = Annotated[Name, Field(min_length=1)]


class GpuRequest(Public):
    # 0: a job of host CPU and memory alone (asked under `host`), placed on a GPU node.
    count: GpuAsk
    model: GpuModelName | None = None
    # Several acceptable GPU models, any one of them (a gang never mixes models), as a
    # trace's `V100M16|V100M32`; instead of `model`.
    models: list[GpuModelName] | None = Field(default=None, min_length=1, max_length=32)
    memory_gib: float | None = Field(default=None, gt=0, le=1024 * 1024, strict=True)
    milli: Milli | None = None
    # The fewest GPUs the job accepts after a long wait (DESIGN §7); None: exactly `count`.
    min_count: GpuCount | None = None

    @model_validator(mode="after")
    def _consistent(self) -> GpuRequest:
        if self.model is not None and self.models is not None:
            raise ValueError("give gpus.model or gpus.models, not both")
        if self.count == 0:
            asked = [
                name
                for name in ("model", "models", "memory_gib", "milli", "min_count")
                if getattr(self, name) is not None
            ]
            if asked:
                raise ValueError(
                    f"a job without GPUs (count 0) asks no {', '.join(asked)}; ask host "
                    "CPU and memory under `host`"
                )
        return self

    @property
    def accepted(self) -> tuple[str, ...]:
        """The models the job accepts, sorted (empty: any)."""
        if self.models is not None:
            return tuple(sorted(set(self.models)))
        return () if self.model is None else (self.model,)


class HostRequest(Public):
    """Host CPU and memory a job needs beside its GPUs (each replica of a service), on
    the node of its GPUs (split evenly across nodes for a gang that spans them)."""

    cpu_milli: CpuMilli = 0  # 1/1000 of a core
    memory_mib: MiB = 0


class WorkloadSpec(Public):
    """What the cluster agent runs. The simulated cluster understands the `sim`
    kind (a virtual training loop) and `process` (a real command, e.g. a PyTorch
    script that uses the SDK); the Kubernetes agent runs `pod` (the pod templates in
    `pod`: `{"pods": [{metadata, spec}, ...], "controller": kind or null}`)."""

    kind: Literal["sim", "process", "pod"] = "sim"
    steps: Steps = 1000
    # A simulated step takes at least a millisecond: a clock that advances by less
    # than its own resolution never reaches the next step (nor the end of the job).
    step_seconds: StepSeconds = 1.0
    checkpoint_seconds: Seconds = 0.5
    # A `sim` loop also saves (and confirms) a checkpoint every this many steps, as real
    # jobs do periodically: a crash of its node or agent then loses at most that much.
    checkpoint_every_steps: Steps | None = None
    argv: Argv = Field(default_factory=list)
    pod: Document | None = None

    @model_validator(mode="after")
    def _duration_bounded(self) -> WorkloadSpec:
        total = self.steps * self.step_seconds
        if total > MAX_WORKLOAD_SECONDS:
            raise ValueError(
                f"steps x step_seconds is {total:.3g} s; at most {MAX_WORKLOAD_SECONDS:.0e} s "
                "(about 31 years) of simulated training"
            )
        return self


class Replicas(Public):
    """An inference service's replicas, each with the job's `gpus` shape: `min` are
    placed together or not at all, more up to `max` as capacity allows."""

    min: GpuCount = 1
    max: GpuCount = 1

    @model_validator(mode="after")
    def _ordered(self) -> Replicas:
        if self.min > self.max:
            raise ValueError(f"replicas.min ({self.min}) must not exceed replicas.max ({self.max})")
        return self


class SubmitJob(Public):
    name: Name = Field(min_length=1)
    team: Team
    kind: JobKind = JobKind.TRAINING
    priority_class: PriorityClassName = PriorityClassName.P1_NORMAL
    gpus: GpuRequest
    gang: StrictFlag = True
    checkpointable: StrictFlag = True
    estimated_checkpoint_s: Seconds | None = None
    idempotency_key: Id | None = None
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    # Inference only; None: one replica, placed as the job's one allocation.
    replicas: Replicas | None = None
    # Host CPU and memory beside the GPUs; None: not accounted (a node's share per GPU
    # is billed). Required for a job without GPUs.
    host: HostRequest | None = Field(default=None, validate_default=True)

    @field_validator("team")
    @classmethod
    def _team_is_token(cls, v: str) -> str:
        return check_token(v, "team")

    @field_validator("host")
    @classmethod
    def _host_for_no_gpu(cls, v: HostRequest | None, info: ValidationInfo) -> HostRequest | None:
        gpus = info.data.get("gpus")
        if (
            gpus is not None
            and gpus.count == 0
            and (v is None or not (v.cpu_milli or v.memory_mib))
        ):
            raise ValueError(
                "a job without GPUs (gpus.count 0) asks host.cpu_milli or host.memory_mib"
            )
        return v


class ApiError(Public):
    code: str
    message: str
    # The request field at fault (dotted path), for `invalid` errors.
    field: str | None = None


class SubmitReply(Public):
    ok: bool
    job_id: str | None = None
    error: ApiError | None = None


class GetJob(Public):
    job_id: Id


class GpuRef(Wire):
    node: Id
    index: GpuIndex
    model: Name


class CheckpointInfo(Wire):
    checkpoint_id: str
    step: int
    uri: str
    bytes: int
    sha256: str
    stage: StageName


class ReservationView(Wire):
    """Nodes held for a waiting gang: GPUs freeing there are kept for it."""

    nodes: list[str]
    since: Instant
    reason: str


class ReplicaView(Wire):
    min: int
    max: int
    target: int
    placed: int
    allocation_ids: list[str] = Field(default_factory=list)
    # Failed replicas in a row, and when their replacement may be placed (restart back-off).
    failures: int = 0
    restart_at: Instant | None = None


class JobView(Wire):
    job_id: str
    name: str
    team: str
    kind: JobKind
    priority_class: PriorityClassName
    state: str
    attempt: int
    gpus: GpuRequest
    allocation_id: str | None = None
    allocated: list[GpuRef] = Field(default_factory=list)
    # Host CPU and memory it asked; the node a job without GPUs runs on.
    host: HostRequest | None = None
    node: str | None = None
    resume_from: CheckpointInfo | None = None
    latest_checkpoint: CheckpointInfo | None = None
    submitted_at: Instant
    warnings: list[str] = Field(default_factory=list)
    # The part of its GPU a fractional or MIG job holds.
    share: GpuShare | None = None
    # A starving gang's hold on nodes while it waits (docs/admission-user.md).
    reservation: ReservationView | None = None
    # An inference service's replicas; `allocated` then lists every live replica's GPUs.
    replicas: ReplicaView | None = None
    # Why the scheduler set this job aside (state `parked`): it is not placed until an
    # operator retries or cancels it.
    parked_reason: str | None = None


class GetReply(Public):
    ok: bool
    job: JobView | None = None
    error: ApiError | None = None


class ScaleJob(Public):
    """Move an inference service's replica target inside its [min, max]."""

    job_id: Id
    replicas: Annotated[int, Strict(), Field(ge=0, le=1024)]


class ScaleReply(Public):
    ok: bool
    replicas: ReplicaView | None = None
    error: ApiError | None = None


class ApproveJob(Public):
    """An operator lets a job held above its team's max priority class into the queue."""

    job_id: Id
    operator: Name = Field(min_length=1)
    reason: Reason = ""


class ApproveReply(Public):
    ok: bool
    error: ApiError | None = None


class CancelJob(Public):
    """End a job: a queued or held job leaves the queue, a running one's workload is
    stopped and its GPUs freed. Its team's own jobs, or any job for an operator."""

    job_id: Id
    operator: Name = Field(min_length=1)
    reason: Reason = ""


class CancelReply(Public):
    ok: bool
    job_id: str | None = None
    state: str | None = None
    error: ApiError | None = None


class WhyJob(Public):
    job_id: Id


class WhyReply(Public):
    """Why a job is where it is, in words (`gpusched why <job>`)."""

    ok: bool
    job_id: str | None = None
    state: str | None = None
    reasons: list[str] = Field(default_factory=list)
    error: ApiError | None = None


class JobStateName(StrEnum):
    """The states a job is in, as `get` and `list` show them (admission's JobState)."""

    HELD = "held"
    QUEUED = "queued"
    RUNNING = "running"
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"
    PARKED = "parked"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"


class ListJobs(Public):
    """Jobs, newest first, a page at a time. A team sees its own jobs only: `team` is
    then its own (or left out); an operator may name any team, or none for all."""

    team: Team | None = None
    states: list[JobStateName] = Field(default_factory=list, max_length=len(JobStateName))
    priority_class: PriorityClassName | None = None
    kind: JobKind | None = None
    limit: Annotated[int, Strict(), Field(ge=1, le=500)] = 50
    # The last job id of the previous page (its `next`): the page starts after it.
    after: Id | None = None

    @field_validator("team")
    @classmethod
    def _team_is_token(cls, v: str | None) -> str | None:
        return None if v is None else check_token(v, "team")


class JobSummary(Wire):
    """One row of `list`: what the job table holds, without its allocation's GPUs."""

    job_id: str
    name: str
    team: str
    kind: str
    priority_class: str
    state: str
    attempt: int
    gpus: int
    milli: int | None = None
    model: str | None = None
    submitted_at: Instant
    allocation_id: str | None = None


class ListReply(Public):
    ok: bool
    jobs: list[JobSummary] = Field(default_factory=list)
    # The `after` of the next page; None on the last page.
    next: str | None = None
    error: ApiError | None = None


# ======================================================================================
# Internal: ingest -> everyone
# ======================================================================================
class PoolState(Wire):
    pool: Id
    gpus: Count
    util: Fraction
    reporting_gpus: Count


class ServiceState(Wire):
    service: Id
    p99_ms: Latency
    queue_depth: Count
    requests: Count


class PoolSnapshot(Wire):
    time: Instant
    window_s: Seconds
    pools: list[PoolState]
    services: list[ServiceState] = Field(default_factory=list)


# ======================================================================================
# Internal: admission (ledger owner) events
# ======================================================================================
class GpuShare(Wire):
    """The part of its one GPU an allocation holds: a fraction (compute in 1/1000 and a
    memory cap, enforced the way NVIDIA MPS does) or a MIG slice (its profile and its
    position in the GPU's layout; `milli` is then the profile's compute slices / 7)."""

    milli: int = Field(ge=1, le=1000)
    memory_mib: int = Field(ge=1)
    mig_profile: str | None = None
    mig_slice: int | None = Field(default=None, ge=0)


class AllocationGranted(Wire):
    allocation_id: str
    job_id: str
    team: str
    kind: JobKind
    priority_class: PriorityClassName
    pool: str
    gpus: list[GpuRef]
    granted_at: Instant
    attempt: int = Field(ge=1)
    checkpointable: bool
    resume_from: CheckpointInfo | None = None
    workload: WorkloadSpec = Field(default_factory=WorkloadSpec)
    cpu_cores: Decimal = Decimal(0)
    memory_gb: Decimal = Decimal(0)
    # Granted beyond the team's guaranteed quota (borrowed idle GPUs): reclaimed first.
    borrowed: bool = False
    # Part of its one GPU (fractional or MIG); None: every GPU in `gpus` is whole.
    share: GpuShare | None = None
    # A job without GPUs: the node whose host CPU and memory it holds.
    node: str | None = None


class AllocationReleased(Wire):
    allocation_id: str
    job_id: str
    team: str
    gpus: list[GpuRef]
    released_at: Instant
    reason: str
    # Its GPUs other tenants still hold (the fractions sharing a GPU with it): a GPU lent
    # to inference while they ran serves it only once the last has gone.
    still_held: list[GpuRef] = Field(default_factory=list)


class GpusReserved(Wire):
    """GPUs lent to inference. `gpus` lists every GPU newly reserved; `pending` is the
    subset training still holds: those serve inference once their allocation ends."""

    reservation_id: str
    gpus: list[GpuRef]
    pending: list[GpuRef] = Field(default_factory=list)


class GpusReturned(Wire):
    reservation_id: str
    gpus: list[GpuRef]


class InventoryNode(Wire):
    name: Id
    pool: Id
    gpu_model: Name
    gpus: Annotated[int, Strict(), Field(ge=0, le=1024)]
    # GPU indices per NVLink island (else NUMA node); empty: the node is one island.
    gpu_groups: list[list[GpuIndex]] = Field(default_factory=list)


class InventoryLoaded(Wire):
    nodes: list[InventoryNode]


class NodeChange(StrEnum):
    """What happened to one node. Counting consumers: ADDED and RECOVERED bring the
    node's GPUs into its pool, FAILED and REMOVED take them out; DRAINED and UNDRAINED
    change no count (a drained node's GPUs still run what they run)."""

    ADDED = "added"
    DRAINED = "drained"
    UNDRAINED = "undrained"
    FAILED = "failed"
    RECOVERED = "recovered"
    REMOVED = "removed"


class NodeState(StrEnum):
    UP = "up"
    # No new placements; what runs there runs to its end.
    DRAINED = "drained"
    # Its GPUs are out of the placeable set and its allocations were ended.
    FAILED = "failed"


class InventoryChanged(Wire):
    change: NodeChange
    node: InventoryNode
    state: NodeState | None  # None once removed
    reason: str


class NodeHealth(Wire):
    """The cluster agent's word on a node: healthy or not (a real agent reads it from
    the node's conditions; the simulated one is told by command)."""

    node: str
    healthy: bool
    reason: str = ""
    time: Instant


# ======================================================================================
# Operator: nodes API (request/reply) on <p>.api.nodes.<verb>
# ======================================================================================
class NodeVerb(StrEnum):
    """The last token of each nodes API subject (`Subjects.api_nodes`)."""

    ADD = "add"
    RELOAD = "reload"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    FAIL = "fail"
    RECOVER = "recover"
    REMOVE = "remove"
    LIST = "list"


class NodeCommand(Public):
    """drain, undrain, fail, recover, remove: one node by name, who asks and why."""

    node: Id
    operator: Name = Field(min_length=1)
    reason: Reason = ""


# Upper bounds of the sizes in a node spec (AddNode); the inventory parser checks the rest.
NODE_SPEC_LIMITS: dict[str, int] = {
    "gpus": 1024,
    "count": 10_000,
    "cpu_milli": 10**9,
    "memory_mib": 2**30,
    "gpu_memory_mib": 2**30,
    "disk_gib": 2**30,
}
# GPUs one AddNode may add in all (count x gpus): above the 10,000 nodes x 8 GPUs this
# control plane is sized for, far below the 10 million the two bounds alone allow.
NODE_SPEC_MAX_GPUS: Final = 100_000


class AddNode(Public):
    # One entry in the inventory YAML shape (name, pool, gpu_model, gpus, cpu_milli,
    # memory_mib, ...); `count`/`name_prefix` entries add several nodes at once.
    spec: Document
    operator: Name = Field(min_length=1)
    reason: Reason = ""

    @field_validator("spec")
    @classmethod
    def _spec_sizes_bounded(cls, v: dict[str, object]) -> dict[str, object]:
        # The inventory parser builds one object per GPU and per node: a huge count
        # would stall admission, so the sizes are bounded here, at the edge.
        for key, most in NODE_SPEC_LIMITS.items():
            value = v.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > most:
                raise ValueError(f"{key}: at most {most}, got {value}")
        count, gpus = v.get("count", 1), v.get("gpus")
        if (
            isinstance(count, int)
            and isinstance(gpus, int)
            and not isinstance(count, bool)
            and not isinstance(gpus, bool)
            and count * gpus > NODE_SPEC_MAX_GPUS
        ):
            raise ValueError(
                f"count x gpus: at most {NODE_SPEC_MAX_GPUS:,} GPUs in one request, got "
                f"{count} x {gpus} = {count * gpus:,}"
            )
        return v


class ReloadInventory(Public):
    """Read the inventory file again and add the nodes it has that the ledger has not."""

    operator: Name = Field(min_length=1)
    reason: Reason = ""


class ListNodes(Public):
    pass


class NodeView(Wire):
    name: str
    pool: str
    gpu_model: str
    gpus: int
    state: NodeState
    cpu_milli: int = 0
    memory_mib: int = 0
    disk_gib: int = 0
    allocations: list[str] = Field(default_factory=list)


class NodeReply(Public):
    ok: bool
    nodes: list[NodeView] = Field(default_factory=list)
    # In words: what a reload left alone (nodes stored but no longer in the file), and
    # what an added node lacks (telemetry, for a name that is no subject token).
    notes: list[str] = Field(default_factory=list)
    error: ApiError | None = None


# ======================================================================================
# Internal: commands to admission (ledger) from preemption
# ======================================================================================
class ReserveForInference(Wire):
    reservation_id: str
    decision_id: str
    allocation_ids: list[str] = Field(default_factory=list)
    free_gpus: int = Field(default=0, ge=0)


class ReturnToShared(Wire):
    reservation_id: str
    decision_id: str
    gpus: int = Field(ge=1)


# ======================================================================================
# Internal: preemption -> checkpoint
# ======================================================================================
class EvictionRequested(Wire):
    request_id: str
    decision_id: str
    allocation_id: str
    job_id: str
    team: str
    priority_class: PriorityClassName
    gpus: int = Field(ge=1)
    started_at: Instant
    reason: str
    # A fraction of its one GPU (1/1000): its lost work, and a forced eviction's credit,
    # count that part of the GPU. 1000: whole GPUs.
    share_milli: Annotated[int, Strict()] = Field(default=1000, ge=1, le=1000)


class EvictionWithdrawn(Wire):
    request_id: str
    reason: str


# ======================================================================================
# Internal: checkpoint (saga) outcomes
# ======================================================================================
class EvictionCompleted(Wire):
    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    checkpoint: CheckpointInfo | None


class EvictionAborted(Wire):
    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    reason: str


class EvictionForced(Wire):
    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    lost_gpu_seconds: float = Field(ge=0)
    checkpoint: CheckpointInfo | None


class EvictionCancelled(Wire):
    saga_id: str
    request_id: str
    allocation_id: str
    job_id: str
    reason: str


class CheckpointVerified(Wire):
    """The checkpoint service verified a job's checkpoint claim and catalogued it: from
    then on the rest of the system may use it (resume, lost work, victim choice). A claim
    it could not verify is never announced."""

    job_id: str
    request_id: str | None
    checkpoint: CheckpointInfo
    confirmed_at: Instant


# ======================================================================================
# Internal: cluster agent commands and results
# ======================================================================================
class StartWorkload(Wire):
    allocation_id: str
    job_id: str
    attempt: int
    gpus: list[GpuRef]
    workload: WorkloadSpec
    resume_from: CheckpointInfo | None = None
    # Part of its one GPU: the agent caps the workload's memory and compute to it.
    share: GpuShare | None = None
    # A job without GPUs (`gpus` empty): the node it runs on.
    node: str | None = None
    # The job's own NATS credentials (a .creds text: publish its events, read its
    # control subject), valid until `credentials_expire_at` unless renewed. A secret:
    # never logged or audited.
    credentials: Credentials | None = Field(default=None, repr=False)
    credentials_expire_at: Instant | None = None


class RenewCredentials(Wire):
    """Fresh credentials for a running workload (admission renews them while its
    allocation lives; the agent rewrites the job's credentials file)."""

    allocation_id: str
    job_id: str
    credentials: Credentials = Field(repr=False)
    expire_at: Instant


class MigConfigure(Wire):
    """Give one empty GPU a new MIG layout (empty `profiles`: MIG off, a whole GPU)."""

    change_id: str
    node: str
    gpu: int = Field(ge=0)
    model: str
    profiles: list[str]
    previous: list[str] = Field(default_factory=list)


class MigConfigured(Wire):
    """The agent applied a MIG layout change."""

    change_id: str
    node: str
    gpu: int = Field(ge=0)
    profiles: list[str]
    applied_at: Instant


class MigConfigureFailed(Wire):
    """The agent could not apply a MIG layout change: the GPU keeps its previous layout."""

    change_id: str
    node: str
    gpu: int = Field(ge=0)
    error: str
    time: Instant


class EvictWorkload(Wire):
    allocation_id: str
    job_id: str
    saga_id: str
    forced: bool = False


class StopReason(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    EVICTED = "evicted"
    # Stopped because the cluster agent itself stopped or restarted, not by the job's
    # fault: admission requeues it from its newest verified checkpoint.
    INTERRUPTED = "interrupted"


class WorkloadStarted(Wire):
    allocation_id: str
    job_id: str
    node: str
    started_at: Instant


class WorkloadStopped(Wire):
    allocation_id: str
    job_id: str
    reason: StopReason
    stopped_at: Instant
    exit_code: int | None = None
    saga_id: str | None = None


class AgentReady(Wire):
    """The cluster agent (re)started and says what it runs. It keeps no durable state, so
    after a crash `running` is what survived it (nothing, for the simulated cluster):
    admission treats every live allocation on `nodes` that is not listed as interrupted."""

    agent_id: str = Field(min_length=1, max_length=200)
    nodes: list[str]
    running: list[str] = Field(default_factory=list)
    time: Instant


class EvictFailed(Wire):
    allocation_id: str
    job_id: str
    saga_id: str
    error: str


# ======================================================================================
# The registry: message type -> (version, schema). One place for every type name.
# ======================================================================================
class T(StrEnum):
    """Message type names, so no service spells a type as a bare string."""

    CHECKPOINT_REQUESTED = "checkpoint.requested"
    PREEMPTION_CANCELLED = "preemption.cancelled"
    RESUME = "resume"
    JOB_STARTED = "job.started"
    JOB_PROGRESS = "job.progress"
    CHECKPOINT_CONFIRMED = "checkpoint.confirmed"
    CHECKPOINT_FAILED = "checkpoint.failed"
    JOB_COMPLETED = "job.completed"
    JOB_FAILED = "job.failed"
    GPU_SAMPLE = "gpu.sample"
    INFERENCE_STATS = "inference.stats"
    AUDIT = "audit.record"
    POOL_SNAPSHOT = "pool.snapshot"
    ALLOCATION_GRANTED = "allocation.granted"
    ALLOCATION_RELEASED = "allocation.released"
    GPUS_RESERVED = "gpus.reserved"
    GPUS_RETURNED = "gpus.returned"
    INVENTORY_LOADED = "inventory.loaded"
    RESERVE_FOR_INFERENCE = "ledger.reserve"
    RETURN_TO_SHARED = "ledger.return"
    EVICTION_REQUESTED = "eviction.requested"
    EVICTION_WITHDRAWN = "eviction.withdrawn"
    EVICTION_COMPLETED = "eviction.completed"
    EVICTION_ABORTED = "eviction.aborted"
    EVICTION_FORCED = "eviction.forced"
    EVICTION_CANCELLED = "eviction.cancelled"
    CHECKPOINT_VERIFIED = "checkpoint.verified"
    START_WORKLOAD = "workload.start"
    RENEW_CREDENTIALS = "workload.credentials"
    EVICT_WORKLOAD = "workload.evict"
    WORKLOAD_STARTED = "workload.started"
    WORKLOAD_STOPPED = "workload.stopped"
    EVICT_FAILED = "workload.evict_failed"
    AGENT_READY = "agent.ready"
    MIG_CONFIGURE = "mig.configure"
    MIG_CONFIGURED = "mig.configured"
    MIG_CONFIGURE_FAILED = "mig.configure_failed"
    INVENTORY_CHANGED = "inventory.changed"
    NODE_HEALTH = "node.health"


SCHEMAS: dict[str, type[Wire]] = {
    T.CHECKPOINT_REQUESTED: CheckpointRequested,
    T.PREEMPTION_CANCELLED: PreemptionCancelled,
    T.RESUME: Resume,
    T.JOB_STARTED: JobStarted,
    T.JOB_PROGRESS: JobProgress,
    T.CHECKPOINT_CONFIRMED: CheckpointConfirmed,
    T.CHECKPOINT_FAILED: CheckpointFailed,
    T.JOB_COMPLETED: JobCompleted,
    T.JOB_FAILED: JobFailed,
    T.GPU_SAMPLE: GpuSample,
    T.INFERENCE_STATS: InferenceStats,
    T.AUDIT: AuditRecord,
    T.POOL_SNAPSHOT: PoolSnapshot,
    T.ALLOCATION_GRANTED: AllocationGranted,
    T.ALLOCATION_RELEASED: AllocationReleased,
    T.GPUS_RESERVED: GpusReserved,
    T.GPUS_RETURNED: GpusReturned,
    T.INVENTORY_LOADED: InventoryLoaded,
    T.RESERVE_FOR_INFERENCE: ReserveForInference,
    T.RETURN_TO_SHARED: ReturnToShared,
    T.EVICTION_REQUESTED: EvictionRequested,
    T.EVICTION_WITHDRAWN: EvictionWithdrawn,
    T.EVICTION_COMPLETED: EvictionCompleted,
    T.EVICTION_ABORTED: EvictionAborted,
    T.EVICTION_FORCED: EvictionForced,
    T.EVICTION_CANCELLED: EvictionCancelled,
    T.CHECKPOINT_VERIFIED: CheckpointVerified,
    T.START_WORKLOAD: StartWorkload,
    T.RENEW_CREDENTIALS: RenewCredentials,
    T.EVICT_WORKLOAD: EvictWorkload,
    T.WORKLOAD_STARTED: WorkloadStarted,
    T.WORKLOAD_STOPPED: WorkloadStopped,
    T.EVICT_FAILED: EvictFailed,
    T.AGENT_READY: AgentReady,
    T.MIG_CONFIGURE: MigConfigure,
    T.MIG_CONFIGURED: MigConfigured,
    T.MIG_CONFIGURE_FAILED: MigConfigureFailed,
    T.INVENTORY_CHANGED: InventoryChanged,
    T.NODE_HEALTH: NodeHealth,
}
