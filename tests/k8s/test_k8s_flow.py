"""End to end on Kubernetes: kubectl-style pods through the real gpusched services.

The Kubernetes agent runs as the stack's agent process and reaches the API stand-in
only through kubernetes_asyncio and a kubeconfig; the stand-in calls the agent's
webhook when a pod is created; the test plays kubectl, the kubelet (tests/support/
kubelet.py, which runs each pod's SDK training loop) and a DCGM exporter.
"""

from __future__ import annotations

from typing import Any

import pytest

from gpusched.contracts.messages import T
from tests.support.kubelet import training_pod
from tests.support.waiting import eventually

from .conftest import Cluster, now, running

pytestmark = pytest.mark.timeout(600)


async def test_a_kubectl_pod_is_bound_evicted_after_its_checkpoint_and_resumed_on_a_new_pod(
    cluster: Cluster,
) -> None:
    c = cluster
    # The agent made admission's inventory the cluster's: shared-01 added, gone-00 removed.
    await eventually(
        lambda: now(
            c.bus.of(T.INVENTORY_CHANGED, change="added")
            and c.bus.of(T.INVENTORY_CHANGED, change="removed")
        ),
        within=60,
    )
    offline = training_pod(
        "offline", team="e2e", priority="p2-offline", gpus=8, checkpoint_dir=c.checkpoints
    )
    normal = training_pod(
        "normal", team="e2e", priority="p1-normal", gpus=8, checkpoint_dir=c.checkpoints
    )
    await c.kubectl.create_namespaced_pod("default", offline)
    await c.kubectl.create_namespaced_pod("default", normal)
    job = await c.job_of("offline")
    other = await c.job_of("normal")
    await eventually(lambda: running(c, job), within=60)
    await eventually(lambda: running(c, other), within=60)
    await eventually(lambda: now(c.kubelet.of("offline") and c.kubelet.of("normal")), within=30)

    # Bound through the Binding API to the node admission chose, with a Secret (not the
    # pod spec) carrying the job's identity and credentials, and a claim naming exactly
    # the GPUs admission chose.
    view = await c.job(job)
    pod = c.api.get("pods", "offline", "default")
    assert pod is not None
    assert pod["spec"]["nodeName"] == view.allocated[0].node
    assert "NATS USER JWT" not in str(pod)  # the credentials are in the Secret only
    [container] = c.kubelet.of("offline")
    assert sorted(container.devices) == sorted(f"{g.node}/gpu-{g.index}" for g in view.allocated)
    assert container.env["GPUSCHED_JOB_ID"] == job
    await eventually(lambda: now(c.bus.of(T.JOB_STARTED, job_id=job)), within=30)

    # A watch expiry: the history is compacted and the watches cut; the agent lists again.
    c.api.compact()
    c.api.close_watches()

    # The surge: inference at 95% on its 8 GPUs needs 3 more; the shared pool is full, so
    # the p2 job is the victim, evicted through the Eviction API after its checkpoint.
    c.inference_util = 0.95
    [completed] = await eventually(
        lambda: now(c.bus.of(T.EVICTION_COMPLETED, job_id=job)), within=90
    )
    assert completed["checkpoint"]["checkpoint_id"]
    evictions = [
        p for m, p in c.api.requests if m == "POST" and p.endswith("/pods/offline/eviction")
    ]
    assert evictions
    [request] = c.bus.of(T.CHECKPOINT_REQUESTED, job_id=job)
    confirmed = [i for i, d in c.bus.confirmations(job) if d["request_id"] == request["request_id"]]
    evict_at = c.bus.index(T.EVICT_WORKLOAD, job_id=job)
    assert confirmed and evict_at is not None and confirmed[0] < evict_at
    [stopped] = c.bus.of(T.WORKLOAD_STOPPED, job_id=job, reason="evicted")
    assert stopped["saga_id"] == completed["saga_id"]
    await eventually(lambda: now(c.api.get("pods", "offline", "default") is None), within=30)
    assert not c.bus.of(T.CHECKPOINT_REQUESTED, job_id=other)

    # The surge ends: the GPUs go back and the job is placed again, on a new pod made
    # from its template, resumed from the checkpoint it confirmed.
    c.inference_util = 0.1
    await eventually(lambda: running(c, job, attempt=2), within=90)
    await eventually(
        lambda: now(
            (c.api.get("pods", "offline-a2", "default") or {}).get("spec", {}).get("nodeName")
        ),
        within=30,
    )
    [resumed] = await eventually(lambda: now(c.kubelet.of("offline-a2")), within=30)
    assert resumed.env["GPUSCHED_RESUME_CHECKPOINT_ID"] == completed["checkpoint"]["checkpoint_id"]
    # The container reads its checkpoint as it starts, just after the kubelet made it.
    await eventually(lambda: now(resumed.resumed_from_step is not None), within=30)
    assert resumed.resumed_from_step == completed["checkpoint"]["step"]
    started = await eventually(
        lambda: now([d for d in c.bus.of(T.JOB_STARTED, job_id=job) if d.get("resumed_from")]),
        within=30,
    )
    assert started[-1]["resumed_from"] == completed["checkpoint"]["checkpoint_id"]
    # Its watches were answered 410 Gone after the compaction, and it listed again.
    assert c.api.expired_watches >= 1
    lists = [
        p
        for m, p in c.api.requests
        if m == "GET" and p.startswith("/api/v1/pods?") and "watch=" not in p
    ]
    assert len(lists) >= 2


