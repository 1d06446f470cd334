"""The Kubernetes agent: a kubectl pod -> bound by gpusched, against the API stand-in.

A whole stack (every service a process, on its own embedded NATS and PostgreSQL) with
the Kubernetes agent reaching the API stand-in (tests/support/kubeapi.py, HTTPS)
through kubernetes_asyncio; the stand-in calls the agent's webhook at each pod create.
Admission's inventory is the stand-in's NODES nodes of 8 GPUs (shared pool), added by
the agent. No kubelet: the figure ends when the Binding is stored. Between the two, the
agent submits the pod (a request to admission), admission places it (its scheduling
pass, the outbox), and the agent writes the pod's Secret, its ResourceClaim and the
claim's allocation, annotates the pod and binds it.

The baseline, in the same run on the same stand-in: a client that binds pods itself,
the two calls of a bind (create the pod, which also calls the webhook; the Binding)
through kubernetes_asyncio. Figures:

- `bind_latency_p50` / `_p99` (ms): PODS 1-GPU pods created one after another at RATE
  pods/s, each from before its create to its Binding stored; baseline the same for the
  client's own create + Binding;
- `bind_burst_rate` (pods/s): PODS pods created at once, until the last is bound;
  baseline the client's create + Binding of as many pods, all at once.

`BENCH_K8S_NODES` (64), `BENCH_K8S_PODS` (150), `BENCH_K8S_RATE` (4: below what the
agent binds a second here, so the latency is not a queue's), `BENCH_K8S_LOG_LEVEL`.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from kubernetes_asyncio import client, config
from tests.support.faults import own_servers_settings
from tests.support.kubeapi import kubeconfig, serve_with_webhook
from tests.support.kubelet import gpu_node, training_pod

from bench.harness import Context, Figure
from gpusched.cli.client import ApiClient
from gpusched.cli.stack import Stack
from gpusched.infra import natsauth

BENCH = "k8s"
NODES = int(os.environ.get("BENCH_K8S_NODES", "64"))
PODS = int(os.environ.get("BENCH_K8S_PODS", "150"))
RATE = float(os.environ.get("BENCH_K8S_RATE", "4"))
TEAM = "bench"
BOUND_S = 300.0  # pods not bound in this long fail the bench


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


class _Binds:
    """When each pod was first seen bound (the stand-in's own change feed)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def __call__(self, plural: str, event: str, obj: dict[str, Any]) -> None:
        name = obj["metadata"]["name"]
        if plural == "pods" and obj.get("spec", {}).get("nodeName") and name not in self.at:
            self.at[name] = time.monotonic()

    async def all_bound(self, names: list[str]) -> None:
        deadline = time.monotonic() + BOUND_S
        while any(n not in self.at for n in names):
            if time.monotonic() > deadline:
                missing = [n for n in names if n not in self.at]
                raise AssertionError(f"{len(missing)} pod(s) not bound in {BOUND_S:.0f}s")
            await asyncio.sleep(0.02)


def _pod(name: str, scheduler: str) -> dict[str, Any]:
    pod = training_pod(name, team=TEAM, priority="p1-normal", gpus=1, checkpoint_dir=Path("/c"))
    pod["spec"]["schedulerName"] = scheduler
    return pod


async def run(ctx: Context) -> list[Figure]:
    root = ctx.scratch / "k8s"
    served = await serve_with_webhook(root / "pki", bookmark_interval_s=1.0)
    api, url, pki, webhook_port = served.api, served.url, served.pki, served.webhook_port
    binds = _Binds()
    api.on_change.append(binds)
    for i in range(NODES):
        api.put("nodes", gpu_node(f"gpu-{i:03d}", "shared"))
    api.put("nodes", gpu_node("inf-000", "inference"))
    for namespace in ("bench", "raw"):
        api.put(
            "namespaces", {"metadata": {"name": namespace, "labels": {"gpusched.io/team": TEAM}}}
        )
    path = kubeconfig(url, api.token, pki.ca_file, root / "kubeconfig")
    settings = own_servers_settings(root / "data", f"bench{uuid.uuid4().hex[:6]}")
    bundle = natsauth.AuthBundle.ensure(settings.data_dir / "auth")
    creds = root / "agent-api.creds"
    natsauth.write_secret(creds, natsauth.issue_client(bundle, "agent", "bench", teams=[TEAM]))
    stack = Stack(
        settings,
        env={
            "GPUSCHED_AGENT__CLUSTER": "kubernetes",
            "GPUSCHED_AGENT__KUBERNETES__KUBECONFIG": str(path),
            "GPUSCHED_AGENT__KUBERNETES__WEBHOOK_PORT": str(webhook_port),
            "GPUSCHED_AGENT__KUBERNETES__WEBHOOK_CERT_FILE": str(pki.server_cert),
            "GPUSCHED_AGENT__KUBERNETES__WEBHOOK_KEY_FILE": str(pki.server_key),
            "GPUSCHED_AGENT__KUBERNETES__API_CREDENTIALS": str(creds),
            "GPUSCHED_ADMISSION__INVENTORY_SOURCE": "agent",
            "GPUSCHED_ADMISSION__SCHEDULE_INTERVAL_S": "0.25",
            "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
            "GPUSCHED_LOG_LEVEL": os.environ.get("BENCH_K8S_LOG_LEVEL", "WARNING"),
        },
        log_dir=root / "logs",
    )
    started = await asyncio.to_thread(stack.start)
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    kube_api = client.ApiClient(configuration)
    core = client.CoreV1Api(kube_api)
    try:
        assert started.nats_url
        async with ApiClient(
            started.nats_url, started.subject_prefix, credentials=started.nats_credentials
        ) as operator:
            await operator.wait_until_serving(within_s=120)
            await _inventory(ctx, operator)
            return await _measure(ctx, core, binds)
    finally:
        await kube_api.close()
        await asyncio.to_thread(stack.stop)
        await api.stop()


async def _inventory(ctx: Context, operator: ApiClient) -> None:
    deadline = time.monotonic() + 120
    while True:
        listed = await operator.call("api.nodes.list", {})
        if len(listed.get("nodes") or []) == NODES + 1:
            ctx.progress(f"k8s: admission has the stand-in's {NODES + 1} nodes")
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"admission has {len(listed.get('nodes') or [])} nodes")
        await asyncio.sleep(0.5)


