"""Which span exporters the standard OTEL_* variables choose (no I/O: exporters are
only constructed, nothing is sent)."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpExporter,
)

from gpusched.infra import tracing


@pytest.mark.parametrize(
    ("env", "exported"),
    [
        ({}, False),  # nothing configured: no span is made at all
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),  # the SDK's default endpoint
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, False),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, False),
    ],
)
def test_otlp_export_is_on_exactly_when_the_otel_variables_ask_for_it(
    env: dict[str, str], exported: bool
) -> None:
    assert tracing.otlp_requested(env) is exported


def test_the_protocol_variable_chooses_http_protobuf_by_default_or_grpc() -> None:
    assert isinstance(tracing.otlp_exporter({}), HttpExporter)
    assert isinstance(tracing.otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}), GrpcExporter)
    traces_only = {
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    assert isinstance(tracing.otlp_exporter(traces_only), HttpExporter)


def test_a_protocol_this_build_cannot_speak_is_one_clear_error() -> None:
    with pytest.raises(tracing.TracingError, match=r"http/json.*grpc or http/protobuf"):
        tracing.otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


@pytest.mark.parametrize(
    ("subject", "template"),
    [
        ("gp.jobs.job-0123456789ab.events", "gp.jobs.{job_id}.events"),
        ("gp.telemetry.gpu.3.node-7", "gp.telemetry.gpu.3.{node}"),
        ("gp.telemetry.inference.chat", "gp.telemetry.inference.{service}"),
        ("gp.cmd.agent.workload.start", "gp.cmd.agent.workload.start"),
    ],
)
def test_subjects_become_span_names_of_bounded_cardinality(subject: str, template: str) -> None:
    assert tracing.destination_template(subject) == template
