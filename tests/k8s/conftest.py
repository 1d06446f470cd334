"""A Kubernetes cluster for the tests: the API stand-in, its kubelet, job controller and
MIG manager, and the gpusched stack (every service a real process on the real NATS and
PostgreSQL of the test fixtures) with the Kubernetes agent reaching the stand-in through
a kubeconfig and asking the API with its own cluster agent credential.

A test module may override `cluster_env` (more settings of the stack) and
`cluster_inventory` (None: admission's inventory comes from the agent alone)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
import yaml
from kubernetes_asyncio import client, config
from nats.aio.client import Client as NatsClient

from gpusched.cli.client import ApiClient
from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.messages import GpuReading, GpuSample, T
from gpusched.contracts.subjects import Subjects
from gpusched.infra.settings import Settings
from tests.conftest import Servers
from tests.e2e.test_main_flow import FAST, Recorder
from tests.support.identity import harness_options
from tests.support.kubeapi import KubeApiStandIn, kubeconfig, serve_with_webhook
from tests.support.kubecontrollers import JobController, MigManager
from tests.support.kubelet import Kubelet, gpu_node
from tests.support.waiting import eventually

NODES = (("inf-00", "inference"), ("shared-00", "shared"), ("shared-01", "shared"))
# The namespaces of the cluster and their teams (an operator's gpusched.io/team label);
# "other" runs the team the agent's credential does not name.
NAMESPACES = {"default": "e2e", "ml": "e2e", "research": "research", "other": "other"}
AGENT_TEAMS = ("e2e", "research")
# Admission's first inventory in the default set-up: two of the cluster's nodes, and
# one the cluster does not have (the agent has admission remove it).
FILE_INVENTORY = (("inf-00", "inference"), ("shared-00", "shared"), ("gone-00", "shared"))


@dataclass
class Cluster:
    api: KubeApiStandIn
    kubelet: Kubelet
    jobs_controller: JobController
    mig_manager: MigManager
    stack: Stack
    jobs: ApiClient
    nc: NatsClient
    bus: Recorder
    subjects: Subjects
    kubectl: client.CoreV1Api
    policy: client.PolicyV1Api
    checkpoints: Path
    # The inference pool's GPU utilization the test's DCGM exporter reports (a node
    # running training reports 0.95, an idle node 0).
    inference_util: float = 0.2

    def audits(self, action: str) -> list[dict[str, Any]]:
        return [
            d
            for _, subj, t, d, _ in self.bus.messages
            if t == T.AUDIT and d.get("action") == action
        ]

    def events(self, pod: str, reason: str, namespace: str = "default") -> list[Any]:
        """The Kubernetes Events of `pod` with `reason` (what kubectl describe shows)."""
        return [
            e
            for e in self.api.list("events", namespace)
            if e["involvedObject"].get("name") == pod and e.get("reason") == reason
        ]

    async def job_of(self, pod: str, namespace: str = "default") -> str:
        async def annotated() -> str | None:
            obj = self.api.get("pods", pod, namespace)
            return (
                None
                if obj is None
                else (obj["metadata"].get("annotations") or {}).get("gpusched.io/job-id")
            )

        return await eventually(annotated, within=30)

    async def job(self, job_id: str) -> Any:
        reply = await self.jobs.get(job_id)
        assert reply.ok and reply.job, reply
        return reply.job

    async def state(self, job_id: str) -> str:
        return str((await self.job(job_id)).state)

    async def telemetry(self, stop: asyncio.Event) -> None:
        """A DCGM exporter: one sample per node every 0.25 s."""
        js = self.nc.jetstream()
        while not stop.is_set():
            for name, pool in NODES:
                if self.api.get("nodes", name) is None:
                    continue
                util = (
                    0.95
                    if self.kubelet.busy(name)
                    else self.inference_util
                    if pool == "inference"
                    else 0.0
                )
                sample = GpuSample(
                    node=name,
                    time=_now(),
                    gpus=[
                        GpuReading(
                            index=i,
                            util=util,
                            mem_used_mib=math.floor(util * 80000),
                            mem_total_mib=81920,
                        )
                        for i in range(8)
                    ],
                )
                env = make_envelope(T.GPU_SAMPLE, sample, source="dcgm")
                with contextlib.suppress(Exception):
                    await js.publish(
                        self.subjects.telemetry_gpu(name),
                        env.to_bytes(),
                        headers={"Nats-Msg-Id": env.id},
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.25)


async def now(value: Any) -> Any:
    """`value` as an awaitable: what `eventually` polls for a condition already known."""
    return value


async def inventory_is_the_clusters(c: Cluster) -> None:
    """Admission has every node of the cluster, added by the agent."""

    async def added() -> bool:
        names = {d["node"]["name"] for d in c.bus.of(T.INVENTORY_CHANGED, change="added")}
        return names >= {name for name, _ in NODES}

    await eventually(added, within=60)


async def running(c: Cluster, job_id: str, attempt: int = 1) -> bool:
    """The job runs (admission placed it), in `attempt` or a later one."""
    job = await c.job(job_id)
    return bool(job.state == "running" and job.attempt >= attempt)


def _now() -> Any:
    from gpusched.contracts.envelope import utcnow

    return utcnow()


def agent_env(kubeconfig_path: Path, webhook_port: int, pki: Any) -> dict[str, str]:
    return {
        "GPUSCHED_AGENT__CLUSTER": "kubernetes",
        "GPUSCHED_AGENT__KUBERNETES__KUBECONFIG": str(kubeconfig_path),
        "GPUSCHED_AGENT__KUBERNETES__NAMESPACE": "gpusched",
        "GPUSCHED_AGENT__KUBERNETES__WEBHOOK_PORT": str(webhook_port),
        "GPUSCHED_AGENT__KUBERNETES__WEBHOOK_CERT_FILE": str(pki.server_cert),
        "GPUSCHED_AGENT__KUBERNETES__WEBHOOK_KEY_FILE": str(pki.server_key),
        "GPUSCHED_AGENT__KUBERNETES__LEASE_DURATION_S": "3",
        "GPUSCHED_AGENT__KUBERNETES__WATCH_TIMEOUT_S": "20",
        "GPUSCHED_AGENT__KUBERNETES__EVICT_RETRY_S": "3",
        "GPUSCHED_AGENT__KUBERNETES__EVICT_GRACE_S": json.dumps(
            {"p2-offline": 5, "p1-normal": 5, "p0-urgent": 5, "inference": 5}
        ),
        "GPUSCHED_LOG_LEVEL": "INFO",
    }


@pytest.fixture
def cluster_env() -> dict[str, str]:
    return {}


@pytest.fixture
def cluster_inventory() -> tuple[tuple[str, str], ...] | None:
    return FILE_INVENTORY


def _inventory_file(nodes: tuple[tuple[str, str], ...], path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "nodes": [
                    {
                        "name": n,
                        "pool": p,
                        "gpu_model": "A100-80GB",
                        "gpus": 8,
                        "gpu_memory_mib": 81920,
                        "cpu_milli": 127500,
                        "memory_mib": 1048576,
                    }
                    for n, p in nodes
                ]
            }
        )
    )
    return path


@pytest.fixture
async def cluster(
    settings: Settings,
    servers: Servers,
    tmp_path: Path,
    cluster_env: dict[str, str],
    cluster_inventory: tuple[tuple[str, str], ...] | None,
) -> AsyncIterator[Cluster]:
    from gpusched.infra import natsauth

    served = await serve_with_webhook(tmp_path / "pki", bookmark_interval_s=0.5)
    api, url, pki, webhook_port = served.api, served.url, served.pki, served.webhook_port
    for name, pool in NODES:
        api.put("nodes", gpu_node(name, pool))
    for namespace, team in NAMESPACES.items():
        api.put(
            "namespaces", {"metadata": {"name": namespace, "labels": {"gpusched.io/team": team}}}
        )
    path = kubeconfig(url, api.token, pki.ca_file, tmp_path / "kubeconfig")
    inventory = (
        {"GPUSCHED_ADMISSION__INVENTORY_SOURCE": "agent"}
        if cluster_inventory is None
        else {
            "GPUSCHED_ADMISSION__INVENTORY_PATH": str(
                _inventory_file(cluster_inventory, tmp_path / "inventory.yaml")
            )
        }
    )
    env = {
        **FAST,
        **agent_env(path, webhook_port, pki),
        **inventory,
        "GPUSCHED_CHECKPOINT__GRACE_S": "30",
    }
    if servers.auth is not None:
        # The agent's own API credential: it submits for its teams only.
        api_creds = tmp_path / "agent-api.creds"
        natsauth.write_secret(
            api_creds, natsauth.issue_client(servers.auth, "agent", "k8s", teams=AGENT_TEAMS)
        )
        env["GPUSCHED_AGENT__KUBERNETES__API_CREDENTIALS"] = str(api_creds)
    env.update(cluster_env)
    stack = Stack(
        settings.model_copy(update={"data_dir": tmp_path / "data"}),
        env=env,
        log_dir=tmp_path / "logs",
    )
    await asyncio.to_thread(stack.start)
    kubelet = Kubelet(api, tmp_path / "kubelet")
    kubelet.start()
    jobs_controller = JobController(api)
    jobs_controller.start()
    mig_manager = MigManager(api, "gpusched")
    mig_manager.start()
    stop = asyncio.Event()
    configuration = client.Configuration()
    await config.load_kube_config(config_file=str(path), client_configuration=configuration)
    kube_api = client.ApiClient(configuration)
    subjects = Subjects(stack.settings.subject_prefix)
    recorder = Recorder()
    assert stack.settings.nats_url
    nc = await nats.connect(stack.settings.nats_url, **harness_options(stack.settings))
    for subject in (
        f"{subjects.prefix}.evt.>",
        f"{subjects.prefix}.cmd.>",
        f"{subjects.prefix}.jobs.>",
        f"{subjects.prefix}.audit.>",
    ):
        await nc.subscribe(subject, cb=recorder.on_message)
    telemetry: asyncio.Task[None] | None = None
    try:
        async with ApiClient(
            stack.settings.nats_url,
            stack.settings.subject_prefix,
            credentials=stack.settings.nats_credentials,
        ) as jobs:
            await jobs.wait_until_serving(within_s=120)
            c = Cluster(
                api,
                kubelet,
                jobs_controller,
                mig_manager,
                stack,
                jobs,
                nc,
                recorder,
                subjects,
                client.CoreV1Api(kube_api),
                client.PolicyV1Api(kube_api),
                tmp_path / "checkpoints",
            )
            c.checkpoints.mkdir()
            telemetry = asyncio.create_task(c.telemetry(stop))
            # The agent listed the cluster and serves its webhook: pods may be created.
            await eventually(lambda: now(recorder.of(T.AGENT_READY)), within=120)
            yield c
    finally:
        stop.set()
        if telemetry is not None:
            await telemetry
        await kubelet.stop()
        await jobs_controller.stop()
        await mig_manager.stop()
        await nc.close()
        await kube_api.close()
        await asyncio.to_thread(stack.stop)
        await api.stop()
