"""End to end on Kubernetes: an inference service's replicas, one pod each, made from the
service's pod and scaled by admission's replica decisions; what admission ends (a
scale-down, a cancel) no longer runs, and a restarted agent reports only what lives."""

from __future__ import annotations

from typing import Any

import pytest

from gpusched.contracts.messages import GpuRequest, SubmitJob, T, WorkloadSpec
from tests.support.kubelet import training_pod
from tests.support.waiting import eventually

from .conftest import Cluster, inventory_is_the_clusters, now, running

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def cluster_inventory() -> None:
    return None  # admission's inventory comes from the agent alone


def _service_pod(c: Cluster, replicas: str) -> dict[str, Any]:
    pod = training_pod(
        "web",
        team="e2e",
        priority="inference",
        gpus=1,
        checkpoint_dir=c.checkpoints,
        extra={"gpusched.io/kind": "inference", "gpusched.io/replicas": replicas},
    )
    pod["metadata"]["annotations"]["gpusched.io/checkpointable"] = "false"
    return pod


def _pods_of(c: Cluster, job_id: str) -> dict[str, dict[str, Any]]:
    """The job's pods that run or may run (not being deleted), by name."""
    return {
        p["metadata"]["name"]: p
        for p in c.api.list("pods", "default")
        if (p["metadata"].get("annotations") or {}).get("gpusched.io/job-id") == job_id
        and "deletionTimestamp" not in p["metadata"]
    }


async def _live(c: Cluster, job_id: str) -> list[str]:
    view = await c.job(job_id)
    return [] if view.replicas is None else list(view.replicas.allocation_ids)


async def _each_replica_one_bound_pod(c: Cluster, job_id: str, count: int) -> bool:
    """`count` replicas live, each run by exactly one bound pod of its own."""
    live = await _live(c, job_id)
    pods = _pods_of(c, job_id)
    by_alloc = {
        (p["metadata"].get("annotations") or {}).get("gpusched.io/allocation-id"): p
        for p in pods.values()
        if p["spec"].get("nodeName")
    }
    return len(live) == count == len(pods) and set(by_alloc) == set(live)


async def test_an_inference_service_runs_one_pod_per_replica_scaled_by_admission(
    cluster: Cluster,
) -> None:
    c = cluster
    await c.kubectl.create_namespaced_pod("default", _service_pod(c, "2:4"))
    job = await c.job_of("web")
    # Admission places up to max: the pod as written is the first replica, the others
    # are pods made from it, one per replica allocation, each on GPUs of its own.
    await eventually(lambda: _each_replica_one_bound_pod(c, job, 4), within=90)
    pods = _pods_of(c, job)
    assert "web" in pods and all(n == "web" or n.startswith("web-r") for n in pods)
    for name in pods:
        await eventually(lambda n=name: now(c.kubelet.of(n)), within=30)
    devices = [d for name in pods for container in c.kubelet.of(name) for d in container.devices]
    assert len(devices) == len(set(devices)) == 4
    assert {d.split("/")[0] for d in devices} == {"inf-00"}
    secrets = {p["metadata"]["annotations"]["gpusched.io/handle"] for p in pods.values()}
    assert len(secrets) == 4  # each replica its own Secret (and job credentials)

    # Scaled down to 2: admission releases the newest replicas; their pods go.
    reply = await c.jobs.call("api.jobs.scale", {"job_id": job, "replicas": 2})
    assert reply["ok"], reply
    await eventually(lambda: _each_replica_one_bound_pod(c, job, 2), within=60)
    kept = set(_pods_of(c, job))
    # Up to 3: one more replica, one more pod from the service's template.
    reply = await c.jobs.call("api.jobs.scale", {"job_id": job, "replicas": 3})
    assert reply["ok"], reply
    await eventually(lambda: _each_replica_one_bound_pod(c, job, 3), within=60)
    [added] = set(_pods_of(c, job)) - kept
    assert added.startswith("web-r")
    await eventually(lambda: now(c.kubelet.of(added)), within=30)

    # kill -9 of the agent: the new one reports exactly the live replicas as running.
    readies = len(c.bus.of(T.AGENT_READY))
    c.stack.kill("agent")
    await eventually(lambda: now(len(c.bus.of(T.AGENT_READY)) > readies), within=60)
    ready = c.bus.of(T.AGENT_READY)[-1]
    assert sorted(ready["running"]) == sorted(await _live(c, job))

    # Cancelled: every replica's pod is deleted and nothing is reported running.
    reply = await c.jobs.call(
        "api.jobs.cancel", {"job_id": job, "operator": "e2e", "reason": "the test is done"}
    )
    assert reply["ok"], reply
    await eventually(lambda: now(not _pods_of(c, job)), within=60)
    await eventually(lambda: _state_is(c, job, "cancelled"), within=60)


