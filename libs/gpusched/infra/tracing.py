"""OpenTelemetry tracing whose context travels in NATS headers (W3C traceparent).

A span context is captured when an event is written to the outbox, stored with the
row, and sent as headers by the relay; the consumer continues the same trace. So one
trace follows a job from submit to eviction across every service.

Where spans go (`setup`): an OTLP collector, configured by the standard OTEL_*
variables (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT,
OTEL_EXPORTER_OTLP_PROTOCOL `http/protobuf` (default) or `grpc`, headers, timeout,
certificates; OTEL_TRACES_SAMPLER; OTEL_BSP_*; OTEL_RESOURCE_ATTRIBUTES), and/or a
JSON-lines file (GPUSCHED_TRACE_FILE). With neither, no span is made at all.

Spans follow the OpenTelemetry semantic conventions: a message written to the outbox
is a PRODUCER span (`create <destination>`), applying one is a CONSUMER span
(`process <destination>`), both with messaging.system=nats, the destination subject,
the message id and the conversation (correlation) id; a request handled by an endpoint
is a SERVER span; each SQL statement inside one of those is a CLIENT span with
db.system.name=postgresql and the statement text.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract as _extract
from opentelemetry.propagate import inject as _inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.semconv._incubating.attributes import messaging_attributes as msg_attrs
from opentelemetry.semconv.attributes import db_attributes as db_attrs
from opentelemetry.semconv.attributes import server_attributes as server_attrs
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    # Not at run time: the CLI imports this module and must not pay for SQLAlchemy.
    from sqlalchemy.ext.asyncio import AsyncEngine

log = logging.getLogger(__name__)

TRACER_NAME = "gpusched"


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object per line.

    Enough for local runs and for tests that follow one trace across processes;
    production points the SDK at an OTLP collector instead (OTEL_* variables).
    """

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] = path.open("a", encoding="utf-8")
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = []
        for span in spans:
            ctx = span.get_span_context()
            parent = span.parent
            lines.append(
                json.dumps(
                    {
                        "name": span.name,
                        "service": span.resource.attributes.get("service.name"),
                        "trace_id": f"{ctx.trace_id:032x}" if ctx else None,
                        "span_id": f"{ctx.span_id:016x}" if ctx else None,
                        "parent_id": f"{parent.span_id:016x}" if parent else None,
                        "kind": span.kind.name,
                        "start": span.start_time,
                        "end": span.end_time,
                        "attributes": {k: str(v) for k, v in (span.attributes or {}).items()},
                    }
                )
            )
        with self._lock:
            self._file.write("\n".join(lines) + "\n")
            self._file.flush()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()


# Set by `setup` when spans are exported somewhere; until then none are made.
_tracer: trace.Tracer | None = None

MESSAGING_SYSTEM = "nats"
# Statements longer than this are cut in db.query.text (a batch insert can be huge).
QUERY_TEXT_LIMIT = 2048


class TracingError(ValueError):
    """The OTEL_* variables ask for something this build cannot do."""


def otlp_requested(env: Mapping[str, str] | None = None) -> bool:
    """Whether the OTEL_* variables ask for OTLP export: OTEL_TRACES_EXPORTER names
    `otlp`, or (with it unset) an OTLP endpoint is set. Unlike the SDK's own default
    (`otlp` to localhost), nothing is exported when nothing is configured: a span nobody
    collects costs a service ~40 µs of CPU per message."""
    env = os.environ if env is None else env
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = [e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",")]
    if "otlp" in exporters:
        return True
    if any(e and e != "none" for e in exporters) or "none" in exporters:
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def otlp_exporter(env: Mapping[str, str] | None = None) -> SpanExporter:
    """The OTLP span exporter of OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL; each exporter
    reads its endpoint, headers, timeout, compression and certificates from the
    standard variables itself."""
    env = os.environ if env is None else env
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise TracingError(
        f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; use grpc or http/protobuf"
    )


