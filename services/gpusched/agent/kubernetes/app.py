"""Composition of the Kubernetes agent (GPUSCHED_AGENT__CLUSTER=kubernetes).

Nothing connects at import time. With leader election on, `start` waits until this
replica holds the Lease before it takes commands or touches the cluster; a leader
that loses the Lease stops the service (its Deployment restarts it as a follower).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from gpusched.agent.feed import caught_up, follow_admission
from gpusched.agent.publisher import Publisher
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import T
from gpusched.infra import bus, tls
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.tasks import cancel_and_wait
from gpusched.infra.textfiles import FileRefused, read_small_text

from .agent import KubernetesAgent
from .kube import Kube, connect
from .lease import LeaderLease
from .webhook_server import serve

log = logging.getLogger(__name__)

NAME = "agent"
LEASE = "gpusched-agent"
_READY_CHECK_S = 0.5


class AgentMisconfigured(RuntimeError):
    """A setting the Kubernetes agent cannot start without (the message says which)."""


async def start_kubernetes_agent(rt: ServiceRuntime) -> KubernetesAgent:
    settings = rt.settings.agent.kubernetes
    s = rt.subjects
    nats_url, _ = rt.settings.require_urls()
    api = rt.nc
    if rt.credentials is not None:
        # On an authenticating NATS the service identity may not ask the API: the agent
        # asks with its own cluster agent credential, scoped to its teams.
        if settings.api_credentials is None:
            raise AgentMisconfigured(
                "the Kubernetes agent needs its API credential: `gpusched auth issue "
                "--agent NAME --teams T1,T2 --out agent-api.creds`, then set "
                "GPUSCHED_AGENT__KUBERNETES__API_CREDENTIALS to that file"
            )
        api = await bus.connect(
            nats_url,
            f"gpusched-{NAME}-api",
            settings.api_credentials,
            tls=tls.nats_context(rt.settings),
        )
        rt.on_close(api.close)
    kube = Kube(await connect(settings.kubeconfig))
    rt.on_close(kube.close)
    identity = f"{NAME}@{socket.gethostname()}"
    if settings.webhook_port:
        # Served by every replica, leader or not: pod creation must not wait for an election.
        runner = await serve(
            settings.scheduler_name,
            settings.webhook_port,
            settings.webhook_cert_file,
            settings.webhook_key_file,
        )
        rt.on_close(runner.cleanup)
    if settings.leader_election:
        lease = LeaderLease(kube, settings.namespace, LEASE, identity, settings.lease_duration_s)
        await lease.acquire()

        async def keep(stopping: asyncio.Event) -> None:
            await lease.keep(stopping, rt.request_stop)

        rt.background("lease", keep)
    agent = KubernetesAgent(
        kube,
        Publisher(rt.nc, rt.js, NAME),
        s,
        settings,
        rt.nc,
        api=api,
        agent_id=identity,
        nats_url=nats_url,
        nats_ca=pod_nats_ca(settings.pod_nats_ca_file, rt.settings.nats_tls),
    )
    rt.consume(
        bus.Consumer(
            durable="agent-commands",
            stream=s.stream("COMMANDS"),
            subjects=[s.commands_for(NAME)],
            # One job's commands in order (its start before its evict, its renewals),
            # different jobs' at once: a start is mostly waits on the API.
            key=command_key,
            edge_handlers={
                T.START_WORKLOAD: agent.on_start,
                T.RENEW_CREDENTIALS: agent.on_renew_credentials,
                T.EVICT_WORKLOAD: agent.on_evict,
                T.MIG_CONFIGURE: agent.on_mig_configure,
            },
        )
    )
    feed = await follow_admission(rt.js, s, agent.on_admission_event)

    async def watch_pods(stopping: asyncio.Event) -> None:
        await _until(stopping, agent.pods.run())

    async def watch_nodes(stopping: asyncio.Event) -> None:
        await _until(stopping, agent.nodes.run())

    async def watch_namespaces(stopping: asyncio.Event) -> None:
        await _until(stopping, agent.namespaces.run())

    async def announce() -> None:
        await agent.announce_if_due(lambda: caught_up(feed))

    rt.background("pods", watch_pods)
    rt.background("nodes", watch_nodes)
    rt.background("namespaces", watch_namespaces)
    rt.background("reconcile", agent.run)
    rt.every("ready", _READY_CHECK_S, announce)
    rt.on_close(agent.close)
    return agent


def pod_nats_ca(given: Path | None, own: tls.TlsSettings | None) -> str | None:
    """The CA (PEM) job pods verify NATS with: the one given for pods, else the agent's
    own; None when neither is set (a plain NATS, or one whose certificate the pods'
    system trust store verifies)."""
    path = given if given is not None else None if own is None else own.ca_file
    if path is None:
        return None
    what = "GPUSCHED_AGENT__KUBERNETES__POD_NATS_CA_FILE" if given else "GPUSCHED_NATS_TLS__CA_FILE"
    try:
        text = read_small_text(path)
    except (OSError, UnicodeDecodeError, FileRefused) as exc:
        raise AgentMisconfigured(f"{what}: cannot read the CA {path}: {exc}") from None
    if "-----BEGIN CERTIFICATE-----" not in text:
        raise AgentMisconfigured(f"{what}: {path} holds no PEM certificate")
    return text


def command_key(envelope: Envelope) -> str | None:
    """The job a workload command is for; a MIG command's node (its layout is one
    ConfigMap entry per node, read and written whole)."""
    data = envelope.data if isinstance(envelope.data, dict) else {}
    if envelope.type == T.MIG_CONFIGURE:
        return f"node:{data.get('node')}"
    job = data.get("job_id")
    return f"job:{job}" if isinstance(job, str) else None


async def _until(stopping: asyncio.Event, work: Coroutine[Any, Any, None]) -> None:
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await asyncio.gather(cancel_and_wait(task), cancel_and_wait(stop))
    if task.done() and not task.cancelled() and (error := task.exception()) is not None:
        raise error
