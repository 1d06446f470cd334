"""The agent's Kubernetes edge (kube.py, informer.py, lease.py) against the API stand-in,
through kubernetes_asyncio: the API behaviours the agent must survive, one at a time."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg

from gpusched.agent.kubernetes.agent import KubernetesAgent
from gpusched.agent.kubernetes.informer import Informer
from gpusched.agent.kubernetes.kube import Conflict, Kube, NotFound, TooManyRequests, connect
from gpusched.agent.kubernetes.lease import LeaderLease
from gpusched.agent.publisher import Publisher
from gpusched.contracts.subjects import Subjects
from gpusched.infra.errors import Unavailable
from gpusched.infra.settings import KubernetesSettings
from tests.conftest import Servers
from tests.support.kubeapi import KubeApiStandIn, kubeconfig
from tests.support.kubelet import gpu_node, training_pod
from tests.support.tls import make_pki
from tests.support.waiting import eventually


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[KubeApiStandIn, Kube]]:
    import ssl

    pki = make_pki(tmp_path / "pki")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    server = KubeApiStandIn(bookmark_interval_s=0.2)
    url = await server.start(context)
    kube = Kube(await connect(kubeconfig(url, server.token, pki.ca_file, tmp_path / "kc")))
    try:
        yield server, kube
    finally:
        await kube.close()
        await server.stop()


async def _async(value: Any) -> Any:
    return value


async def test_a_stale_update_is_a_conflict_and_an_unknown_pod_not_found(
    api: tuple[KubeApiStandIn, Kube],
) -> None:
    _, kube = api
    secret = {"metadata": {"name": "s", "namespace": "ml"}, "data": {}}
    created = await kube.create_secret("ml", secret)
    await kube.replace_secret(created)  # its version is current
    with pytest.raises(Conflict):
        await kube.replace_secret(created)  # now it is stale
    with pytest.raises(NotFound):
        await kube.get_pod("ml", "nope")


async def test_annotations_are_merged_into_a_pod_and_a_null_removes_one(
    api: tuple[KubeApiStandIn, Kube],
) -> None:
    server, kube = api
    pod = training_pod("p", team="t", priority="p1-normal", gpus=1, checkpoint_dir=Path("/c"))
    await kube.create_pod("ml", pod)
    await kube.patch_pod_annotations("ml", "p", {"gpusched.io/refused": "no team"})
    await kube.patch_pod_annotations(
        "ml", "p", {"gpusched.io/job-id": "job-1", "gpusched.io/refused": None}
    )
    notes = (server.get("pods", "p", "ml") or {})["metadata"]["annotations"]
    assert notes["gpusched.io/job-id"] == "job-1" and "gpusched.io/refused" not in notes
    assert notes["gpusched.io/checkpoint-dir"] == "/c"  # the rest of the pod untouched


async def test_binding_a_bound_pod_is_a_conflict(api: tuple[KubeApiStandIn, Kube]) -> None:
    server, kube = api
    await kube.create_pod("ml", training_pod("p", team="t", priority="p1-normal", gpus=1,
                                             checkpoint_dir=Path("/c")))  # fmt: skip
    await kube.bind("ml", "p", "n1")
    assert server.get("pods", "p", "ml")["spec"]["nodeName"] == "n1"  # type: ignore[index]
    with pytest.raises(Conflict, match="already assigned"):
        await kube.bind("ml", "p", "n2")


async def test_an_eviction_a_budget_forbids_is_429_and_allowed_once_the_budget_is_gone(
    api: tuple[KubeApiStandIn, Kube],
) -> None:
    server, kube = api
    await kube.create_pod("ml", training_pod("p", team="t", priority="p1-normal", gpus=1,
                                             checkpoint_dir=Path("/c")))  # fmt: skip
    await kube.bind("ml", "p", "n1")
    server.mutate("pods", "p", "ml", lambda pod: pod["status"].update(phase="Running"))
    server.put("poddisruptionbudgets", {"metadata": {"name": "b", "namespace": "ml"},
               "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "p"}}}})  # fmt: skip
    with pytest.raises(TooManyRequests) as refused:
        await kube.evict("ml", "p", 5)
    assert "disruption budget" in refused.value.body["details"]["causes"][0]["message"]
    server.remove("poddisruptionbudgets", "b", "ml")
    await kube.evict("ml", "p", 5)
    pod = server.get("pods", "p", "ml")
    assert pod is not None and pod["metadata"]["deletionGracePeriodSeconds"] == 5


async def test_a_server_error_or_an_unreachable_api_is_an_outage(
    api: tuple[KubeApiStandIn, Kube],
) -> None:
    server, kube = api
    server.fail_next("GET", "/api/v1/nodes", 503)
    with pytest.raises(Unavailable):
        await kube.list_nodes()
    await server.stop()
    with pytest.raises(Unavailable):
        await kube.list_nodes()


async def test_the_informer_follows_changes_through_bookmarks_expiry_and_cut_watches(
    api: tuple[KubeApiStandIn, Kube],
) -> None:
    server, kube = api
    server.put("nodes", gpu_node("n1", "shared"))
    seen: list[tuple[str, str]] = []
    informer = Informer(
        kube,
        "nodes",
        lambda kind, obj: seen.append((kind, obj["metadata"]["name"])),
        watch_timeout_s=2,
    )
    task = asyncio.create_task(informer.run())
    try:
        await asyncio.wait_for(informer.synced.wait(), 10)
        server.put("nodes", gpu_node("n2", "shared"))
        await eventually(lambda: _async(("ADDED", "n2") in seen))
        # Bookmarks move its version on while nothing it watches changes.
        version = informer.resource_version
        server.put("configmaps", {"metadata": {"name": "x", "namespace": "gpusched"}})
        await eventually(lambda: _async(informer.resource_version != version))
        # The watch is cut, n1 deleted and the history compacted before the informer can
        # watch again (one event-loop turn): 410 Gone, a new list, the deletion not missed.
        server.close_watches()
        server.remove("nodes", "n1")
        server.compact()
        await eventually(lambda: _async(("DELETED", "n1") in seen), within=10)
        assert server.expired_watches >= 1 and informer.relists >= 1
        assert set(informer.cache) == {("", "n2")}
    finally:
        task.cancel()


async def test_one_replica_leads_and_another_takes_over_once_the_lease_expires(
    api: tuple[KubeApiStandIn, Kube],
) -> None:
    _, kube = api
    first = LeaderLease(kube, "gpusched", "agent", "a", duration_s=1)
    second = LeaderLease(kube, "gpusched", "agent", "b", duration_s=1)
    assert await first.try_acquire()
    assert not await second.try_acquire()
    assert await first.try_acquire()  # a renewal
    await asyncio.sleep(1.2)  # a whole duration without renewal
    assert await second.try_acquire()
    assert not await first.try_acquire()


async def test_a_submit_admission_cannot_take_now_is_tried_again_not_refused_for_good(
    api: tuple[KubeApiStandIn, Kube], servers: Servers, prefix: str
) -> None:
    """Admission answers `unavailable` while it waits out its own outage: the pod is
    submitted again on the next pass, never marked refused."""
    server, kube = api
    nc = await nats.connect(servers.nats_url, **servers.nats_options)
    subjects = Subjects(prefix)
    answers = [
        {"ok": False, "error": {"code": "unavailable", "message": "try again in a few seconds"}},
        {"ok": True, "job_id": "job-1"},
    ]
    asked: list[bytes] = []

    async def admission(msg: Msg) -> None:
        asked.append(msg.data)
        await msg.respond(json.dumps(answers[min(len(asked), len(answers)) - 1]).encode())

    await nc.subscribe(subjects.api_jobs_submit, cb=admission)
    agent = KubernetesAgent(
        kube,
        Publisher(nc, nc.jetstream(), "agent"),
        subjects,
        KubernetesSettings(namespace_teams={"ml": "t"}),
        nc,
        agent_id="test-agent",
        nats_url=servers.nats_url,
    )
    stopping = asyncio.Event()
    watches = [asyncio.create_task(i.run()) for i in (agent.pods, agent.nodes, agent.namespaces)]
    try:
        pod = training_pod("p", team="t", priority="p1-normal", gpus=1, checkpoint_dir=Path("/c"))
        await kube.create_pod("ml", pod)
        await eventually(lambda: _async(agent.synced and bool(agent.pods.cache)))
        with pytest.raises(Unavailable, match="admission could not take the submit"):
            await agent.reconcile_once()
        notes = (server.get("pods", "p", "ml") or {})["metadata"]["annotations"]
        assert "gpusched.io/refused" not in notes
        await agent.reconcile_once()
        notes = (server.get("pods", "p", "ml") or {})["metadata"]["annotations"]
        assert notes.get("gpusched.io/job-id") == "job-1" and len(asked) == 2
    finally:
        stopping.set()
        for watch in watches:
            watch.cancel()
        await asyncio.gather(*watches, return_exceptions=True)
        await nc.close()
