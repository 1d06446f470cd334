"""The kubelet of the stand-in's nodes, played by the test.

A pod bound on the stand-in has no kubelet, so this one does its part: for a bound pod
it waits for what the real kubelet waits for (the pod's Secret and its allocated
ResourceClaim), gives the container the environment and the credentials file from
that Secret (as the secret volume and secretKeyRef env would), marks the pod Running
and runs its process: an SDK-using training loop (checkpoints to files, confirms them,
resumes from the checkpoint it is given); a gang's worker (env RANK other than 0: rank
0 checkpoints for the gang) and an inference replica (label gpusched.io/kind=inference)
just run until stopped. A pod being deleted gets SIGTERM (the loop stops) and is removed
after; a loop that ends sets the pod Succeeded or Failed with its exit code. As the
real kubelet does for a secret volume, it rewrites the mounted credentials file when
the Secret changes (environment variables are not refreshed).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gpusched.sdk import (
    AsyncJobClient,
    CheckpointRequest,
    JobEnvironment,
    SavedCheckpoint,
    checkpoint_path,
    save_file_checkpoint,
)
from tests.support.kubeapi import KubeApiStandIn, Obj

log = logging.getLogger(__name__)

SECRET_MOUNT = "/var/run/gpusched"


@dataclass
class Container:
    """One pod's process: what it was given and what it did."""

    pod: str
    node: str
    env: dict[str, str]
    devices: list[str]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[int] | None = None
    steps: list[int] = field(default_factory=list)
    resumed_from_step: int | None = None
    role: str = "train"  # train, worker (a gang's rank > 0) or serve (inference)
    secret: str = ""  # the pod's Secret (its handle)
    namespace: str = "default"
    # The credentials file as mounted, and how often the kubelet rewrote it.
    creds_file: Path | None = None
    creds_refreshed: int = 0