async def _node_change(c: Cluster, node: str, change: str) -> bool:
    return bool(
        [d for d in c.bus.of(T.INVENTORY_CHANGED, change=change) if d["node"]["name"] == node]
    )


async def test_cordon_pdb_refusal_agent_restart_notready_and_node_deletion(
    cluster: Cluster,
) -> None:
    c = cluster
    await eventually(lambda: _node_change(c, "shared-01", "added"), within=60)

    # kubectl cordon / uncordon: drained and undrained in admission.
    await c.kubectl.patch_node("shared-01", {"spec": {"unschedulable": True}})
    await eventually(lambda: _node_change(c, "shared-01", "drained"), within=30)
    await c.kubectl.patch_node("shared-01", {"spec": {"unschedulable": False}})
    await eventually(lambda: _node_change(c, "shared-01", "undrained"), within=30)

    # Two jobs fill the shared pool; a PodDisruptionBudget protects the p2 one.
    for name, priority in (("guarded", "p2-offline"), ("other", "p1-normal")):
        pod = training_pod(
            name, team="e2e", priority=priority, gpus=8, checkpoint_dir=c.checkpoints
        )
        await c.kubectl.create_namespaced_pod("default", pod)
    await c.policy.create_namespaced_pod_disruption_budget(
        "default",
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "guarded"},
            "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "guarded"}}},
        },
    )
    guarded, other = await c.job_of("guarded"), await c.job_of("other")
    await eventually(lambda: now(c.kubelet.of("guarded") and c.kubelet.of("other")), within=60)

    # The surge picks the p2 job; the Eviction API refuses (429), the agent retries, then
    # tells the saga, which handles it as the evict failure it knows; the pod runs on.
    c.inference_util = 0.95
    [failed] = await eventually(lambda: now(c.bus.of(T.EVICT_FAILED, job_id=guarded)), within=90)
    assert "disruption budget" in failed["error"]
    refused = [p for m, p in c.api.requests if m == "POST" and p.endswith("/pods/guarded/eviction")]
    assert len(refused) >= 2  # retried before giving up
    pod = c.api.get("pods", "guarded", "default")
    assert pod is not None and "deletionTimestamp" not in pod["metadata"]
    c.inference_util = 0.1
    live = [
        a for a in {(await c.job(guarded)).allocation_id, (await c.job(other)).allocation_id} if a
    ]

    # kill -9 of the agent: the new one lists the cluster and says what runs; nothing
    # that ran is interrupted.
    readies = len(c.bus.of(T.AGENT_READY))
    c.stack.kill("agent")
    await eventually(lambda: now(len(c.bus.of(T.AGENT_READY)) > readies), within=60)
    ready = c.bus.of(T.AGENT_READY)[-1]
    guarded_alloc = (await c.job(guarded)).allocation_id
    assert guarded_alloc in ready["running"]
    assert set(ready["running"]) >= {a for a in live if a == guarded_alloc}
    assert await c.state(guarded) == "running"

    # The guarded pod's node goes NotReady: admission fails it and requeues its job.
    node = c.api.get("pods", "guarded", "default")["spec"]["nodeName"]  # type: ignore[index]
    c.kubelet.down.add(node)

    def not_ready(obj: dict[str, Any]) -> None:
        obj["status"]["conditions"] = [
            {
                "type": "Ready",
                "status": "Unknown",
                "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status.",
            }
        ]

    c.api.mutate("nodes", node, "", not_ready)
    await eventually(lambda: _node_change(c, node, "failed"), within=30)
    await eventually(lambda: now(c.bus.of(T.ALLOCATION_RELEASED, job_id=guarded)), within=30)
    # Its allocation ended, so its pod must not run on: the agent deletes it. The node's
    # kubelet is away, so the pod stays Terminating, as Kubernetes keeps it.
    await eventually(
        lambda: now(
            "deletionTimestamp"
            in (c.api.get("pods", "guarded", "default") or {}).get("metadata", {})
        ),
        within=30,
    )
    await eventually(lambda: now(c.events("guarded", "GpuschedReleased")), within=30)
    # A restarted agent does not report the pod on the failed node as running.
    readies = len(c.bus.of(T.AGENT_READY))
    c.stack.kill("agent")
    await eventually(lambda: now(len(c.bus.of(T.AGENT_READY)) > readies), within=60)
    assert guarded_alloc not in c.bus.of(T.AGENT_READY)[-1]["running"]

    # The node comes back: its kubelet stops the deleted pod's container, and the job
    # (requeued from its checkpoint) runs again on a new pod only.
    c.kubelet.down.discard(node)

    def ready_again(obj: dict[str, Any]) -> None:
        obj["status"]["conditions"] = [
            {"type": "Ready", "status": "True", "reason": "KubeletReady"}
        ]

    c.api.mutate("nodes", node, "", ready_again)
    await eventually(lambda: now(c.api.get("pods", "guarded", "default") is None), within=30)
    [old] = c.kubelet.of("guarded")
    assert old.task is not None and old.task.done()
    await eventually(lambda: running(c, guarded, attempt=2), within=60)
    [again] = await eventually(lambda: now(c.kubelet.of("guarded-a2")), within=30)
    assert again.task is not None and not again.task.done()

    # Deleted from the cluster: removed from admission's inventory.
    await c.kubectl.delete_node(node)
    await eventually(lambda: _node_change(c, node, "removed"), within=30)
