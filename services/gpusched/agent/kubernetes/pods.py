"""Pods as gpusched jobs: reading a pod's labels, what its phase means, what to create.

Pure functions of Kubernetes JSON objects (dicts as the API sends them):
- `read_pod`: a pod for the gpusched scheduler, its labels and annotations checked
  (PodRefused says what is wrong, in one line, for the pod's Event);
- `submission`: the SubmitJob for a pod, or for a gang's pods together;
- `outcome`: what a pod's phase and container states mean (started, completed,
  failed with its exit code, OOM-killed, lost with its node);
- `assign_gang`: which node each of a gang's pods goes to, from admission's GPUs;
- `successor`: the next attempt's pod, made from the last one's template;
- `job_secret`, `gpu_claim`, `claim_allocation`: what the agent creates at placement.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from gpusched.contracts.messages import (
    GpuRef,
    GpuRequest,
    GpuShare,
    JobKind,
    PriorityClassName,
    Replicas,
    StopReason,
    SubmitJob,
    WorkloadSpec,
)

from . import labels as L
from .quantity import QuantityError, count

Obj = dict[str, Any]


class PodRefused(ValueError):
    """A pod gpusched cannot run as written: the message names the label and the fix."""


@dataclass(frozen=True, slots=True)
class Owner:
    kind: str
    name: str
    uid: str


@dataclass(frozen=True, slots=True)
class GpuschedPod:
    namespace: str
    name: str
    uid: str
    team: str
    priority_class: PriorityClassName
    kind: JobKind
    checkpointable: bool
    checkpoint_s: float | None
    gpus: int
    gpu_model: str | None
    memory_gib: float | None
    milli: int | None
    gang: str | None
    gang_size: int
    replicas: tuple[int, int] | None  # an inference service's (min, max)
    owner: Owner | None
    handle: str | None
    job_id: str | None
    allocation_id: str | None
    saga_id: str | None
    node: str | None
    phase: str
    deleting: bool
    checkpoint_dir: str | None

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)

    @property
    def bound(self) -> bool:
        return self.node is not None

    @property
    def group(self) -> tuple[str, str]:
        """The pods submitted together as one job: a gang, or the pod alone."""
        return (self.namespace, f"gang:{self.gang}" if self.gang else f"pod:{self.name}")


def is_gpusched_pod(pod: Mapping[str, Any], scheduler_name: str) -> bool:
    return (pod.get("spec") or {}).get("schedulerName") == scheduler_name


def read_pod(pod: Mapping[str, Any]) -> GpuschedPod:
    """Read a gpusched pod; PodRefused if its labels or annotations are unusable."""
    meta = pod.get("metadata") or {}
    name = str(meta.get("name", ""))
    pod_labels: Mapping[str, str] = meta.get("labels") or {}
    notes: Mapping[str, str] = meta.get("annotations") or {}
    team = pod_labels.get(L.TEAM)
    if not team:
        raise PodRefused(f"pod {name}: label {L.TEAM} is missing: name the team that runs it")
    priority = _enum(
        PriorityClassName, pod_labels.get(L.PRIORITY_CLASS, "p1-normal"), L.PRIORITY_CLASS, name
    )
    kind = _enum(JobKind, pod_labels.get(L.KIND, "training"), L.KIND, name)
    gang = pod_labels.get(L.GANG) or None
    gang_size = 1
    if gang is not None:
        gang_size = _int(pod_labels.get(L.GANG_SIZE), L.GANG_SIZE, name, low=1, high=1024)
    elif L.GANG_SIZE in pod_labels:
        raise PodRefused(f"pod {name}: label {L.GANG_SIZE} needs {L.GANG} (the gang's name)")
    replicas = None
    if L.REPLICAS in pod_labels:
        replicas = _replicas(pod_labels[L.REPLICAS], name)
        if kind is not JobKind.INFERENCE:
            raise PodRefused(
                f"pod {name}: {L.REPLICAS} is for inference services: label it "
                f"{L.KIND}=inference (a training job is one pod, or a gang)"
            )
        if gang is not None:
            raise PodRefused(f"pod {name}: a gang ({L.GANG}) cannot have {L.REPLICAS}")
    gpus = _gpus(pod, notes, name)
    milli = None
    if L.GPU_MILLI in notes:
        milli = _int(notes[L.GPU_MILLI], L.GPU_MILLI, name, low=1, high=999)
        if gpus != 1:
            raise PodRefused(
                f"pod {name}: {L.GPU_MILLI} (a fraction) needs exactly 1 GPU, not {gpus}"
            )
    memory_gib = None
    if L.GPU_MEMORY_GIB in notes:
        memory_gib = _float(notes[L.GPU_MEMORY_GIB], L.GPU_MEMORY_GIB, name)
    checkpoint_s = None
    if L.CHECKPOINT_SECONDS in notes:
        checkpoint_s = _float(notes[L.CHECKPOINT_SECONDS], L.CHECKPOINT_SECONDS, name)
    checkpointable = _flag(notes.get(L.CHECKPOINTABLE, "true"), L.CHECKPOINTABLE, name)
    node = (pod.get("spec") or {}).get("nodeName") or None
    return GpuschedPod(
        namespace=str(meta.get("namespace", "default")),
        name=name,
        uid=str(meta.get("uid", "")),
        team=team,
        priority_class=priority,
        kind=kind,
        checkpointable=checkpointable,
        checkpoint_s=checkpoint_s,
        gpus=gpus,
        gpu_model=notes.get(L.GPU_MODEL) or None,
        memory_gib=memory_gib,
        milli=milli,
        gang=gang,
        gang_size=gang_size,
        replicas=replicas,
        owner=_controller(meta),
        handle=notes.get(L.HANDLE) or None,
        job_id=notes.get(L.JOB_ID) or None,
        allocation_id=notes.get(L.ALLOCATION_ID) or None,
        saga_id=notes.get(L.SAGA) or None,
        node=node,
        phase=str((pod.get("status") or {}).get("phase", "Pending")),
        deleting="deletionTimestamp" in meta,
        checkpoint_dir=notes.get(L.CHECKPOINT_DIR) or None,
    )


def requested_gpus(pod: Mapping[str, Any]) -> int:
    """The pod's nvidia.com/gpu limits, summed over its containers (the device plugin's
    way of asking; init containers run before and reuse the same devices)."""
    total = 0
    for container in (pod.get("spec") or {}).get("containers") or []:
        limits = (container.get("resources") or {}).get("limits") or {}
        if L.GPU_RESOURCE in limits:
            total += count(limits[L.GPU_RESOURCE])
    return total


def _gpus(pod: Mapping[str, Any], notes: Mapping[str, str], name: str) -> int:
    try:
        asked = requested_gpus(pod)
    except QuantityError as exc:
        raise PodRefused(f"pod {name}: {L.GPU_RESOURCE} limit: {exc}") from None
    if asked == 0 and L.GPUS in notes:
        asked = _int(notes[L.GPUS], L.GPUS, name, low=1, high=1024)
    if asked < 1:
        raise PodRefused(
            f"pod {name}: no GPUs asked: set resources.limits {L.GPU_RESOURCE} on a container "
            "(pods without GPUs belong to the default scheduler)"
        )
    return asked


def _controller(meta: Mapping[str, Any]) -> Owner | None:
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller"):
            return Owner(str(ref.get("kind")), str(ref.get("name")), str(ref.get("uid")))
    return None


def _enum(cls: Any, value: str, label: str, pod: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(m.value for m in cls)
        raise PodRefused(f"pod {pod}: {label}={value!r} is not one of {allowed}") from None


def _int(value: str | None, label: str, pod: str, *, low: int, high: int) -> int:
    if value is None or not re.fullmatch(r"[0-9]{1,7}", value.strip()):
        raise PodRefused(f"pod {pod}: {label}={value!r} must be a whole number {low}..{high}")
    number = int(value)
    if not low <= number <= high:
        raise PodRefused(f"pod {pod}: {label}={number} must be between {low} and {high}")
    return number


def _float(value: str, label: str, pod: str) -> float:
    # No NaN, Infinity or exponent games: a plain decimal number.
    if not re.fullmatch(r"[0-9]{1,9}(\.[0-9]{1,6})?", value.strip()):
        raise PodRefused(f"pod {pod}: {label}={value!r} must be a positive decimal number")
    number = float(value)
    if number <= 0:
        raise PodRefused(f"pod {pod}: {label} must be positive")
    return number


def _replicas(value: str, pod: str) -> tuple[int, int]:
    parts = value.split(":")
    if len(parts) > 2:
        raise PodRefused(f'pod {pod}: {L.REPLICAS}={value!r} must be "N" or "MIN:MAX"')
    low = _int(parts[0], L.REPLICAS, pod, low=1, high=1024)
    high = _int(parts[-1], L.REPLICAS, pod, low=1, high=1024)
    if low > high:
        raise PodRefused(f"pod {pod}: {L.REPLICAS}={value!r}: MIN must not exceed MAX")
    return low, high


def _flag(value: str, label: str, pod: str) -> bool:
    if value not in ("true", "false"):
        raise PodRefused(f'pod {pod}: {label}={value!r} must be "true" or "false"')
    return value == "true"


def crowded_controllers(live: Iterable[GpuschedPod]) -> dict[str, Owner]:
    """Controllers (a Deployment's ReplicaSet, a Job of parallelism > 1, ...) with more
    than one live pod outside a gang. Their pods share one submission key, so they would
    be one gpusched job that only one of them runs: they are refused instead, saying how
    to write it (a gang, or one pod with gpusched.io/replicas)."""
    counts: dict[str, int] = defaultdict(int)
    owners: dict[str, Owner] = {}
    for pod in live:
        if pod.owner is not None and pod.gang is None:
            counts[pod.owner.uid] += 1
            owners[pod.owner.uid] = pod.owner
    return {uid: owners[uid] for uid, n in counts.items() if n > 1}


def crowd_refusal(owner: Owner) -> str:
    return (
        f"the pods of {owner.kind} {owner.name} would all be one gpusched job: label them "
        f"a gang ({L.GANG}, {L.GANG_SIZE} = their count) for training, or write one pod "
        f"with {L.REPLICAS} for an inference service (admission scales its replicas)"
    )


def team_of_namespace(namespace: str, mapping: Mapping[str, str], labelled: str | None) -> str:
    """The team a namespace's pods run for: the operator's mapping, else the namespace's
    gpusched.io/team label. PodRefused (saying how to give it one) if it has neither:
    a pod's own label is never trusted alone, since whoever creates pods writes it."""
    owner = mapping.get(namespace) or labelled
    if not owner:
        raise PodRefused(
            f"namespace {namespace} has no gpusched team: an operator labels it "
            f"(kubectl label namespace {namespace} {L.TEAM}=<team>) or maps it in "
            "GPUSCHED_AGENT__KUBERNETES__NAMESPACE_TEAMS"
        )
    return owner


# --- submission -------------------------------------------------------------------------
def submission_key(pods: Sequence[GpuschedPod]) -> str:
    """The submit's idempotency key: stable across agent restarts and, for a Job's pods,
    across the pods its controller makes again (so they map to the same gpusched job)."""
    first = min(pods, key=lambda p: p.name)
    if first.owner is not None:
        return f"k8s/{first.owner.uid}" + (f"/{first.gang}" if first.gang else "")
    if first.gang:
        return f"k8s/gang/{first.namespace}/{first.gang}/{first.uid}"
    return f"k8s/{first.uid}"


def template(pod: Mapping[str, Any]) -> Obj:
    """What a later attempt's pod is made from: the pod as written, without what the
    API server, the agent and the webhook added for this attempt."""
    meta = pod.get("metadata") or {}
    notes = {
        k: v
        for k, v in (meta.get("annotations") or {}).items()
        if k not in (L.HANDLE, L.JOB_ID, L.ALLOCATION_ID, L.ATTEMPT, L.REFUSED, L.SAGA)
    }
    spec = copy.deepcopy(pod.get("spec") or {})
    spec.pop("nodeName", None)
    return {
        "metadata": {
            "name": meta.get("name"),
            "namespace": meta.get("namespace"),
            # Which pod the job was submitted for (its first attempt runs on it).
            "uid": meta.get("uid"),
            "labels": dict(meta.get("labels") or {}),
            "annotations": notes,
        },
        "spec": spec,
    }


def submission(pods: Sequence[GpuschedPod], objects: Sequence[Mapping[str, Any]]) -> SubmitJob:
    """The job for one pod, or a gang's pods (all present): their GPUs together, placed
    all or none. ValueError (PodRefused) if the gang's pods disagree."""
    first = min(pods, key=lambda p: p.name)
    for pod in pods:
        for attr in ("team", "priority_class", "kind", "checkpointable", "gpu_model"):
            if getattr(pod, attr) != getattr(first, attr):
                raise PodRefused(
                    f"gang {first.gang}: pods {first.name} and {pod.name} disagree on {attr}"
                )
    name = first.gang or (first.owner.name if first.owner else first.name)
    try:
        return SubmitJob(
            name=name[:200],
            team=first.team,
            kind=first.kind,
            priority_class=first.priority_class,
            gpus=GpuRequest(
                count=sum(p.gpus for p in pods),
                model=first.gpu_model,
                memory_gib=first.memory_gib,
                milli=first.milli if len(pods) == 1 else None,
            ),
            gang=True,
            checkpointable=first.checkpointable,
            estimated_checkpoint_s=first.checkpoint_s,
            replicas=None
            if first.replicas is None
            else Replicas(min=first.replicas[0], max=first.replicas[1]),
            idempotency_key=submission_key(pods),
            workload=WorkloadSpec(
                kind="pod",
                pod={
                    "pods": [template(o) for o in objects],
                    "controller": first.owner.kind if first.owner else None,
                    # Each replica is a pod of its own, named after its allocation.
                    "replicas": first.replicas is not None,
                },
            ),
        )
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in error.get("loc", ()))
        raise PodRefused(f"pod {first.name}: {where}: {error['msg']}") from None