def setup(
    service: str, trace_file: Path | None, env: Mapping[str, str] | None = None
) -> TracerProvider | None:
    """Export this process's spans to OTLP (the OTEL_* variables) and/or `trace_file`.
    With neither no span is made at all. The trace context a message brings still passes
    on to what it causes (`continued` makes it current, `inject` writes it into the
    outbox rows), so the services that do record spans still see one trace."""
    global _tracer
    exporters: list[SpanExporter] = []
    if otlp_requested(env):
        exporters.append(otlp_exporter(env))
    if trace_file is not None:
        exporters.append(JsonLinesSpanExporter(trace_file))
    if not exporters:
        return None
    # OTEL_RESOURCE_ATTRIBUTES add to the resource; the service's name is its own.
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)
    # This provider's own tracer: a second setup in one process (tests run several
    # services in one) records to its exporters, not to the first provider's.
    _tracer = provider.get_tracer(TRACER_NAME)
    return provider


def recording() -> bool:
    return _tracer is not None


def tracer() -> trace.Tracer:
    return _tracer if _tracer is not None else trace.get_tracer(TRACER_NAME)


def inject() -> dict[str, str]:
    """The current trace context as headers (empty when there is no active span)."""
    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


@contextmanager
def continued(
    name: str,
    headers: Mapping[str, str] | None,
    attributes: Mapping[str, str] | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Iterator[trace.Span]:
    """A span that continues the trace carried by `headers`; without a recorder
    (`setup`), only that trace's context, made current."""
    parent = _extract(dict(headers or {}))
    token = otel_context.attach(parent)
    try:
        if _tracer is None:
            yield trace.get_current_span()
            return
        with _tracer.start_as_current_span(
            name, kind=kind, attributes=dict(attributes or {})
        ) as span:
            yield span
    finally:
        otel_context.detach(token)


def destination_template(subject: str) -> str:
    """The subject with its per-entity token replaced, for a span name of bounded
    cardinality (`<p>.jobs.{job_id}.events`, `<p>.telemetry.gpu.{node}`)."""
    tokens = subject.split(".")
    if len(tokens) >= 4 and tokens[1] == "jobs" and tokens[2].startswith("job-"):
        tokens[2] = "{job_id}"
    elif len(tokens) >= 4 and tokens[1] == "telemetry" and tokens[2] in ("gpu", "inference"):
        tokens[-1] = "{node}" if tokens[2] == "gpu" else "{service}"
    return ".".join(tokens)


def message_attributes(
    subject: str,
    message_id: str | None,
    conversation_id: str | None,
    operation: tuple[str, str],
    message_type: str | None = None,
) -> dict[str, str]:
    """The messaging attributes of a span; `operation`: (type, name), e.g. ("process",
    "apply"): the type is the convention's, the name this system's own verb."""
    attributes = {
        msg_attrs.MESSAGING_SYSTEM: MESSAGING_SYSTEM,
        msg_attrs.MESSAGING_OPERATION_TYPE: operation[0],
        msg_attrs.MESSAGING_OPERATION_NAME: operation[1],
        msg_attrs.MESSAGING_DESTINATION_NAME: subject,
        msg_attrs.MESSAGING_DESTINATION_TEMPLATE: destination_template(subject),
    }
    if message_type:
        attributes["gpusched.message.type"] = message_type
    if message_id:
        attributes[msg_attrs.MESSAGING_MESSAGE_ID] = message_id
    if conversation_id:
        attributes[msg_attrs.MESSAGING_MESSAGE_CONVERSATION_ID] = conversation_id
    return attributes


@contextmanager
def processing(
    service: str,
    subject: str,
    headers: Mapping[str, str] | None,
    *,
    message_id: str | None,
    conversation_id: str | None,
    consumer: str,
    message_type: str,
) -> Iterator[trace.Span]:
    """The CONSUMER span of applying one message, continuing the trace it carries."""
    if _tracer is None:  # the hot path without a recorder: only the context passes on
        with continued("", headers) as span:
            yield span
        return
    attributes = message_attributes(
        subject, message_id, conversation_id, ("process", "apply"), message_type
    )
    attributes[msg_attrs.MESSAGING_CONSUMER_GROUP_NAME] = consumer
    attributes["gpusched.service"] = service
    with continued(
        f"apply {destination_template(subject)}", headers, attributes, SpanKind.CONSUMER
    ) as span:
        yield span


@contextmanager
def serving(service: str, subject: str, headers: Mapping[str, str] | None) -> Iterator[trace.Span]:
    """The SERVER span of answering one request (request/reply over NATS)."""
    if _tracer is None:
        with continued("", headers) as span:
            yield span
        return
    message_id = (headers or {}).get("Nats-Msg-Id")
    attributes = message_attributes(subject, message_id, None, ("process", "handle"))
    attributes["gpusched.service"] = service
    with continued(f"handle {subject}", headers, attributes, SpanKind.SERVER) as span:
        yield span


def produced(
    subject: str,
    message_id: str,
    conversation_id: str | None,
    message_type: str,
    parent: Mapping[str, str] | None,
) -> dict[str, str]:
    """Record the PRODUCER span of one message written to the outbox and return the
    headers that carry it, so its consumer's span is its child. `parent`: the trace
    the message belongs to (a job's, kept with the job), else the current one."""
    assert _tracer is not None, "produced() without setup(); check recording() first"
    context = _extract(dict(parent)) if parent is not None else None
    span = _tracer.start_span(
        f"create {destination_template(subject)}",
        context=context,
        kind=SpanKind.PRODUCER,
        attributes=message_attributes(
            subject, message_id, conversation_id, ("create", "create"), message_type
        ),
    )
    span.end()
    carrier: dict[str, str] = {}
    _inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def _statement_span(tracer: trace.Tracer, sql: str, common: Mapping[str, Any]) -> trace.Span:
    operation = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else "SQL"
    attributes = {
        db_attrs.DB_SYSTEM_NAME: "postgresql",
        **common,
        db_attrs.DB_OPERATION_NAME: operation,
        db_attrs.DB_QUERY_TEXT: sql[:QUERY_TEXT_LIMIT],
    }
    return tracer.start_span(f"{operation} postgresql", kind=SpanKind.CLIENT, attributes=attributes)


_NO_SPAN = nullcontext()


def statement(sql: str) -> AbstractContextManager[None]:
    """A CLIENT span around one statement sent to asyncpg directly (the unit of work's
    hot path bypasses SQLAlchemy, whose hooks `instrument_engine` uses); only inside a
    traced operation, and nothing at all (one shared no-op) without `setup`."""
    if _tracer is None or not trace.get_current_span().get_span_context().is_valid:
        return _NO_SPAN
    return _statement(_tracer, sql)


@contextmanager
def _statement(tracer: trace.Tracer, sql: str) -> Iterator[None]:
    span = _statement_span(tracer, sql, {})
    try:
        yield
    except Exception as exc:
        span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        span.record_exception(exc)
        raise
    finally:
        span.end()


def instrument_engine(engine: AsyncEngine) -> None:
    """A CLIENT span per SQL statement the engine runs inside a traced operation (a
    message applied, a request answered); statements outside one (the relay's polls, a
    loop's reads) make no root spans of their own. No-op without `setup`.

    The contrib instrumentations (opentelemetry-instrumentation-sqlalchemy/-asyncpg)
    are not released for this SDK version; these are the same SQLAlchemy hooks they use.
    """
    if _tracer is None:
        return
    from sqlalchemy import event as sa_event

    tracer = _tracer
    url = engine.url
    common: dict[str, Any] = {}
    if url.database:
        common[db_attrs.DB_NAMESPACE] = url.database
    if url.host:
        common[server_attrs.SERVER_ADDRESS] = url.host
    if url.port:
        common[server_attrs.SERVER_PORT] = url.port

    def before(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        if context is None or not trace.get_current_span().get_span_context().is_valid:
            return
        context._gpusched_span = _statement_span(tracer, statement, common)

    def after(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        span = getattr(context, "_gpusched_span", None)
        if span is not None:
            span.end()
            context._gpusched_span = None

    def failed(exception_context: Any) -> None:
        context = exception_context.execution_context
        span = getattr(context, "_gpusched_span", None)
        if span is not None:
            error = exception_context.original_exception
            span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            span.record_exception(error)
            span.end()
            context._gpusched_span = None

    sync = engine.sync_engine
    sa_event.listen(sync, "before_cursor_execute", before)
    sa_event.listen(sync, "after_cursor_execute", after)
    sa_event.listen(sync, "handle_error", failed)
