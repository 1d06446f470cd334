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


def setup(service: str, trace_file: Path | None) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if trace_file is not None:
        provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(trace_file)))
    trace.set_tracer_provider(provider)
    return provider


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def inject() -> dict[str, str]:
    """The current trace context as headers (empty when there is no active span)."""
    carrier: dict[str, str] = {}
    _inject(carrier)
    return carrier


@contextmanager
def continued(
    name: str, headers: Mapping[str, str] | None, attributes: Mapping[str, str] | None = None
) -> Iterator[trace.Span]:
    """A span that continues the trace carried by `headers`."""
    parent = _extract(dict(headers or {}))
    token = otel_context.attach(parent)
    try:
        with tracer().start_as_current_span(name, attributes=dict(attributes or {})) as span:
            yield span
    finally:
        otel_context.detach(token)
