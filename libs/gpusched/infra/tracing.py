"""OpenTelemetry tracing whose context travels in NATS headers (W3C traceparent).

A span context is captured when an event is written to the outbox, stored with the
row, and sent as headers by the relay; the consumer continues the same trace. So one
trace follows a job from submit to eviction across every service.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

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

TRACER_NAME = "gpusched"


class JsonLinesSpanExporter(SpanExporter):
    """Appends finished spans to a file, one JSON object per line.

    Enough for local runs and for tests that follow one trace across processes;
    production points the SDK at an OTLP collector instead.
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


# Set by `setup` when spans are written somewhere; until then none are made.
_tracer: trace.Tracer | None = None


def setup(service: str, trace_file: Path | None) -> TracerProvider | None:
    """Record this process's spans to `trace_file`. Without one no span is made at all:
    a span nobody exports costs a service ~40 µs of CPU per message for nothing. The
    trace context a message brings still passes on to what it causes (`continued`
    makes it current, `inject` writes it into the outbox rows), so the services that do
    record spans still see one trace."""
    global _tracer
    if trace_file is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer(TRACER_NAME)
    return provider


def tracer() -> trace.Tracer:
    return _tracer if _tracer is not None else trace.get_tracer(TRACER_NAME)


def inject() -> dict[str, str]:
    """The current trace context as headers (empty when there is no active span)."""
    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


@contextmanager
def continued(
    name: str, headers: Mapping[str, str] | None, attributes: Mapping[str, str] | None = None
) -> Iterator[trace.Span]:
    """A span that continues the trace carried by `headers`; without a recorder
    (`setup`), only that trace's context, made current."""
    parent = _extract(dict(headers or {}))
    token = otel_context.attach(parent)
    try:
        if _tracer is None:
            yield trace.get_current_span()
            return
        with _tracer.start_as_current_span(name, attributes=dict(attributes or {})) as span:
            yield span
    finally:
        otel_context.detach(token)
