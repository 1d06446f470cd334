"""Composition root of the cluster agent: the simulated cluster, or the Kubernetes
agent when `agent.cluster` is `kubernetes` (gpusched.agent.kubernetes).

It has no database of its own: the runtime runs without migrations, consumers use
edge handlers (no unit of work, no inbox), and events are published to JetStream with
deterministic ids through an in-memory buffer instead of an outbox: while NATS is away
the workloads keep running and the reports wait. At start and after every reconnect
the agent says `agent.ready` with what it runs.
"""

from __future__ import annotations

import socket

from gpusched.agent.feed import caught_up, follow_admission
from gpusched.agent.handlers import ClusterAgent
from gpusched.agent.publisher import Publisher
from gpusched.contracts.messages import T
from gpusched.infra import bus
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import Settings
from gpusched.simcluster.demand import SIM_DEMAND
from gpusched.simcluster.faults import SIM_NODE_HEALTH

NAME = "agent"
SCHEMA = "agent"
# How often the workload supervisor wakes when idle; it mostly waits for shutdown.
_SUPERVISE_INTERVAL_S = 1.0
# How often the agent checks whether it owes admission an `agent.ready` (after start,
# after a reconnect).
_READY_CHECK_S = 0.5


async def build(rt: ServiceRuntime) -> None:
    if rt.settings.agent.cluster == "kubernetes":
        from gpusched.agent.kubernetes.app import start_kubernetes_agent

        await start_kubernetes_agent(rt)
        return
    await start_agent(rt)


async def start_agent(rt: ServiceRuntime) -> ClusterAgent:
    """Wire the agent into a started runtime; returns it (tests drive and close it)."""
    s = rt.subjects
    nats_url, _ = rt.settings.require_urls()
    agent = ClusterAgent(
        Publisher(rt.nc, rt.js, NAME),
        s,
        rt.settings.agent,
        agent_id=f"{NAME}@{socket.gethostname()}",
        nats_url=nats_url,
        connection=rt.nc,
        nats_ca=None if rt.settings.nats_tls is None else rt.settings.nats_tls.ca_file,
    )
    rt.consume(
        bus.Consumer(
            durable="agent-commands",
            stream=s.stream("COMMANDS"),
            subjects=[s.commands_for(NAME)],
            edge_handlers={
                T.START_WORKLOAD: agent.on_start,
                T.RENEW_CREDENTIALS: agent.on_renew_credentials,
                T.EVICT_WORKLOAD: agent.on_evict,
                T.MIG_CONFIGURE: agent.on_mig_configure,
                SIM_DEMAND: agent.on_sim_demand,
                SIM_NODE_HEALTH: agent.on_set_node_health,
            },
        )
    )
    feed = await follow_admission(rt.js, s, agent.on_admission_event)

    async def announce() -> None:
        await agent.announce_if_due(lambda: caught_up(feed))

    rt.every("telemetry", rt.settings.agent.telemetry_interval_s, agent.publish_telemetry)
    rt.every("workloads", _SUPERVISE_INTERVAL_S, agent.supervise)
    rt.every("ready", _READY_CHECK_S, announce)
    # Stop the workloads as soon as the service stops, not when its loops are cancelled.
    rt.on_close(agent.close)
    return agent


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), None), build)