async def _measure(ctx: Context, core: client.CoreV1Api, binds: _Binds) -> list[Figure]:
    await core.create_namespaced_pod("bench", _pod("warm-up", "gpusched"))  # type: ignore[arg-type]
    await binds.all_bound(["warm-up"])

    async def via_gpusched(name: str) -> float:
        start = time.monotonic()
        await core.create_namespaced_pod("bench", _pod(name, "gpusched"))  # type: ignore[arg-type]
        await binds.all_bound([name])
        return binds.at[name] - start

    async def by_hand(name: str) -> float:
        start = time.monotonic()
        await core.create_namespaced_pod("raw", _pod(name, "default-scheduler"))  # type: ignore[arg-type]
        target = {"apiVersion": "v1", "kind": "Node", "name": "gpu-000"}
        body = {"metadata": {"name": name}, "target": target}
        # The stand-in answers a Binding with a Status, as the API does: not read as one.
        # The client takes plain manifests as well as its models (the stubs say models).
        response = await core.create_namespaced_pod_binding(
            name,
            "raw",
            body,  # type: ignore[arg-type]
            _preload_content=False,
        )
        response.release()  # type: ignore[attr-defined]
        return time.monotonic() - start

    agent = await _paced(via_gpusched, "paced")
    raw = await _paced(by_hand, "raw-paced")
    agent_rate = await _burst(core, binds, "burst", via_gpusched)
    raw_rate = await _burst(core, binds, "raw-burst", by_hand)
    ctx.progress(
        f"k8s: bind p50 {statistics.median(agent) * 1000:.0f} ms "
        f"(by hand {statistics.median(raw) * 1000:.1f} ms), burst {agent_rate:.1f} pods/s "
        f"(by hand {raw_rate:.1f})"
    )
    return [
        Figure(BENCH, "bind_latency_p50", statistics.median(agent) * 1000, "ms",
               statistics.median(raw) * 1000),
        Figure(BENCH, "bind_latency_p99", _percentile(agent, 0.99) * 1000, "ms",
               _percentile(raw, 0.99) * 1000),
        Figure(BENCH, "bind_burst_rate", agent_rate, "pods/s", raw_rate),
    ]  # fmt: skip


async def _paced(bind: Any, prefix: str) -> list[float]:
    """PODS pods at RATE pods/s, each timed from before its create to it bound."""
    tasks = []
    for i in range(PODS):
        tasks.append(asyncio.create_task(bind(f"{prefix}-{i:04d}")))
        await asyncio.sleep(1 / RATE)
    return list(await asyncio.gather(*tasks))


async def _burst(core: client.CoreV1Api, binds: _Binds, prefix: str, bind: Any) -> float:
    """PODS pods at once: pods bound per second, from the first create to the last bind."""
    start = time.monotonic()
    await asyncio.gather(*(bind(f"{prefix}-{i:04d}") for i in range(PODS)))
    return PODS / (time.monotonic() - start)
