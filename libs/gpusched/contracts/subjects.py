"""Subject names and JetStream streams, all under one configurable prefix.

Public (stable) subjects: `<p>.jobs.<job_id>.control|events`, `<p>.telemetry.gpu.<node>`,
`<p>.telemetry.inference.<service>`, `<p>.audit.<action>`, `<p>.api.jobs.submit|get`.
Internal subjects (`<p>.evt.*`, `<p>.cmd.*`) may change between versions.

`<node>` is the node's name as one subject token (`node_token`): the name itself, with
each dot written `~` (a dot would split the subject). So the node names Kubernetes gives
(`ip-10-0-1-23.ec2.internal` on EKS) have a telemetry subject
(`<p>.telemetry.gpu.ip-10-0-1-23~ec2~internal`); a name that is a token already keeps
it, and `~` is in no name, so two nodes never share a subject.

The TELEMETRY stream stores a GPU sample published on `<p>.telemetry.gpu.<node>` as
`<p>.telemetry.gpu.<partition>.<node>` (a subject transform of the stream, so publishers
keep the public subject): the partition, a hash of the node's token, lets ingest replicas
split the nodes between them with filtered consumers (docs/ingest.md).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
# Labels of token characters joined by single dots: a DNS name, as Kubernetes names nodes.
_DOTTED = re.compile(r"^[A-Za-z0-9_-]+(?:\.[A-Za-z0-9_-]+)+$")
# What stands for a dot in a node's subject token: allowed in a NATS subject token, and
# in no token (so the token of a dotted name is never another node's name).
NODE_DOT = "~"

# Fixed for the life of a stream: it is part of every stored telemetry subject.
TELEMETRY_PARTITIONS = 16


def is_token(value: str) -> bool:
    """Whether `value` can be one subject token (see check_token)."""
    return _TOKEN.fullmatch(value) is not None


def node_token(node: str) -> str:
    """The node's name as its telemetry subject's token: the name itself when it is
    one token, else (a DNS name) with each dot written `~`.

    Raises ValueError for a name no token can stand for (a space, a wildcard, an empty
    label, over 128 characters)."""
    token = _node_token(node)
    if token is None:
        raise ValueError(
            f"node name {node!r} cannot be used in a subject: use 1-128 characters from "
            "letters, digits, '-', '_' and single dots between them"
        )
    return token


def has_node_token(node: str) -> bool:
    """Whether the node can have a telemetry subject (see node_token)."""
    return _node_token(node) is not None


# Asked for every sample at the edge; a cluster has a bounded set of node names.
@functools.lru_cache(maxsize=65536)
def _node_token(node: str) -> str | None:
    if is_token(node):
        return node
    if len(node) <= 128 and _DOTTED.fullmatch(node) is not None:
        return node.replace(".", NODE_DOT)
    return None


def untelemetered_note(node: str) -> str:
    """What an operator is told of a node whose name cannot be a telemetry subject."""
    return (
        f"node {node} gets no GPU telemetry: its name cannot be a subject token (1-128 "
        "letters, digits, '-', '_' and single dots between them); its GPUs are placed, but "
        "their utilization is not sampled (remove it and add it again under such a name)"
    )


def check_token(value: str, what: str) -> str:
    """A value used as one subject token: no dots, spaces or wildcards."""
    if not is_token(value):
        raise ValueError(
            f"{what} {value!r} cannot be used in a subject: "
            "use 1-128 characters from letters, digits, '-' and '_'"
        )
    return value


def telemetry_partition(node: str) -> int:
    """The partition the stream's transform stores a node's samples under: nats-server's
    `partition()` mapping, the FNV-1a (32-bit) hash of the node's token modulo the count.
    (A node with no token has no samples; its name is hashed so that it has a partition.)"""
    token = _node_token(node) or node
    h = 0x811C9DC5
    for byte in token.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return h % TELEMETRY_PARTITIONS


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    max_age_s: float = 0.0  # 0 = keep until limits
    duplicate_window_s: float = 120.0
    # (source, destination) of the stream's subject transform, if it has one.
    transform: tuple[str, str] | None = None


@dataclass(frozen=True)
class Subjects:
    prefix: str = "gpusched"

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    # --- public contracts -------------------------------------------------------------
    def job_control(self, job_id: str) -> str:
        return f"{self.prefix}.jobs.{check_token(job_id, 'job id')}.control"

    def job_events(self, job_id: str) -> str:
        return f"{self.prefix}.jobs.{check_token(job_id, 'job id')}.events"

    @property
    def all_job_events(self) -> str:
        return f"{self.prefix}.jobs.*.events"

    @property
    def all_job_control(self) -> str:
        return f"{self.prefix}.jobs.*.control"

    def telemetry_gpu(self, node: str) -> str:
        return f"{self.prefix}.telemetry.gpu.{node_token(node)}"

    def telemetry_inference(self, service: str) -> str:
        return f"{self.prefix}.telemetry.inference.{check_token(service, 'service name')}"

    @property
    def all_gpu_telemetry(self) -> str:
        return f"{self.prefix}.telemetry.gpu.*"

    def stored_telemetry_gpu(self, node: str) -> str:
        """The subject the TELEMETRY stream stores a node's samples under."""
        token = node_token(node)
        return f"{self.prefix}.telemetry.gpu.{telemetry_partition(node)}.{token}"

    def gpu_telemetry_partition(self, partition: int) -> str:
        """The stored subjects of one telemetry partition (what a replica filters on)."""
        if not 0 <= partition < TELEMETRY_PARTITIONS:
            raise ValueError(f"partition {partition}: there are {TELEMETRY_PARTITIONS} (0-15)")
        return f"{self.prefix}.telemetry.gpu.{partition}.*"

    @property
    def all_inference_telemetry(self) -> str:
        return f"{self.prefix}.telemetry.inference.*"

    def audit(self, action: str) -> str:
        return f"{self.prefix}.audit.{action}"

    @property
    def api_jobs_submit(self) -> str:
        return f"{self.prefix}.api.jobs.submit"

    @property
    def api_jobs_get(self) -> str:
        return f"{self.prefix}.api.jobs.get"

    @property
    def api_jobs_approve(self) -> str:
        return f"{self.prefix}.api.jobs.approve"

    @property
    def api_jobs_cancel(self) -> str:
        return f"{self.prefix}.api.jobs.cancel"

    @property
    def api_jobs_why(self) -> str:
        return f"{self.prefix}.api.jobs.why"

    @property
    def api_jobs_scale(self) -> str:
        return f"{self.prefix}.api.jobs.scale"

    @property
    def api_jobs_list(self) -> str:
        return f"{self.prefix}.api.jobs.list"

    def api_nodes(self, verb: str) -> str:
        """The operator's node requests, e.g. `<p>.api.nodes.drain` (NodeVerb)."""
        return f"{self.prefix}.api.nodes.{check_token(verb, 'node verb')}"

    # --- internal ---------------------------------------------------------------------
    def event(self, service: str, message_type: str) -> str:
        """A domain event a service announces, e.g. `<p>.evt.admission.allocation.granted`."""
        return f"{self.prefix}.evt.{service}.{message_type}"

    def events_of(self, service: str) -> str:
        return f"{self.prefix}.evt.{service}.>"

    def command(self, target: str, verb: str) -> str:
        """A command addressed to one service, e.g. `<p>.cmd.agent.workload.start`."""
        return f"{self.prefix}.cmd.{target}.{verb}"

    def commands_for(self, target: str) -> str:
        return f"{self.prefix}.cmd.{target}.>"

    def dead_letter(self, service: str) -> str:
        return f"{self.prefix}.dlq.{service}"

    @property
    def all_dead_letters(self) -> str:
        return f"{self.prefix}.dlq.>"

    # --- streams ----------------------------------------------------------------------
    def stream(self, suffix: str) -> str:
        # The public audit stream is GPUSCHED_AUDIT with the default prefix.
        return f"{self.prefix.upper().replace('-', '_')}_{suffix}"

    @property
    def audit_stream(self) -> str:
        return self.stream("AUDIT")

    def streams(self) -> tuple[StreamSpec, ...]:
        p = self.prefix
        day = 24 * 3600.0
        return (
            StreamSpec(self.stream("JOBS"), (f"{p}.jobs.>",), max_age_s=30 * day),
            StreamSpec(
                self.stream("TELEMETRY"),
                (f"{p}.telemetry.>",),
                max_age_s=3600.0,
                transform=(
                    f"{p}.telemetry.gpu.*",
                    f"{p}.telemetry.gpu.{{{{partition({TELEMETRY_PARTITIONS},1)}}}}.{{{{wildcard(1)}}}}",
                ),
            ),
            StreamSpec(self.stream("EVENTS"), (f"{p}.evt.>",), max_age_s=30 * day),
            StreamSpec(self.stream("COMMANDS"), (f"{p}.cmd.>",), max_age_s=7 * day),
            StreamSpec(self.audit_stream, (f"{p}.audit.>",), max_age_s=365 * day),
            StreamSpec(self.stream("DLQ"), (f"{p}.dlq.>",), max_age_s=30 * day),
        )