# --- what a pod's state means -----------------------------------------------------------
class Progress(StrEnum):
    WAITING = "waiting"  # bound, not running yet (pulling its image, waiting for its claim)
    RUNNING = "running"
    ENDED = "ended"


@dataclass(frozen=True, slots=True)
class Outcome:
    progress: Progress
    reason: StopReason | None = None
    exit_code: int | None = None
    error: str | None = None


# Pod status reasons (and DisruptionTarget reasons) that are the cluster's doing, not
# the job's: it is requeued from its checkpoint, not failed.
_NOT_THE_JOBS_FAULT = frozenset(
    {
        "Evicted",
        "NodeLost",
        "NodeShutdown",
        "Shutdown",
        "Terminated",
        "UnexpectedAdmissionError",
        "DeletionByTaintManager",
        "TerminationByKubelet",
        "PreemptionByScheduler",
        "EvictionByEvictionAPI",
    }
)


def outcome(pod: Mapping[str, Any]) -> Outcome:
    status = pod.get("status") or {}
    phase = status.get("phase", "Pending")
    if phase == "Running":
        return Outcome(Progress.RUNNING)
    if phase == "Succeeded":
        return Outcome(Progress.ENDED, StopReason.COMPLETED, 0)
    if phase != "Failed":
        return Outcome(Progress.WAITING)
    code, why = None, None
    for container in status.get("containerStatuses") or []:
        terminated = (container.get("state") or {}).get("terminated") or {}
        if terminated and terminated.get("exitCode", 0) != 0 and code is None:
            code = int(terminated["exitCode"])
            why = terminated.get("reason") or None
            if why == "OOMKilled":
                return Outcome(
                    Progress.ENDED,
                    StopReason.FAILED,
                    code,
                    f"container {container.get('name')} was OOM-killed (exit {code}): "
                    "raise its memory limit",
                )
    disrupted = [
        c.get("reason")
        for c in status.get("conditions") or []
        if c.get("type") == "DisruptionTarget" and c.get("status") == "True"
    ]
    cluster_reason = status.get("reason") if status.get("reason") in _NOT_THE_JOBS_FAULT else None
    cluster_reason = cluster_reason or next((r for r in disrupted if r), None)
    if cluster_reason is not None:
        message = status.get("message") or cluster_reason
        return Outcome(Progress.ENDED, StopReason.INTERRUPTED, code, f"{cluster_reason}: {message}")
    detail = (
        f"exit code {code}" + (f" ({why})" if why else "")
        if code is not None
        else (status.get("message") or status.get("reason") or "pod failed")
    )
    return Outcome(Progress.ENDED, StopReason.FAILED, code, detail)


