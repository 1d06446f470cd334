"""The published contract: an AsyncAPI 3.0 document built from the very pydantic models
the services validate with (DESIGN §4), in a shape code generators can use.

- Every message has a name: the components key is its model (`CheckpointRequested`),
  `name` its type on the wire (`checkpoint.requested`), and channels and operations
  reference it.
- Request/reply endpoints are one `receive` operation each with a 3.0 `reply` object:
  the reply travels on the requester's inbox (the NATS reply subject), so the reply
  channel has no address.
- The correlation id is where it travels: the envelope's `correlation_id` field in the
  payload (`$message.payload#/correlation_id`). API requests and replies are not
  enveloped: the NATS reply subject pairs them.
- Every public endpoint: the jobs API (submit, get, why, list, approve, cancel, scale),
  the nodes API, the checkpoint service's history, latest checkpoint and saga, and
  billing's statements and per-job bill.

`gpusched asyncapi` prints it; docs/asyncapi.json is the copy in the repository, and a
test fails when it no longer matches the models.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model
from pydantic.json_schema import models_json_schema

from gpusched.contracts import messages as m
from gpusched.contracts.messages import NodeVerb, T
from gpusched.contracts.subjects import Subjects

CONTRACT_VERSION = "2"
_SCHEMAS = "#/components/schemas/{model}"
CORRELATION = "envelopeCorrelation"


class EnvelopeFields(BaseModel):
    """Every stream message: `data` holds the typed payload; `id` is also the Nats-Msg-Id."""

    model_config = ConfigDict(extra="forbid")

    id: str
    version: int = Field(default=1, ge=1)
    source: str
    time: datetime
    correlation_id: str | None = Field(
        default=None, description="the saga or job this message belongs to"
    )
    causation_id: str | None = Field(default=None, description="the id of the message it answers")


def _camel(message_type: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[._]", message_type))


def _enveloped(message_type: str) -> type[BaseModel]:
    literal: Any = Literal[message_type]
    model: type[BaseModel] = create_model(
        f"{_camel(message_type)}Message",
        __base__=EnvelopeFields,
        type=(literal, ...),
        data=(m.SCHEMAS[message_type], ...),
    )
    return model


# (channel id, address after the prefix, parameters, action seen from the control plane,
#  message types, description)
_STREAMS: tuple[tuple[str, str, tuple[str, ...], str, tuple[str, ...], str], ...] = (
    (
        "jobControl",
        "jobs.{job_id}.control",
        ("job_id",),
        "send",
        (T.CHECKPOINT_REQUESTED, T.PREEMPTION_CANCELLED, T.RESUME),
        "Control plane -> training job: checkpoint now (with a deadline and the stage "
        "eviction waits for), the preemption was cancelled, resume from a checkpoint.",
    ),
    (
        "jobEvents",
        "jobs.{job_id}.events",
        ("job_id",),
        "receive",
        (
            T.JOB_STARTED,
            T.JOB_PROGRESS,
            T.CHECKPOINT_CONFIRMED,
            T.CHECKPOINT_FAILED,
            T.JOB_COMPLETED,
            T.JOB_FAILED,
        ),
        "Training job -> control plane; correlation_id is the job id. A confirmation "
        "answers request_id (null for a periodic checkpoint), in two stages.",
    ),
    (
        "gpuTelemetry",
        "telemetry.gpu.{node}",
        ("node",),
        "receive",
        (T.GPU_SAMPLE,),
        "One message per node per sample, all its GPUs (DCGM-style).",
    ),
    (
        "inferenceTelemetry",
        "telemetry.inference.{service}",
        ("service",),
        "receive",
        (T.INFERENCE_STATS,),
        "Request statistics of one inference service per interval.",
    ),
    (
        "audit",
        "audit.{action}",
        ("action",),
        "send",
        (T.AUDIT,),
        "Every decision with its reason; stored in the JetStream stream <PREFIX>_AUDIT.",
    ),
)

_PARAMETERS = {
    "job_id": "The job's id, e.g. job-0123456789ab.",
    "node": (
        "The node's name as one token: letters, digits, '-' and '_', each dot of a name"
        " written '~' (ip-10-0-1-23.ec2.internal: ip-10-0-1-23~ec2~internal)."
    ),
    "service": "The inference service's name.",
    "action": "The audited action, e.g. preempt.expand (it may hold dots).",
}


def _endpoints() -> tuple[tuple[str, str, type[BaseModel], type[BaseModel], str], ...]:
    """(operation id, address after the prefix, request, reply, description) of every
    request/reply endpoint. The checkpoint and billing models live with their services."""
    from gpusched.billing import api as billing
    from gpusched.checkpoint import api as checkpoint

    jobs: tuple[tuple[str, str, type[BaseModel], type[BaseModel], str], ...] = (
        ("submitJob", "api.jobs.submit", m.SubmitJob, m.SubmitReply,
         "Submit a training job or an inference service; the team comes from the caller's "
         "credentials."),
        ("getJob", "api.jobs.get", m.GetJob, m.GetReply,
         "A job's state, allocation and latest verified checkpoint."),
        ("whyJob", "api.jobs.why", m.WhyJob, m.WhyReply,
         "Why a job waits (or is where it is), in the scheduler's words."),
        ("listJobs", "api.jobs.list", m.ListJobs, m.ListReply,
         "Jobs newest first, filtered by team, states, class and kind, a page at a time "
         "(`after` = the previous page's `next`). A team lists its own jobs only."),
        ("approveJob", "api.jobs.approve", m.ApproveJob, m.ApproveReply,
         "Operators: let a job held above its team's class in, or retry a parked one."),
        ("cancelJob", "api.jobs.cancel", m.CancelJob, m.CancelReply,
         "End a job (queued, held, parked or running); a team its own only."),
        ("scaleJob", "api.jobs.scale", m.ScaleJob, m.ScaleReply,
         "Move an inference service's replica target inside its [min, max]."),
    )  # fmt: skip
    node_requests: dict[NodeVerb, type[BaseModel]] = {
        NodeVerb.ADD: m.AddNode,
        NodeVerb.RELOAD: m.ReloadInventory,
        NodeVerb.DRAIN: m.NodeCommand,
        NodeVerb.UNDRAIN: m.NodeCommand,
        NodeVerb.FAIL: m.NodeCommand,
        NodeVerb.RECOVER: m.NodeCommand,
        NodeVerb.REMOVE: m.NodeCommand,
        NodeVerb.LIST: m.ListNodes,
    }
    nodes = tuple(
        (f"{verb.value}Node" if verb is not NodeVerb.LIST else "listNodes",
         f"api.nodes.{verb.value}", request, m.NodeReply,
         f"Operators: nodes API, `{verb.value}`.")
        for verb, request in node_requests.items()
    )  # fmt: skip
    others: tuple[tuple[str, str, type[BaseModel], type[BaseModel], str], ...] = (
        ("jobHistory", "api.checkpoints.history", checkpoint.JobHistory,
         checkpoint.JobHistoryReply,
         "A job's eviction sagas and verified checkpoints, newest first; a team its own "
         "jobs' only."),
        ("latestCheckpoint", "api.checkpoints.latest", checkpoint.LatestCheckpoint,
         checkpoint.LatestCheckpointReply,
         "Operators: the latest usable checkpoint of a job."),
        ("getSaga", "api.sagas.get", checkpoint.GetSaga, checkpoint.GetSagaReply,
         "Operators: one eviction saga, by saga id or by job."),
        ("billingStatement", "api.billing.statement", billing.StatementRequest,
         billing.StatementReply,
         "Statements per team for a period; a team reads its own. Amounts are decimal "
         "strings."),
        ("jobBill", "api.billing.job", billing.JobBillRequest, billing.JobBillReply,
         "One job's usage and credits, priced; a team its own jobs' only."),
    )  # fmt: skip
    return jobs + nodes + others


def document(prefix: str = "gpusched") -> dict[str, Any]:
    subjects = Subjects(prefix)
    p = subjects.prefix
    enveloped = {t: _enveloped(t) for spec in _STREAMS for t in spec[4]}
    endpoints = _endpoints()
    models: list[tuple[type[BaseModel], Literal["validation", "serialization"]]] = [
        (model, "validation") for model in enveloped.values()
    ]
    for _, _, request, reply, _ in endpoints:
        models += [(request, "validation"), (reply, "serialization")]
    keys, definitions = models_json_schema(models, ref_template=_SCHEMAS)
    schemas: dict[str, Any] = dict(sorted(definitions.get("$defs", {}).items()))

    def ref(model: type[BaseModel], mode: str) -> dict[str, str]:
        return dict(keys[(model, mode)])  # type: ignore[index]

    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for channel_id, suffix, params, action, types, description in _STREAMS:
        names = []
        for t in types:
            name = _camel(t)
            names.append(name)
            messages[name] = {
                "name": str(t),
                "title": name,
                "summary": (m.SCHEMAS[t].__doc__ or str(t)).strip().splitlines()[0],
                "contentType": "application/json",
                "correlationId": {"$ref": f"#/components/correlationIds/{CORRELATION}"},
                "payload": ref(enveloped[t], "validation"),
            }
        channels[channel_id] = {
            "address": f"{p}.{suffix}",
            "description": description,
            "parameters": {param: {"description": _PARAMETERS[param]} for param in params},
            "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in names},
        }
        operations[f"{action}{channel_id[0].upper()}{channel_id[1:]}"] = {
            "action": action,
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": description.split(";")[0].split(". ")[0],
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{n}"} for n in names],
        }
    for operation_id, suffix, request, reply, description in endpoints:
        request_name, reply_name = request.__name__, reply.__name__
        for name, model, mode in ((request_name, request, "validation"),
                                  (reply_name, reply, "serialization")):  # fmt: skip
            messages.setdefault(
                name,
                {
                    "name": name,
                    "title": name,
                    "summary": (model.__doc__ or name).strip().splitlines()[0],
                    "contentType": "application/json",
                    "payload": ref(model, mode),
                },
            )
        channel_id = operation_id
        reply_id = f"{operation_id}Reply"
        channels[channel_id] = {
            "address": f"{p}.{suffix}",
            "description": f"Request/reply (not enveloped). {description}",
            "messages": {request_name: {"$ref": f"#/components/messages/{request_name}"}},
        }
        channels[reply_id] = {
            # The reply goes to the requester's inbox: the NATS reply subject of the
            # request, a different one each time.
            "address": None,
            "description": f"The reply to {p}.{suffix}, on the request's NATS reply subject.",
            "messages": {reply_name: {"$ref": f"#/components/messages/{reply_name}"}},
        }
        operations[operation_id] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "summary": description,
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/{request_name}"}],
            "reply": {
                "channel": {"$ref": f"#/channels/{reply_id}"},
                "messages": [{"$ref": f"#/channels/{reply_id}/messages/{reply_name}"}],
            },
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "gpusched public contracts",
            "version": CONTRACT_VERSION,
            "description": (
                f"Subjects start with a configurable prefix (here `{p}`). Stream messages "
                "are JSON envelopes (id, type, version, source, time, correlation_id, "
                "causation_id, data); W3C trace context travels in NATS headers. API "
                "endpoints are NATS request/reply with plain JSON bodies; every refusal is "
                "{ok: false, error: {code, message, field}}."
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "nats": {
                "host": "localhost:4222",
                "protocol": "nats",
                "description": "NATS with JetStream; every client authenticates (JWT).",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "messages": dict(sorted(messages.items())),
            "correlationIds": {
                CORRELATION: {
                    "description": "The envelope's correlation_id: the saga or job the "
                    "message belongs to.",
                    "location": "$message.payload#/correlation_id",
                }
            },
        },
    }