@dataclass
class Kubelet:
    api: KubeApiStandIn
    workdir: Path
    step_s: float = 0.05
    steps: int = 1_000_000
    # Nodes whose kubelet is down: their pods are left as they are.
    down: set[str] = field(default_factory=set)
    containers: dict[str, Container] = field(default_factory=dict)  # pod uid -> container
    _task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kubelet")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for container in self.containers.values():
            container.stop.set()
        tasks = [c.task for c in self.containers.values() if c.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)

    def busy(self, node: str) -> bool:
        """Whether a training process runs on `node` now (the inference load is the
        test's to say)."""
        return any(
            c.node == node and c.role != "serve" and c.task is not None and not c.task.done()
            for c in self.containers.values()
        )

    def of(self, pod_name: str) -> list[Container]:
        return [c for c in self.containers.values() if c.pod == pod_name]

    async def _run(self) -> None:
        while True:
            for pod in self.api.list("pods"):
                try:
                    await self._sync(pod)
                except Exception:
                    log.exception("kubelet: pod %s", pod["metadata"]["name"])
            await asyncio.sleep(0.05)

    async def _sync(self, pod: Obj) -> None:
        meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
        node = spec.get("nodeName")
        if not node or node in self.down:
            return
        uid = meta["uid"]
        container = self.containers.get(uid)
        if "deletionTimestamp" in meta:
            if container is not None and container.task is not None:
                container.stop.set()  # SIGTERM
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(asyncio.shield(container.task), 10)
            self.api.remove("pods", meta["name"], meta["namespace"])
            return
        if container is not None:
            self._refresh(container)
        if container is None and status.get("phase") == "Pending":
            started = self._prepare(pod)
            if started is not None:
                self.containers[uid] = started
                run = self._train(started) if started.role == "train" else self._serve(started)
                started.task = asyncio.create_task(run, name=f"pod-{meta['name']}")
                started.task.add_done_callback(
                    lambda t, name=meta["name"], ns=meta["namespace"]: self._ended(name, ns, t)
                )
                self.api.mutate("pods", meta["name"], meta["namespace"], _running)

    def _prepare(self, pod: Obj) -> Container | None:
        meta = pod["metadata"]
        handle = (meta.get("annotations") or {}).get("gpusched.io/handle")
        if not handle:
            return None
        secret = self.api.get("secrets", handle, meta["namespace"])
        claim = self.api.get("resourceclaims", handle, meta["namespace"])
        if secret is None or claim is None:
            return None  # the kubelet waits for the volume and the claim
        reserved = (claim.get("status") or {}).get("reservedFor") or []
        if not any(r.get("uid") == meta["uid"] for r in reserved):
            return None
        results = claim["status"]["allocation"]["devices"]["results"]
        data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
        env = {k: v for k, v in data.items() if k.startswith(("GPUSCHED_", "CUDA_"))}
        for container in pod["spec"].get("containers") or []:
            for var in container.get("env") or []:
                if "value" in var:
                    env.setdefault(var["name"], var["value"])
        mount = self.workdir / meta["uid"]
        mount.mkdir(parents=True, exist_ok=True)
        creds_file = None
        if "nats.creds" in data:
            creds_file = mount / "nats.creds"
            creds_file.write_text(data["nats.creds"])
            # The secret volume's file, where this test process can read it.
            env["GPUSCHED_NATS_CREDENTIALS"] = str(creds_file)
        labels = meta.get("labels") or {}
        role = (
            "serve"
            if labels.get("gpusched.io/kind") == "inference"
            else "worker"
            if env.get("RANK", "0") != "0"
            else "train"
        )
        return Container(
            meta["name"],
            pod["spec"]["nodeName"],
            env,
            [f"{r['pool']}/{r['device']}" for r in results],
            role=role,
            secret=handle,
            namespace=meta["namespace"],
            creds_file=creds_file,
        )

    def _refresh(self, c: Container) -> None:
        """The secret volume's sync: the file follows the Secret (a renewal)."""
        if c.creds_file is None or (c.task is not None and c.task.done()):
            return
        secret = self.api.get("secrets", c.secret, c.namespace)
        if secret is None or "nats.creds" not in (secret.get("data") or {}):
            return
        text = base64.b64decode(secret["data"]["nats.creds"]).decode()
        if c.creds_file.read_text() != text:
            tmp = c.creds_file.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(c.creds_file)  # atomically, as the kubelet swaps its symlink
            c.creds_refreshed += 1

    async def _serve(self, c: Container) -> int:
        """A gang's worker or an inference replica: busy until stopped."""
        await c.stop.wait()
        return 143

    async def _train(self, c: Container) -> int:
        env = JobEnvironment.from_environ(c.env)
        directory = env.checkpoint_dir or self.workdir / env.job_id
        directory.mkdir(parents=True, exist_ok=True)
        step = 0
        if env.resume_uri:
            step = json.loads(checkpoint_path(env.resume_uri).read_text())["step"]
            c.resumed_from_step = step
        async with AsyncJobClient.from_env(env) as job:
            await job.started(resumed_from=env.resume_checkpoint_id)
            while step < self.steps:
                if c.stop.is_set():
                    return 143  # stopped by SIGTERM
                message = await job.next_control(self.step_s)
                if isinstance(message, CheckpointRequest):
                    await job.handle_checkpoint(
                        message, lambda s=step: _save(directory, env.job_id, s)
                    )
                step += 1
                c.steps.append(step)
                if step % 20 == 0:
                    await job.progress(step)
            await job.completed(step)
        return 0

    def _ended(self, name: str, namespace: str, task: asyncio.Task[int]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        code = 1 if error is not None else task.result()
        if error is not None:
            log.error("pod %s failed: %r", name, error)
        if self.api.get("pods", name, namespace) is None:
            return

        def finish(pod: Obj) -> None:
            pod["status"]["phase"] = "Succeeded" if code == 0 else "Failed"
            for status in pod["status"].get("containerStatuses") or []:
                status["state"] = {
                    "terminated": {
                        "exitCode": code,
                        "reason": "Completed" if code == 0 else "Error",
                    }
                }
                status["ready"] = False

        if "deletionTimestamp" not in (self.api.get("pods", name, namespace) or {}).get(
            "metadata", {}
        ):
            self.api.mutate("pods", name, namespace, finish)


def _save(directory: Path, job_id: str, step: int) -> SavedCheckpoint:
    path = directory / f"ckpt-{step}.json"
    return save_file_checkpoint(
        path,
        lambda f: f.write(json.dumps({"job_id": job_id, "step": step}).encode()),
        step=step,
        checkpoint_id=f"{job_id}-step-{step}",
    )


def _running(pod: Obj) -> None:
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    pod["status"]["phase"] = "Running"
    pod["status"]["startTime"] = now
    pod["status"]["containerStatuses"] = [
        {
            "name": c["name"],
            "ready": True,
            "restartCount": 0,
            "state": {"running": {"startedAt": now}},
        }
        for c in pod["spec"].get("containers") or []
    ]


def gpu_node(name: str, pool: str, gpus: int = 8, *, ready: bool = True) -> Obj:
    """A GPU node as the GPU operator labels it (GPU feature discovery, device plugin)."""
    return {
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "gpusched.io/pool": pool,
                "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": "81920",
            },
        },
        "spec": {},
        "status": {
            "capacity": {
                "cpu": "128",
                "memory": "1056Gi",
                "nvidia.com/gpu": str(gpus),
                "pods": "110",
            },
            "allocatable": {
                "cpu": "127500m",
                "memory": "1048576Mi",
                "nvidia.com/gpu": str(gpus),
                "pods": "110",
            },
            "conditions": [
                {"type": "Ready", "status": "True" if ready else "False", "reason": "KubeletReady"}
            ],
        },
    }


def training_pod(
    name: str,
    *,
    team: str,
    priority: str,
    gpus: int,
    checkpoint_dir: Path,
    extra: dict[str, Any] | None = None,
) -> Obj:
    """A pod as a user writes it for kubectl: the gpusched scheduler, labels, GPU limits."""
    pod: Obj = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                "app": name,
                "gpusched.io/team": team,
                "gpusched.io/priority-class": priority,
            },
            "annotations": {"gpusched.io/checkpoint-dir": str(checkpoint_dir)},
        },
        "spec": {
            "schedulerName": "gpusched",
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 30,
            "containers": [
                {
                    "name": "train",
                    "image": "example.com/train:1",
                    "resources": {"limits": {"nvidia.com/gpu": str(gpus)}},
                }
            ],
        },
    }
    for key, value in (extra or {}).items():
        pod["metadata"]["labels"][key] = value
    return pod
