"""Controllers of the stand-in's cluster, played by the test as the kubelet is.

- `JobController`: batch/v1 Jobs, as kube-controller-manager's job controller does what
  the agent relies on: it makes `parallelism` pods from the Job's template (through the
  API, so the webhook wires them), named `<job>-<5 chars>`, labelled with the job's name
  and uid and owned by the Job (controller: true); a pod that is terminating or failed
  is replaced at once (podReplacementPolicy TerminatingOrFailed, the default without a
  podFailurePolicy); pods that failed count against `backoffLimit` (default 6), pods
  ended by a disruption (evicted, DisruptionTarget) do not (the podFailurePolicy
  `Ignore` rule for DisruptionTarget that checkpointed training uses); `completions`
  pods that succeeded complete the Job.
- `MigManager`: the GPU operator's MIG manager on every node: when a node's
  `nvidia.com/mig.config` label names a config it has not applied, it reports
  `nvidia.com/mig.config.state=pending`, reads the config from the mig-parted ConfigMap,
  applies it (the node's allocatable becomes the mixed strategy's: whole GPUs as
  nvidia.com/gpu, each MIG slice as nvidia.com/mig-<profile>) and reports `success`, or
  `failed` for a config it cannot find (or when told to fail the next one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import yaml

from tests.support.kubeapi import KubeApiStandIn, Obj

log = logging.getLogger(__name__)

JOB_NAME = "batch.kubernetes.io/job-name"
CONTROLLER_UID = "batch.kubernetes.io/controller-uid"
MIG_CONFIG = "nvidia.com/mig.config"
MIG_STATE = "nvidia.com/mig.config.state"


def _disrupted(pod: Obj) -> bool:
    status = pod.get("status") or {}
    return any(
        c.get("type") == "DisruptionTarget" and c.get("status") == "True"
        for c in status.get("conditions") or []
    )


@dataclass
class _Tracked:
    """What the controller counted of one Job (its status.* fields)."""

    uids: set[str] = field(default_factory=set)  # every pod it made
    seen: dict[str, Obj] = field(default_factory=dict)  # the last view of each live pod
    succeeded: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    created: list[str] = field(default_factory=list)  # pod names, in order


@dataclass
class JobController:
    api: KubeApiStandIn
    jobs: dict[tuple[str, str], _Tracked] = field(default_factory=dict)
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="job-controller")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def pods_of(self, namespace: str, job: str) -> list[str]:
        tracked = self.jobs.get((namespace, job))
        return [] if tracked is None else list(tracked.created)

    async def _run(self) -> None:
        while True:
            for job in self.api.list("jobs"):
                try:
                    await self._sync(job)
                except Exception:
                    log.exception("job controller: job %s", job["metadata"]["name"])
            await asyncio.sleep(0.05)

    async def _sync(self, job: Obj) -> None:
        meta, spec = job["metadata"], job["spec"]
        key = (meta["namespace"], meta["name"])
        tracked = self.jobs.setdefault(key, _Tracked())
        conditions = (job.get("status") or {}).get("conditions") or []
        if any(c.get("status") == "True" for c in conditions):
            return  # Complete or Failed
        mine = {
            p["metadata"]["uid"]: p
            for p in self.api.list("pods", meta["namespace"])
            if p["metadata"]["uid"] in tracked.uids
        }
        for uid, pod in mine.items():
            tracked.seen[uid] = pod
            phase = pod["status"].get("phase")
            if phase == "Succeeded":
                tracked.succeeded.add(uid)
            elif phase == "Failed" and not _disrupted(pod):
                tracked.failed.add(uid)
        for uid in [u for u in tracked.seen if u not in mine]:
            del tracked.seen[uid]  # deleted (an eviction): a disruption, not a failure
        completions = int(spec.get("completions", spec.get("parallelism", 1)))
        if len(tracked.succeeded) >= completions:
            return self._finish(job, tracked, "Complete", "all pods succeeded")
        if len(tracked.failed) > int(spec.get("backoffLimit", 6)):
            return self._finish(job, tracked, "Failed", "BackoffLimitExceeded")
        active = [
            p
            for p in mine.values()
            if p["status"].get("phase") not in ("Succeeded", "Failed")
            and "deletionTimestamp" not in p["metadata"]
        ]
        wanted = min(int(spec.get("parallelism", 1)), completions - len(tracked.succeeded))
        for _ in range(wanted - len(active)):
            await self._make_pod(job, tracked)

    async def _make_pod(self, job: Obj, tracked: _Tracked) -> None:
        meta = job["metadata"]
        template = job["spec"]["template"]
        labels = {
            **(template.get("metadata", {}).get("labels") or {}),
            JOB_NAME: meta["name"],
            CONTROLLER_UID: meta["uid"],
        }
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": f"{meta['name']}-{secrets.token_hex(3)[:5]}",
                "namespace": meta["namespace"],
                "labels": labels,
                "annotations": dict(template.get("metadata", {}).get("annotations") or {}),
                "ownerReferences": [
                    {
                        "apiVersion": "batch/v1",
                        "kind": "Job",
                        "name": meta["name"],
                        "uid": meta["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": dict(template["spec"]),
        }
        created = await self.api.create("pods", meta["namespace"], pod)
        tracked.uids.add(created["metadata"]["uid"])
        tracked.created.append(created["metadata"]["name"])

    def _finish(self, job: Obj, tracked: _Tracked, condition: str, reason: str) -> None:
        def finish(obj: Obj) -> None:
            obj["status"] = {
                "succeeded": len(tracked.succeeded),
                "failed": len(tracked.failed),
                "conditions": [{"type": condition, "status": "True", "reason": reason}],
            }

        self.api.mutate("jobs", job["metadata"]["name"], job["metadata"]["namespace"], finish)


@dataclass
class MigManager:
    api: KubeApiStandIn
    namespace: str
    configmap: str = "gpusched-mig-parted-config"
    # How long "applying" takes (the real one drains GPU pods and resets the GPUs).
    apply_s: float = 0.5
    fail_next: int = 0
    applied: dict[str, str] = field(default_factory=dict)  # node -> config name
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="mig-manager")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            for node in self.api.list("nodes"):
                try:
                    await self._sync(node)
                except Exception:
                    log.exception("MIG manager: node %s", node["metadata"]["name"])
            await asyncio.sleep(0.05)

    async def _sync(self, node: Obj) -> None:
        name = node["metadata"]["name"]
        labels = node["metadata"].get("labels") or {}
        wanted = labels.get(MIG_CONFIG)
        if not wanted or self.applied.get(name) == wanted:
            return
        self.applied[name] = wanted
        self._label(name, "pending")
        await asyncio.sleep(self.apply_s)
        layout = self._config(wanted)
        if layout is None or self.fail_next > 0:
            self.fail_next = max(0, self.fail_next - 1)
            self._label(name, "failed")
            return
        gpus = int(labels.get("nvidia.com/gpu.count", "0"))

        def apply(obj: Obj) -> None:
            allocatable = obj["status"]["allocatable"]
            for key in [k for k in allocatable if k.startswith("nvidia.com/mig-")]:
                del allocatable[key]
            slices: Counter[str] = Counter()
            in_mig = 0
            for entry in layout:
                if entry.get("mig-enabled"):
                    in_mig += len(entry["devices"])
                    for profile, n in (entry.get("mig-devices") or {}).items():
                        slices[profile] += int(n) * len(entry["devices"])
            allocatable["nvidia.com/gpu"] = str(gpus - in_mig)
            for profile, n in slices.items():
                allocatable[f"nvidia.com/mig-{profile}"] = str(n)
            obj["status"]["capacity"] = dict(allocatable)
            obj["metadata"]["labels"][MIG_STATE] = "success"

        self.api.mutate("nodes", name, "", apply)

    def _label(self, node: str, state: str) -> None:
        def set_state(obj: Obj) -> None:
            obj["metadata"].setdefault("labels", {})[MIG_STATE] = state

        self.api.mutate("nodes", node, "", set_state)

    def _config(self, name: str) -> list[dict[str, Any]] | None:
        configmap = self.api.get("configmaps", self.configmap, self.namespace)
        if configmap is None:
            return None
        parsed = yaml.safe_load((configmap.get("data") or {}).get("config.yaml") or "{}") or {}
        found = (parsed.get("mig-configs") or {}).get(name)
        return list(found) if found is not None else None
