"""End to end on Kubernetes, what a pod is given: a MIG slice through the GPU operator's
MIG manager, the devices admission chose (a claim found allocated to others is
corrected, and said), job credentials renewed in the pod's Secret while it runs, and a
team that comes from the namespace, never from what the pod says of itself.

Job credentials live 4 s here (renewed every third of that), so a job that keeps
publishing for several lifetimes does so on renewed credentials only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from typing import Any

import pytest
import yaml

from gpusched.contracts.messages import T
from tests.support.kubelet import training_pod
from tests.support.waiting import eventually

from .conftest import Cluster, now, running

pytestmark = pytest.mark.timeout(600)

CREDENTIAL_TTL_S = 4.0


@pytest.fixture
def cluster_env() -> dict[str, str]:
    return {"GPUSCHED_SECURITY__JOB_CREDENTIAL_TTL_S": str(CREDENTIAL_TTL_S)}


@pytest.fixture
def cluster_inventory() -> None:
    return None  # admission's inventory comes from the agent alone


def _progress(c: Cluster, job_id: str) -> int:
    """How many job.progress events of `job_id` crossed the bus."""
    return sum(1 for _, _, t, _, corr in c.bus.messages if t == T.JOB_PROGRESS and corr == job_id)


def _jwt_claims(creds: str) -> dict[str, Any]:
    jwt = creds.split("-----BEGIN NATS USER JWT-----")[1].split("------END")[0].strip()
    claims: dict[str, Any] = json.loads(base64.urlsafe_b64decode(jwt.split(".")[1] + "=="))
    return claims


async def test_an_inference_pod_gets_a_mig_slice_the_mig_manager_laid_out(
    cluster: Cluster,
) -> None:
    c = cluster
    pod = training_pod(
        "llm-serve",
        team="e2e",
        priority="inference",
        gpus=1,
        checkpoint_dir=c.checkpoints,
        extra={"gpusched.io/kind": "inference"},
    )
    pod["metadata"]["annotations"].update(
        {"gpusched.io/gpu-memory-gib": "15", "gpusched.io/checkpointable": "false"}
    )
    await c.kubectl.create_namespaced_pod("default", pod)
    job = await c.job_of("llm-serve")
    [configure] = await eventually(lambda: now(c.bus.of(T.MIG_CONFIGURE)), within=60)
    assert configure["node"] == "inf-00"
    assert configure["profiles"] == ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"]
    # The agent asked the MIG manager: the node's mig.config names a config of the
    # agent's ConfigMap with that GPU's slices; the manager reported success.
    [configured] = await eventually(lambda: now(c.bus.of(T.MIG_CONFIGURED)), within=60)
    assert configured["change_id"] == configure["change_id"]
    node = c.api.get("nodes", "inf-00")
    assert node is not None
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/mig.config.state"] == "success"
    assert labels["nvidia.com/mig.config"].startswith("gpusched-")
    cm = c.api.get("configmaps", "gpusched-mig-parted-config", "gpusched")
    assert cm is not None
    layout = yaml.safe_load(cm["data"]["config.yaml"])["mig-configs"][
        labels["nvidia.com/mig.config"]
    ]
    assert layout == [
        {
            "devices": [configure["gpu"]],
            "mig-enabled": True,
            "mig-devices": {"1g.10gb": 1, "2g.20gb": 3},
        }
    ]
    # The node now advertises 7 whole GPUs and the slices: still 8 GPUs to admission
    # (never drained or removed for it).
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == "7"
    assert node["status"]["allocatable"]["nvidia.com/mig-2g.20gb"] == "3"
    assert not [
        d
        for d in c.bus.of(T.INVENTORY_CHANGED)
        if d["node"]["name"] == "inf-00" and d["change"] in ("drained", "removed")
    ]

    # Placed on a 2g.20gb slice of that GPU: the pod's claim names that MIG device.
    await eventually(lambda: running(c, job), within=60)
    view = await c.job(job)
    assert view.share is not None and view.share.mig_profile == "2g.20gb"
    [container] = await eventually(lambda: now(c.kubelet.of("llm-serve")), within=30)
    [device] = container.devices
    assert device.startswith(f"inf-00/gpu-{configure['gpu']}-mig-2g20gb-")


async def test_two_fractions_share_one_gpu_each_with_its_mps_limits_in_its_environment(
    cluster: Cluster,
) -> None:
    c = cluster
    jobs = []
    for name in ("half-a", "half-b"):
        pod = training_pod(
            name, team="e2e", priority="p1-normal", gpus=1, checkpoint_dir=c.checkpoints
        )
        pod["metadata"]["annotations"].update(
            {"gpusched.io/gpu-milli": "500", "gpusched.io/gpu-memory-gib": "30"}
        )
        await c.kubectl.create_namespaced_pod("default", pod)
        jobs.append(await c.job_of(name))
    for job in jobs:
        await eventually(lambda j=job: running(c, j), within=60)
    containers = [
        (await eventually(lambda n=name: now(c.kubelet.of(n)), within=30))[0]
        for name in ("half-a", "half-b")
    ]
    # Admission packed both halves on one GPU; each pod's claim names it, and each gets
    # its share as MPS limits (what Kubernetes alone cannot enforce: docs above).
    assert containers[0].devices == containers[1].devices and len(containers[0].devices) == 1
    for container in containers:
        assert container.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert container.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=30720M"


async def test_a_claim_allocated_to_other_devices_is_corrected_and_said(cluster: Cluster) -> None:
    c = cluster
    # Both shared nodes cordoned: the pod waits, wired by the webhook, not placed.
    for node in ("shared-00", "shared-01"):
        await c.kubectl.patch_node(node, {"spec": {"unschedulable": True}})
    for node in ("shared-00", "shared-01"):
        await eventually(
            lambda n=node: now(
                [
                    d
                    for d in c.bus.of(T.INVENTORY_CHANGED, change="drained")
                    if d["node"]["name"] == n
                ]
            ),
            within=60,
        )
    pod = training_pod(
        "tuned", team="e2e", priority="p1-normal", gpus=2, checkpoint_dir=c.checkpoints
    )
    created = await c.kubectl.create_namespaced_pod("default", pod)
    handle = created.metadata.annotations["gpusched.io/handle"]
    job = await c.job_of("tuned")
    # Someone else (another scheduler, an earlier attempt) allocated the pod's claim to
    # two GPUs of the inference node.
    c.api.put(
        "resourceclaims",
        {
            "metadata": {"name": handle, "namespace": "default"},
            "spec": {"devices": {"requests": [{"name": "gpus", "exactly": {"count": 2}}]}},
            "status": {
                "allocation": {
                    "devices": {
                        "results": [
                            {
                                "request": "gpus",
                                "driver": "gpu.nvidia.com",
                                "pool": "inf-00",
                                "device": f"gpu-{i}",
                            }
                            for i in (6, 7)
                        ]
                    }
                }
            },
        },
    )
    for node in ("shared-00", "shared-01"):
        await c.kubectl.patch_node(node, {"spec": {"unschedulable": False}})
    await eventually(lambda: running(c, job), within=60)
    view = await c.job(job)
    [container] = await eventually(lambda: now(c.kubelet.of("tuned")), within=30)
    assert sorted(container.devices) == sorted(f"{g.node}/gpu-{g.index}" for g in view.allocated)
    assert not any(d.startswith("inf-00/") for d in container.devices)
    # Never silent: an audit record and an Event on the pod.
    [audit] = await eventually(lambda: now(c.audits("k8s.claim_corrected")), within=30)
    assert audit["entity"] == job and "inf-00" in audit["reason"]
    assert c.events("tuned", "GpuschedClaimCorrected")


async def test_a_running_pods_credentials_are_renewed_in_its_secret_and_its_job_keeps_reporting(
    cluster: Cluster,
) -> None:
    c = cluster
    pod = training_pod(
        "steady", team="e2e", priority="p1-normal", gpus=1, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("default", pod)
    job = await c.job_of("steady")
    await eventually(lambda: running(c, job), within=60)
    [container] = await eventually(lambda: now(c.kubelet.of("steady")), within=30)
    assert container.creds_file is not None
    first = _jwt_claims(container.creds_file.read_text())
    assert first["exp"] - time.time() <= CREDENTIAL_TTL_S + 1

    # Three lifetimes later: renewals rewrote the Secret, the kubelet the mounted file.
    await asyncio.sleep(max(0.0, first["exp"] + 2 * CREDENTIAL_TTL_S - time.time()))
    renewals = c.bus.of(T.RENEW_CREDENTIALS, job_id=job)
    assert len(renewals) >= 3
    secret = c.api.get("secrets", container.secret, "default")
    assert secret is not None
    current = base64.b64decode(secret["data"]["nats.creds"]).decode()
    assert _jwt_claims(current)["exp"] > first["exp"] + CREDENTIAL_TTL_S
    assert container.creds_refreshed >= 2
    await eventually(lambda: now(container.creds_file.read_text() == current), within=10)  # type: ignore[union-attr]
    # The first credentials died long ago; the job still reports, on the renewed ones.
    progressed = _progress(c, job)
    await eventually(lambda: now(_progress(c, job) > progressed + 1), within=20)
    assert (await c.job(job)).state == "running"


async def test_a_pod_is_its_namespaces_teams_whatever_its_label_claims(cluster: Cluster) -> None:
    c = cluster
    # In namespace ml (team e2e) a pod claiming team research is refused, with an Event.
    liar = training_pod(
        "liar", team="research", priority="p1-normal", gpus=1, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("ml", liar)
    [event] = await eventually(lambda: now(c.events("liar", "GpuschedRefused", "ml")), within=30)
    assert "claims another team than namespace ml's (e2e)" in event["message"]
    # In namespace research the same pod is research's, and runs.
    honest = training_pod(
        "honest", team="research", priority="p1-normal", gpus=1, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("research", honest)
    job = await c.job_of("honest", "research")
    assert (await c.job(job)).team == "research"
    # Namespace other's team is not one the agent's credential names: admission refuses.
    stranger = training_pod(
        "stranger", team="other", priority="p1-normal", gpus=1, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("other", stranger)
    [refused] = await eventually(
        lambda: now(c.events("stranger", "GpuschedRefused", "other")), within=30
    )
    assert "agent:k8s may not submit" in refused["message"]
    # A namespace without a team: refused, saying how to give it one; labelled, it runs.
    c.api.put("namespaces", {"metadata": {"name": "scratch", "labels": {}}})
    orphan = training_pod(
        "orphan", team="e2e", priority="p1-normal", gpus=1, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("scratch", orphan)
    [why] = await eventually(
        lambda: now(c.events("orphan", "GpuschedRefused", "scratch")), within=30
    )
    assert "kubectl label namespace scratch gpusched.io/team=<team>" in why["message"]
    await c.kubectl.patch_namespace(
        "scratch", {"metadata": {"labels": {"gpusched.io/team": "e2e"}}}
    )
    orphaned = await c.job_of("orphan", "scratch")
    await eventually(lambda: running(c, orphaned), within=60)
    for name, namespace in (("liar", "ml"), ("stranger", "other")):
        obj = c.api.get("pods", name, namespace)
        assert obj is not None and "gpusched.io/job-id" not in obj["metadata"]["annotations"]
