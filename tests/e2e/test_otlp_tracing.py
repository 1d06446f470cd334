"""Every service as a real process exporting its spans over OTLP/HTTP, configured only by
the standard OTEL_* variables, to a receiver started by the test: producer and consumer
spans carry the messaging conventions and continue one trace from the submit, and SQL
statements are client spans inside them."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from gpusched.cli.client import ApiClient
from gpusched.cli.stack import Stack
from gpusched.contracts.messages import GpuRequest, PriorityClassName, SubmitJob, WorkloadSpec
from gpusched.infra.settings import Settings
from tests.e2e.test_main_flow import FAST
from tests.support.otlp import OtlpReceiver, ReceivedSpan
from tests.support.stacks import ready
from tests.support.waiting import eventually


@pytest.fixture
async def receiver() -> AsyncIterator[OtlpReceiver]:
    received = OtlpReceiver()
    await received.start()
    yield received
    await received.stop()


@pytest.fixture
async def stack(settings: Settings, tmp_path: Path, receiver: OtlpReceiver) -> AsyncIterator[Stack]:
    otel = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
    }
    running = Stack(
        settings.model_copy(update={"data_dir": tmp_path / "data"}),
        services=("admission", "agent"),
        env={**FAST, **otel},
        log_dir=tmp_path / "logs",
    )
    # Started off the loop: the receiver answers the exporters meanwhile.
    async with ready(running):
        yield running


async def test_spans_reach_an_otlp_receiver_with_messaging_conventions_and_one_trace(
    stack: Stack, receiver: OtlpReceiver
) -> None:
    settings = stack.settings
    assert settings.nats_url
    p = settings.subject_prefix
    async with ApiClient(settings.nats_url, p, credentials=settings.nats_credentials) as api:
        reply = await api.submit(
            SubmitJob(
                name="traced",
                team="e2e",
                priority_class=PriorityClassName.P1_NORMAL,
                gpus=GpuRequest(count=1),
                workload=WorkloadSpec(kind="sim", steps=1000, step_seconds=0.05),
            )
        )
        assert reply.ok and reply.job_id
    start_subject = f"{p}.cmd.agent.workload.start"

    def consumed() -> list[ReceivedSpan]:
        return [
            s
            for s in receiver.spans
            if s.service == "agent"
            and s.kind == "CONSUMER"
            and s.attributes.get("messaging.destination.name") == start_subject
        ]

    [applied] = await eventually(lambda: _async(consumed()), within=60)
    # The agent applied the start command admission wrote: its span is the child of
    # admission's producer span of that very message.
    assert applied.name == f"apply {start_subject}"
    assert applied.attributes["messaging.system"] == "nats"
    assert applied.attributes["messaging.operation.type"] == "process"
    assert applied.attributes["messaging.consumer.group.name"] == "agent-commands"
    assert applied.attributes["messaging.message.conversation_id"] == reply.job_id
    message_id = applied.attributes["messaging.message.id"]
    # Each service exports its spans in its own batches: admission's may come later.
    [created] = await eventually(
        lambda: _async(
            [
                s
                for s in receiver.spans
                if s.kind == "PRODUCER" and s.attributes.get("messaging.message.id") == message_id
            ]
        ),
        within=30,
    )
    assert created.service == "admission"
    assert created.name == f"create {start_subject}"
    assert created.attributes["messaging.system"] == "nats"
    assert created.attributes["messaging.operation.type"] == "create"
    assert created.attributes["messaging.destination.name"] == start_subject
    assert (applied.trace_id, applied.parent_id) == (created.trace_id, created.span_id)

    # The same trace began at the submit request, answered by admission.
    trace = [s for s in receiver.spans if s.trace_id == created.trace_id]
    [submit] = [s for s in trace if s.kind == "SERVER"]
    assert submit.service == "admission" and submit.name == f"handle {p}.api.jobs.submit"
    assert submit.attributes["messaging.destination.name"] == f"{p}.api.jobs.submit"
    # ... and holds the SQL its handler ran, as client spans below the request.
    statements = [s for s in trace if s.kind == "CLIENT" and s.parent_id == submit.span_id]
    assert statements, [(s.name, s.kind) for s in trace]
    assert all(s.attributes["db.system.name"] == "postgresql" for s in statements)
    assert any("INSERT" in s.attributes["db.query.text"] for s in statements)
    assert {s.service for s in receiver.spans} <= {"admission", "agent"}


async def _async(value: list[ReceivedSpan]) -> list[ReceivedSpan]:
    return value