def gang_outcome(outcomes: Sequence[Outcome]) -> Outcome:
    """A gang runs when every pod runs; it ends when one pod fails (the others cannot
    go on without it) or when all completed."""
    ended = [o for o in outcomes if o.progress is Progress.ENDED]
    for o in ended:
        if o.reason is not StopReason.COMPLETED:
            return o
    if ended and len(ended) == len(outcomes):
        return ended[0]
    if all(o.progress is Progress.RUNNING or o.progress is Progress.ENDED for o in outcomes):
        return Outcome(Progress.RUNNING)
    return Outcome(Progress.WAITING)


def successor_suffix(allocation_id: str, attempt: int, replicas: bool) -> str:
    """How a pod the agent makes is told apart from its job's other pods: a replica by
    its number in the allocation id (admission's `<job>-r<N>`), else by the attempt."""
    if replicas:
        found = re.search(r"-r([0-9]{1,9})$", allocation_id)
        if found:
            return f"r{found.group(1)}"
        return "r" + hashlib.sha256(allocation_id.encode()).hexdigest()[:8]
    return f"a{attempt}"


# --- placement --------------------------------------------------------------------------
class GangMismatch(ValueError):
    """Admission's GPUs cannot be split among the pods (a pod's GPUs must be on one node)."""


def assign_gang(
    pods: Sequence[GpuschedPod], gpus: Sequence[GpuRef]
) -> dict[tuple[str, str], tuple[str, tuple[int, ...]]]:
    """Each pod's node and GPU indices, using every GPU admission chose exactly once:
    the largest pods first, each on the node with the most GPUs left that holds it."""
    by_node: dict[str, list[int]] = defaultdict(list)
    for ref in gpus:
        by_node[ref.node].append(ref.index)
    asked = sum(p.gpus for p in pods)
    if asked != len(gpus):
        raise GangMismatch(f"the pods ask for {asked} GPUs, admission placed {len(gpus)}")
    left = {node: sorted(indices) for node, indices in by_node.items()}
    placed: dict[tuple[str, str], tuple[str, tuple[int, ...]]] = {}
    for pod in sorted(pods, key=lambda p: (-p.gpus, p.name)):
        fits = [n for n, free in left.items() if len(free) >= pod.gpus]
        if not fits:
            shape = ", ".join(f"{n}: {len(v)}" for n, v in sorted(by_node.items()))
            raise GangMismatch(
                f"pod {pod.name} needs {pod.gpus} GPUs on one node; admission placed {shape}"
            )
        # Prefer the node it fills exactly, then the fullest: no GPU is stranded.
        node = min(fits, key=lambda n: (len(left[n]) != pod.gpus, -len(left[n]), n))
        placed[pod.key] = (node, tuple(left[node][: pod.gpus]))
        left[node] = left[node][pod.gpus :]
    return placed