async def _state_is(c: Cluster, job_id: str, state: str) -> bool:
    return await c.state(job_id) == state


async def test_a_deployments_pods_are_refused_saying_how_to_write_a_service_and_one_left_runs(
    cluster: Cluster,
) -> None:
    c = cluster
    # Two pods of one ReplicaSet (a Deployment of gpusched pods): one submission key, so
    # one gpusched job only one of them could run. A pod of it seen with a sibling is
    # refused, with the way out (the first may have been submitted before the second
    # existed: it is the job).
    owner = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9",
             "uid": "3f1c0c7e-rs", "controller": True}  # fmt: skip
    names = ("web-7d9-a", "web-7d9-b")
    for name in names:
        pod = _service_pod(c, "1")
        pod["metadata"]["name"] = name
        pod["metadata"]["labels"].pop("gpusched.io/replicas")
        pod["metadata"]["ownerReferences"] = [owner]
        await c.kubectl.create_namespaced_pod("default", pod)
    [event] = await eventually(lambda: now(c.events("web-7d9-b", "GpuschedRefused")), within=30)
    assert "gpusched.io/replicas" in event["message"] and "a gang" in event["message"]
    # Scaled down to one pod: the one left is the job, and runs.
    await c.kubectl.delete_namespaced_pod("web-7d9-b", "default")
    job = await c.job_of("web-7d9-a")
    await eventually(lambda: now(c.kubelet.of("web-7d9-a")), within=60)
    assert (await c.job(job)).state == "running"
    assert len({d["job_id"] for d in c.bus.of(T.WORKLOAD_STARTED)}) == 1


async def test_a_job_submitted_with_a_pod_template_runs_as_a_pod_in_its_teams_namespace_only(
    cluster: Cluster,
) -> None:
    c = cluster

    def submitted(name: str, namespace: str) -> SubmitJob:
        pod = training_pod(
            name, team="e2e", priority="p1-normal", gpus=2, checkpoint_dir=c.checkpoints
        )
        pod["metadata"]["namespace"] = namespace
        return SubmitJob(
            name=name,
            team="e2e",
            gpus=GpuRequest(count=2),
            workload=WorkloadSpec(kind="pod", pod={"pods": [pod], "controller": None}),
        )

    # Through gpusched's own API: the agent makes the pod from the template, in the
    # template's namespace (team e2e's), and binds it.
    await inventory_is_the_clusters(c)
    reply = await c.jobs.submit(submitted("from-api", "ml"))
    assert reply.ok and reply.job_id, reply
    await eventually(lambda: running(c, reply.job_id), within=60)  # type: ignore[arg-type]
    made = await eventually(
        lambda: now((c.api.get("pods", "from-api-a1", "ml") or {}).get("spec", {}).get("nodeName")),
        within=30,
    )
    assert made in ("shared-00", "shared-01")
    await eventually(lambda: now(c.kubelet.of("from-api-a1")), within=30)
    # A template in another team's namespace is not made: the start fails, saying why.
    other = await c.jobs.submit(submitted("elsewhere", "research"))
    assert other.ok and other.job_id, other
    [stopped] = await eventually(
        lambda: now(c.bus.of(T.WORKLOAD_STOPPED, job_id=other.job_id)), within=60
    )
    assert stopped["reason"] == "failed"
    [audit] = await eventually(lambda: now(c.audits("k8s.start_failed")), within=30)
    assert "claims another team than namespace research's" in audit["reason"]
    assert not [
        p for p in c.api.list("pods", "research") if p["metadata"]["name"].startswith("elsewhere")
    ]
