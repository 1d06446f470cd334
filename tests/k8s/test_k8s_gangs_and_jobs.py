"""End to end on Kubernetes: a gang's pods and a batch Job's pods through the real
gpusched services: submitted, bound (a gang all or none), evicted after a confirmed
checkpoint, made again (by the agent from the gang's templates; by the Job's controller)
and bound again, resumed from that checkpoint.

Admission here starts without an inventory file: its nodes are the cluster's, added by
the agent (GPUSCHED_ADMISSION__INVENTORY_SOURCE=agent).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes_asyncio import client

from gpusched.contracts.messages import T
from tests.support.kubelet import Container, training_pod
from tests.support.waiting import eventually

from .conftest import Cluster, inventory_is_the_clusters, now, running

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cluster_inventory() -> None:
    return None  # admission's inventory comes from the agent alone


async def _inventory_is_the_clusters(c: Cluster) -> None:
    await inventory_is_the_clusters(c)
    assert not c.bus.of(T.INVENTORY_LOADED)  # no file was read


async def _resumed(c: Cluster, pod: str, checkpoint: dict[str, Any]) -> Container:
    [container] = await eventually(lambda: now(c.kubelet.of(pod)), within=60)
    assert container.env["GPUSCHED_RESUME_CHECKPOINT_ID"] == checkpoint["checkpoint_id"]
    await eventually(lambda: now(container.resumed_from_step is not None), within=30)
    assert container.resumed_from_step == checkpoint["step"]
    return container


def _nodes(c: Cluster, *pods: str) -> dict[str, str] | None:
    """The node of each of `pods` once all are bound (None until then)."""
    nodes = {
        p: (c.api.get("pods", p, "default") or {}).get("spec", {}).get("nodeName") for p in pods
    }
    return None if not all(nodes.values()) else {p: str(n) for p, n in nodes.items()}


def _evictions(c: Cluster, pod: str) -> list[str]:
    return [p for m, p in c.api.requests if m == "POST" and p.endswith(f"/pods/{pod}/eviction")]


async def test_a_gangs_pods_are_bound_all_or_none_evicted_together_and_resumed_as_new_pods(
    cluster: Cluster,
) -> None:
    c = cluster
    await _inventory_is_the_clusters(c)
    gang = {"gpusched.io/gang": "llm", "gpusched.io/gang-size": "2"}
    pods = [
        training_pod(
            f"llm-{rank}",
            team="e2e",
            priority="p2-offline",
            gpus=8,
            checkpoint_dir=c.checkpoints,
            extra=gang,
        )
        for rank in range(2)
    ]
    # Rank 0 checkpoints for the gang; rank 1 is a worker.
    pods[1]["spec"]["containers"][0]["env"] = [{"name": "RANK", "value": "1"}]

    # One pod of the gang alone is not submitted: a gang is placed whole or not at all.
    await c.kubectl.create_namespaced_pod("default", pods[0])
    await asyncio.sleep(3)
    alone = c.api.get("pods", "llm-0", "default")
    assert alone is not None and "gpusched.io/job-id" not in alone["metadata"]["annotations"]
    assert not alone["spec"].get("nodeName")

    await c.kubectl.create_namespaced_pod("default", pods[1])
    job = await c.job_of("llm-0")
    assert await c.job_of("llm-1") == job
    await eventually(lambda: running(c, job), within=60)
    view = await c.job(job)
    assert view.gpus.count == 16
    bound = await eventually(lambda: now(_nodes(c, "llm-0", "llm-1")), within=30)
    assert sorted(bound.values()) == ["shared-00", "shared-01"]
    for name in ("llm-0", "llm-1"):
        [container] = await eventually(lambda n=name: now(c.kubelet.of(n)), within=30)
        node = bound[name]
        assert sorted(container.devices) == sorted(
            f"{g.node}/gpu-{g.index}" for g in view.allocated if g.node == node
        )
    await eventually(lambda: now(c.bus.of(T.JOB_STARTED, job_id=job)), within=30)

    # A surge: the gang is the shared pool's only job; both its pods go, through the
    # Eviction API, once rank 0 confirmed the checkpoint the saga asked for.
    c.inference_util = 0.95
    [completed] = await eventually(
        lambda: now(c.bus.of(T.EVICTION_COMPLETED, job_id=job)), within=90
    )
    assert _evictions(c, "llm-0") and _evictions(c, "llm-1")
    [request] = c.bus.of(T.CHECKPOINT_REQUESTED, job_id=job)
    confirmed = [i for i, d in c.bus.confirmations(job) if d["request_id"] == request["request_id"]]
    evict_at = c.bus.index(T.EVICT_WORKLOAD, job_id=job)
    assert confirmed and evict_at is not None and confirmed[0] < evict_at
    # One stop for the gang's allocation, once its last pod was gone.
    [stopped] = c.bus.of(T.WORKLOAD_STOPPED, job_id=job)
    assert stopped["reason"] == "evicted" and stopped["saga_id"] == completed["saga_id"]
    for name in ("llm-0", "llm-1"):
        await eventually(lambda n=name: now(c.api.get("pods", n, "default") is None), within=30)

    # The surge ends: the gang is placed again, whole, as two new pods made from its
    # templates, and rank 0 resumes from the checkpoint it confirmed. The API throttles
    # the first creates (429): an outage the start waits out, not the job's failure.
    seen = len(c.api.requests)
    c.api.fail_next("POST", "/namespaces/default/pods", 429, times=2)
    c.inference_util = 0.1
    await eventually(lambda: running(c, job, attempt=2), within=90)
    again = await eventually(lambda: now(_nodes(c, "llm-0-a2", "llm-1-a2")), within=30)
    creates = [p for m, p in c.api.requests[seen:] if m == "POST" and p.endswith("/default/pods")]
    assert len(creates) >= 4  # two throttled, then the gang's two pods
    assert sorted(again.values()) == ["shared-00", "shared-01"]
    await _resumed(c, "llm-0-a2", completed["checkpoint"])
    [worker] = await eventually(lambda: now(c.kubelet.of("llm-1-a2")), within=30)
    assert worker.role == "worker" and worker.env["GPUSCHED_ATTEMPT"] == "2"
    alloc = (await c.job(job)).allocation_id
    await eventually(lambda: now(c.bus.of(T.WORKLOAD_STARTED, allocation_id=alloc)), within=30)


async def test_a_batch_jobs_pod_is_evicted_and_its_controllers_next_pod_resumes(
    cluster: Cluster,
) -> None:
    c = cluster
    await _inventory_is_the_clusters(c)
    template = training_pod(
        "unused", team="e2e", priority="p2-offline", gpus=8, checkpoint_dir=c.checkpoints
    )
    batch = client.BatchV1Api(c.kubectl.api_client)
    await batch.create_namespaced_job(
        "default",
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "finetune"},
            "spec": {
                "parallelism": 1,
                "completions": 1,
                "backoffLimit": 0,
                # An eviction is not the job's failure (the checkpointed way of running).
                "podFailurePolicy": {
                    "rules": [
                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]}
                    ]
                },
                "template": {
                    "metadata": {
                        "labels": template["metadata"]["labels"],
                        "annotations": template["metadata"]["annotations"],
                    },
                    "spec": template["spec"],
                },
            },
        },
    )
    # A p1 pod fills the other shared node, so the surge must take the Job's GPUs.
    filler = training_pod(
        "filler", team="e2e", priority="p1-normal", gpus=8, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("default", filler)

    [first] = await eventually(
        lambda: now(c.jobs_controller.pods_of("default", "finetune")), within=30
    )
    job = await c.job_of(first)
    pod = c.api.get("pods", first, "default")
    assert pod is not None
    [owner] = pod["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("Job", "finetune", True)
    filled = await c.job_of("filler")
    await eventually(lambda: running(c, job), within=60)
    await eventually(lambda: running(c, filled), within=60)
    await eventually(lambda: now(c.kubelet.of(first)), within=30)
    await eventually(lambda: now(c.bus.of(T.JOB_STARTED, job_id=job)), within=30)

    c.inference_util = 0.95
    [completed] = await eventually(
        lambda: now(c.bus.of(T.EVICTION_COMPLETED, job_id=job)), within=90
    )
    assert _evictions(c, first)
    # The Job's controller made the next pod; the agent found it the same gpusched job
    # (its submit had the Job's key) and binds it when admission places the job again.
    second = await eventually(
        lambda: now(next(iter(c.jobs_controller.pods_of("default", "finetune")[1:]), None)),
        within=30,
    )
    assert await c.job_of(second) == job
    c.inference_util = 0.1
    await eventually(lambda: running(c, job, attempt=2), within=90)
    await eventually(
        lambda: now((c.api.get("pods", second, "default") or {}).get("spec", {}).get("nodeName")),
        within=30,
    )
    await _resumed(c, second, completed["checkpoint"])
    # The eviction did not count against the Job (it is neither failed nor done).
    stored = c.api.get("jobs", "finetune", "default")
    assert stored is not None and not (stored.get("status") or {}).get("conditions")
    assert c.jobs_controller.pods_of("default", "finetune") == [first, second]