def successor(last: Mapping[str, Any], suffix: str, job_id: str) -> Obj:
    """The pod of a later attempt (`suffix` "a<attempt>") or of another replica
    ("r<number>"), from the job's template: same spec, a name that says which; the
    webhook gives it a new handle when it is created."""
    tmpl = copy.deepcopy(dict(last))
    meta = tmpl.setdefault("metadata", {})
    meta.pop("uid", None)  # a new pod: the API server gives it its own
    base = re.sub(r"-[ar][0-9]+$", "", str(meta.get("name") or "pod"))
    meta["name"] = f"{base[:240]}-{suffix}"
    meta.setdefault("annotations", {})[L.JOB_ID] = job_id
    meta["labels"] = {**(meta.get("labels") or {}), L.CREATED_BY: "gpusched-agent"}
    tmpl.get("spec", {}).pop("nodeName", None)
    return {"apiVersion": "v1", "kind": "Pod", **tmpl}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def owner_reference(pod: Mapping[str, Any]) -> Obj:
    meta = pod.get("metadata") or {}
    return {"apiVersion": "v1", "kind": "Pod", "name": meta.get("name"), "uid": meta.get("uid")}


def job_secret(
    pod: Mapping[str, Any],
    handle: str,
    environ: Mapping[str, str],
    credentials: str | None,
    nats_ca: str | None = None,
) -> Obj:
    """The Secret the pod mounts: its job's environment (the SDK's variables), its
    NATS credentials file and the CA of NATS's certificate (PEM), when NATS has TLS.
    Owned by the pod, so it goes when the pod goes."""
    data = {k: _b64(v) for k, v in environ.items()}
    if credentials is not None:
        data[L.CREDENTIALS_KEY] = _b64(credentials)
    if nats_ca is not None:
        data[L.NATS_CA_KEY] = _b64(nats_ca)
    meta = pod.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": handle,
            "namespace": meta.get("namespace"),
            "labels": {L.JOB_ID: environ.get("GPUSCHED_JOB_ID", "")},
            "ownerReferences": [owner_reference(pod)],
        },
        "data": data,
    }


