"""Who may publish and subscribe what on the bus: DESIGN §2's ownership table as data.

nats-server enforces these lists (infra.natsauth mints them into each identity's JWT);
a subject not listed is refused by the server. Each service publishes only what it owns
(its events, the commands it sends, its dead letters, audit records), reads only the
durable consumers it runs, and answers only its own endpoints. Jobs and nodes get the
scopes of natsauth (their own subjects only); teams and operators live in another
account and reach nothing but the API.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpusched.contracts.subjects import Subjects

__all__ = [
    "AGENT_NODE_VERBS",
    "INBOX_ROOT",
    "SERVICE_NAMES",
    "ConsumerGrant",
    "ServiceGrant",
    "admin_permissions",
    "agent_client_permissions",
    "auditor_permissions",
    "client_permissions",
    "grants",
    "inbox_prefix",
    "service_permissions",
    "service_user_name",
    "simulator_permissions",
]

# Every identity gets its own reply inbox under this root (`_GS_INBOX.<name>.>`): with
# the default shared `_INBOX.>` any user could read the replies of any other.
INBOX_ROOT = "_GS_INBOX"
SERVICE_NAMES = ("admission", "ingest", "preemption", "checkpoint", "billing", "agent")


@dataclass(frozen=True)
class ConsumerGrant:
    stream: str  # the suffix: JOBS, EVENTS, ...
    durable: str


@dataclass(frozen=True)
class ServiceGrant:
    publishes: tuple[str, ...]  # subjects relative to the prefix
    consumers: tuple[ConsumerGrant, ...]
    serves: tuple[str, ...] = ()  # request subjects, relative to the prefix
    # JetStream API subjects beyond durable consumers (relative to `$JS.API.`), with
    # `{S}` for a stream name of this prefix.
    js_api: tuple[str, ...] = ()
    subscribes: tuple[str, ...] = ()  # core subscriptions, relative to the prefix


def grants() -> dict[str, ServiceGrant]:
    """Every service's grant. Durable names are those of the services' app modules."""
    c = ConsumerGrant
    return {
        "admission": ServiceGrant(
            publishes=("evt.admission.>", "cmd.agent.workload.>", "cmd.agent.mig.>"),
            consumers=(c("COMMANDS", "admission-commands"), c("EVENTS", "admission-results")),
            serves=("api.jobs.>", "api.nodes.>"),
        ),
        "ingest": ServiceGrant(
            publishes=("evt.ingest.>",),
            consumers=(c("TELEMETRY", "ingest-inference"), c("EVENTS", "ingest-admission")),
            # Each replica reads its GPU telemetry partitions through a consumer of its
            # own, created at start (no acks: the window is rebuilt from the stream).
            js_api=(
                "CONSUMER.CREATE.{TELEMETRY}.*",
                "CONSUMER.INFO.{TELEMETRY}.*",
                "CONSUMER.MSG.NEXT.{TELEMETRY}.*",
                "CONSUMER.DELETE.{TELEMETRY}.*",
            ),
        ),
        "preemption": ServiceGrant(
            publishes=("evt.preemption.>", "cmd.admission.>", "cmd.checkpoint.>"),
            consumers=(
                c("EVENTS", "preemption-admission"),
                c("EVENTS", "preemption-snapshots"),
                c("EVENTS", "preemption-evictions"),
            ),
        ),
        "checkpoint": ServiceGrant(
            publishes=("evt.checkpoint.>", "jobs.*.control", "cmd.agent.workload.evict"),
            consumers=(
                c("COMMANDS", "checkpoint-commands"),
                c("JOBS", "checkpoint-job-events"),
                # The grants: each job's priority class and team.
                c("EVENTS", "checkpoint-admission-events"),
                c("EVENTS", "checkpoint-agent-events"),
            ),
            serves=("api.checkpoints.>", "api.sagas.>"),
        ),
        "billing": ServiceGrant(
            publishes=("evt.billing.>",),
            consumers=(c("EVENTS", "billing-ledger"),),
            serves=("api.billing.>",),
        ),
        "agent": ServiceGrant(
            # The simulated cluster publishes its nodes' telemetry and, for the
            # simulated jobs it runs in-process, their events. The Kubernetes agent's
            # submits and node commands go through the API with a cluster agent's
            # credential (agent_client_permissions), never as this service identity.
            publishes=("evt.agent.>", "telemetry.>", "jobs.*.events"),
            consumers=(c("COMMANDS", "agent-commands"),),
            # Its replay of admission's events and the control subjects of its
            # simulated jobs: ordered consumers, which nats-py creates unnamed.
            js_api=(
                "CONSUMER.CREATE.{EVENTS}",
                "CONSUMER.CREATE.{JOBS}",
                "CONSUMER.INFO.{EVENTS}.*",
                "CONSUMER.DELETE.{EVENTS}.*",
            ),
        ),
    }


def service_user_name(prefix: str, service: str) -> str:
    return f"{prefix}.{service}"


def inbox_prefix(name: str) -> str:
    """The reply inbox prefix of a user named `name` (its dots are subject tokens)."""
    return f"{INBOX_ROOT}.{name}"


def _inbox(name: str) -> str:
    return f"{inbox_prefix(name)}.>"


def _stream_info(subjects: Subjects) -> tuple[str, ...]:
    return tuple(f"$JS.API.STREAM.INFO.{spec.name}" for spec in subjects.streams())


def service_permissions(subjects: Subjects, service: str) -> tuple[str, list[str], list[str]]:
    """(user name, publish allow list, subscribe allow list) of one service."""
    grant = grants().get(service)
    if grant is None:
        raise KeyError(f"no such service {service!r}; known: {', '.join(SERVICE_NAMES)}")
    p = subjects.prefix
    name = service_user_name(p, service)
    publish = [f"{p}.{s}" for s in grant.publishes]
    publish += [subjects.dead_letter(service), f"{p}.audit.>"]
    publish += list(_stream_info(subjects))
    for consumer in grant.consumers:
        stream = subjects.stream(consumer.stream)
        publish += [
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{consumer.durable}",
            f"$JS.API.CONSUMER.INFO.{stream}.{consumer.durable}",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer.durable}",
            f"$JS.ACK.{stream}.{consumer.durable}.>",
        ]
    streams = {
        spec.name.removeprefix(subjects.stream("")): spec.name for spec in subjects.streams()
    }
    for api in grant.js_api:
        publish.append("$JS.API." + api.format(p=p, **streams))
    if grant.js_api:
        publish.append("$JS.FC.>")  # flow control of its ordered consumers
    subscribe = [_inbox(name)] + [f"{p}.{s}" for s in grant.serves + grant.subscribes]
    return name, publish, subscribe


def admin_permissions(subjects: Subjects) -> tuple[str, list[str], list[str]]:
    """The installer (`gpusched up`'s stream set-up and readiness check): the JetStream
    stream API of this prefix's streams and the list of their consumers, nothing else."""
    name = f"{subjects.prefix}.admin"
    verbs = ("STREAM.CREATE", "STREAM.UPDATE", "STREAM.INFO", "CONSUMER.LIST")
    publish = [f"$JS.API.{verb}.{spec.name}" for spec in subjects.streams() for verb in verbs]
    return name, publish, [_inbox(name)]


def auditor_permissions(subjects: Subjects) -> tuple[str, list[str], list[str]]:
    """Reads the audit stream (`gpusched audit`), and writes nothing."""
    name = f"{subjects.prefix}.auditor"
    stream = subjects.audit_stream
    publish = [
        f"$JS.API.STREAM.INFO.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.*.{subjects.audit('>')}",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
        f"$JS.API.CONSUMER.DELETE.{stream}.*",
        f"$JS.ACK.{stream}.>",
        "$JS.FC.>",
    ]
    return name, publish, [_inbox(name), subjects.audit(">")]


def simulator_permissions(subjects: Subjects) -> tuple[str, list[str], list[str]]:
    """Drives the simulated cluster (node faults, inference demand) and watches what the
    control plane does (the demo's timeline): the simulator's own commands, and live
    reads of events, commands, jobs and audit records. A development identity: a
    production installation hands it to nobody."""
    name = f"{subjects.prefix}.simulator"
    p = subjects.prefix
    watched = [f"{p}.evt.>", f"{p}.cmd.>", f"{p}.jobs.>", f"{p}.audit.>"]
    return name, [f"{p}.cmd.agent.sim.>"], [_inbox(name), *watched]


def client_permissions(name: str) -> tuple[list[str], list[str]]:
    """A team or operator (CLIENTS account): requests to the API, replies to itself.
    What each may ask is decided by the services from its identity (forbidden)."""
    return ["*.api.>"], [_inbox(name)]


# The node commands a cluster agent may send (NodeVerb values; its nodes' health goes
# as `node.health` events of the agent service).
AGENT_NODE_VERBS = ("add", "drain", "undrain", "remove")


def agent_client_permissions(name: str) -> tuple[list[str], list[str]]:
    """A cluster agent's API credential (CLIENTS account, `agent:<name>`): it submits its
    cluster's pods as jobs (admission accepts them only for the teams the credential
    names) and keeps the node inventory to its cluster's nodes; nothing else."""
    asks = ["*.api.jobs.submit", *(f"*.api.nodes.{verb}" for verb in AGENT_NODE_VERBS)]
    return asks, [_inbox(name)]