@dataclass(frozen=True, slots=True)
class DraNames:
    """How the DRA driver names things (NVIDIA's: driver and class gpu.nvidia.com, pools
    named after the node, devices gpu-<index>; MIG devices per the driver's naming)."""

    driver: str = "gpu.nvidia.com"
    device_class: str = "gpu.nvidia.com"
    device: str = "gpu-{index}"
    mig_device: str = "gpu-{index}-mig-{profile}-{slice}"

    def device_name(self, index: int, share: GpuShare | None) -> str:
        if share is not None and share.mig_profile is not None:
            return self.mig_device.format(
                index=index, profile=share.mig_profile.replace(".", ""), slice=share.mig_slice or 0
            )
        return self.device.format(index=index)


def gpu_claim(pod: Mapping[str, Any], handle: str, gpus: int, names: DraNames) -> Obj:
    meta = pod.get("metadata") or {}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {
            "name": handle,
            "namespace": meta.get("namespace"),
            "ownerReferences": [owner_reference(pod)],
        },
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {
                            "deviceClassName": names.device_class,
                            "allocationMode": "ExactCount",
                            "count": gpus,
                        },
                    }
                ]
            }
        },
    }


def claim_allocation(
    pod: Mapping[str, Any],
    node: str,
    indices: Sequence[int],
    share: GpuShare | None,
    names: DraNames,
) -> Obj:
    """The claim's status as a scheduler writes it: exactly the devices admission chose,
    on the pod's node, reserved for the pod (the kubelet's DRA driver prepares these)."""
    meta = pod.get("metadata") or {}
    return {
        "allocation": {
            "devices": {
                "results": [
                    {
                        "request": "gpus",
                        "driver": names.driver,
                        "pool": node,
                        "device": names.device_name(i, share),
                    }
                    for i in indices
                ]
            },
            "nodeSelector": {
                "nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}
                ]
            },
        },
        "reservedFor": [{"resource": "pods", "name": meta.get("name"), "uid": meta.get("uid")}],
    }


def claimed_devices(claim: Mapping[str, Any]) -> tuple[str, tuple[str, ...]] | None:
    """(pool, device names) a claim is allocated; None if it is not allocated."""
    results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
        "results"
    ) or []
    if not results:
        return None
    pools = {str(r.get("pool")) for r in results}
    return (",".join(sorted(pools)), tuple(sorted(str(r.get("device")) for r in results)))
