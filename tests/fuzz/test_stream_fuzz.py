"""Hostile stream messages against the real consumers of ingest, admission and
checkpoint (NATS + PostgreSQL): every one is dead-lettered on `<p>.dlq.<service>` with
a `message.dead_lettered` audit record, nothing stored changes, and a valid message
right after is applied."""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient

from gpusched.checkpoint import app as checkpoint_app
from gpusched.contracts.envelope import utcnow
from gpusched.contracts.subjects import Subjects
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest import app as ingest_app
from gpusched.ingest.fold import TelemetryFold
from tests.fuzz.service_state import dead_letters, digest
from tests.fuzz.strategies import (
    EXAMPLES,
    MEGABYTE,
    Mutation,
    draw,
    gpu_sample,
    gpu_sample_fields,
    inference_stats,
    inference_stats_fields,
    job_events,
    mutations,
    to_json,
)
from tests.support.admission import SMALL_CLUSTER, start_admission, with_inventory
from tests.support.identity import harness_options
from tests.support.waiting import eventually, stream_messages_after

pytestmark = pytest.mark.timeout(120)

NODE = "shared-00"  # in SMALL_CLUSTER, with 4 GPUs
SERVICE = "chat"
JOB = "fuzz-job"


class Cluster:
    """Ingest, admission and checkpoint running, and a connection that plays the
    producers."""

    def __init__(
        self,
        settings: Settings,
        nc: NatsClient,
        runtimes: dict[str, ServiceRuntime],
        fold: TelemetryFold,
    ):
        self.settings = settings
        self.nc = nc
        self.js = nc.jetstream()
        self.s = Subjects(settings.subject_prefix)
        self.rt = runtimes
        self.fold = fold  # ingest's telemetry window lives in memory

    async def publish(self, subject: str, raw: bytes) -> None:
        await self.js.publish(subject, raw)

    async def dead_lettered(self, service: str, raws: list[bytes], within: float = 30.0) -> None:
        """Every one of `raws` reached `<p>.dlq.<service>`."""

        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            found = set(await dead_letters(self.js, self.s.dead_letter(service)))
            missing = [raw[:120] for raw in raws if raw not in found]
            if not missing:
                return
            if loop.time() > deadline:
                raise AssertionError(f"{len(missing)} not dead-lettered by {service}: {missing}")
            await asyncio.sleep(0.2)

    async def caught_up(self, durable: str) -> bool:
        info = await self.js.consumer_info(self.s.stream("JOBS"), durable)
        return info.num_pending == 0 and info.num_ack_pending == 0

    async def dead_letter_audits(self) -> list[dict[str, Any]]:
        msgs = await stream_messages_after(self.js, self.s.audit("message.dead_lettered"))
        return [json.loads(m.data)["data"] for m in msgs]

    async def settled(self, service: str) -> dict[str, str]:
        """The digest once `service` is quiet: the same over 1.6 s, longer than any
        service's tick (1 s), so work still to come cannot change it afterwards."""
        last = await digest(self.rt[service])
        quiet = 0.0
        for _ in range(100):
            await asyncio.sleep(0.2)
            now = await digest(self.rt[service])
            quiet = quiet + 0.2 if now == last else 0.0
            if quiet >= 1.6:
                return now
            last = now
        return last


async def _start(rt: ServiceRuntime, build: Any) -> tuple[asyncio.Task[None], Any]:
    await rt.start()
    built = await build(rt)
    return asyncio.create_task(rt.run()), built


@pytest.fixture(scope="module")
async def cluster(module_settings: Settings) -> AsyncIterator[Cluster]:
    assert module_settings.data_dir is not None and module_settings.nats_url is not None
    module_settings.data_dir.mkdir(parents=True, exist_ok=True)
    settings = with_inventory(module_settings, Path(module_settings.data_dir), SMALL_CLUSTER)
    # A quiet snapshot loop: the tables change only by what the test sends.
    settings = settings.model_copy(
        update={
            "ingest": IngestSettings(window_s=3000, snapshot_interval_s=1000, stale_after_s=3000),
            "checkpoint": settings.checkpoint.model_copy(update={"grace_s": 600.0}),
        }
    )
    async with AsyncExitStack() as stack:
        admission = await start_admission(settings)
        stack.push_async_callback(admission.stop)
        runtimes = {"admission": admission.rt}
        built: dict[str, Any] = {}
        for name, app in (("ingest", ingest_app), ("checkpoint", checkpoint_app)):
            rt = ServiceRuntime(app.NAME, app.SCHEMA, settings, migrations_dir(app.__file__))
            task, built[name] = await _start(rt, app.build)
            runtimes[name] = rt

            async def stop(rt: ServiceRuntime = rt, task: asyncio.Task[None] = task) -> None:
                rt.request_stop()
                await asyncio.wait_for(task, 20)

            stack.push_async_callback(stop)
        nc = await nats.connect(module_settings.nats_url, **harness_options(module_settings))
        stack.push_async_callback(nc.drain)
        yield Cluster(settings, nc, runtimes, built["ingest"])


def envelope(message_type: str, data: Any, *, now: datetime | None = None, **fields: Any) -> bytes:
    document = {
        "id": f"fuzz-{uuid.uuid4().hex}",  # every message its own bytes
        "type": message_type,
        "version": 1,
        "source": "fuzz",
        "time": (now or utcnow()).isoformat(),
        "data": data,
        **fields,
    }
    return to_json(document)


def envelope_faults(message_type: str, data: dict[str, Any]) -> list[bytes]:
    """The same valid payload in envelopes that are wrong."""
    return [
        b"",
        b"\x00\xff garbage",
        b"{" * 10_000,
        to_json({"id": "x", "type": message_type}),
        envelope(message_type + ".v9", data),  # an unknown type
        envelope("no.such.type", data),
        envelope(message_type, data, version=2),  # newer than this build reads
        envelope(message_type, data, version=True),
        envelope(message_type, data, now=utcnow() + timedelta(days=3650)),
        envelope(message_type, data, time="9999-12-31T23:59:59Z"),
        envelope(message_type, data, id="a\x00b"),
        envelope(message_type, data, source="\u202eevil"),
        envelope(message_type, data, correlation_id=MEGABYTE),
        envelope(message_type, [data]),
        envelope(message_type, {**data, "nested": {"deep": math.nan}})
        if message_type == "job.progress"
        else envelope(message_type, None),
    ]


async def test_hostile_telemetry_is_dead_lettered_and_audited_and_changes_nothing(
    cluster: Cluster,
) -> None:
    gpu_subject = cluster.s.telemetry_gpu(NODE)
    stats_subject = cluster.s.telemetry_inference(SERVICE)
    # Ingest knows the node once admission's inventory reached it: a sample is folded.
    await cluster.publish(gpu_subject, envelope("gpu.sample", gpu_sample(NODE, utcnow())))
    await eventually(lambda: samples(cluster), within=30)
    before = await cluster.settled("ingest")
    folded = await samples(cluster)
    audits_before = len(await cluster.dead_letter_audits())

    now = utcnow()
    hostile: list[tuple[str, bytes]] = []
    for mutation in draw(mutations(gpu_sample_fields(now, "inf-00")), EXAMPLES):
        assert isinstance(mutation, Mutation)
        raw = envelope("gpu.sample", mutation.apply(gpu_sample(NODE, now)))
        hostile.append((gpu_subject, raw))
    for mutation in draw(mutations(inference_stats_fields(now, "search")), EXAMPLES):
        raw = envelope("inference.stats", mutation.apply(inference_stats(SERVICE, now)))
        hostile.append((stats_subject, raw))
    # A GPU the node does not have: well-formed, but refused by ingest's inventory.
    beyond = gpu_sample(NODE, now)
    beyond["gpus"][1]["index"] = 7
    hostile.append((gpu_subject, envelope("gpu.sample", beyond)))
    for raw in envelope_faults("gpu.sample", gpu_sample(NODE, now)):
        hostile.append((gpu_subject, raw))
    for subject, raw in hostile:
        await cluster.publish(subject, raw)

    await cluster.dead_lettered("ingest", [raw for _, raw in hostile])
    audits = (await cluster.dead_letter_audits())[audits_before:]
    assert len(audits) >= len(hostile)
    assert {a["entity"] for a in audits} == {gpu_subject, stats_subject}
    assert await digest(cluster.rt["ingest"]) == before
    assert await samples(cluster) == folded

    stored = await samples(cluster)
    await cluster.publish(gpu_subject, envelope("gpu.sample", gpu_sample(NODE, utcnow())))
    await eventually(lambda: more_than(cluster, stored), within=20)


async def samples(cluster: Cluster) -> int:
    """How many node samples ingest's window holds (each accepted one is one more)."""
    return len(cluster.fold.window)


async def more_than(cluster: Cluster, count: int) -> bool:
    return await samples(cluster) > count


async def test_hostile_job_events_are_dead_lettered_and_change_nothing(
    cluster: Cluster,
) -> None:
    subject = cluster.s.job_events(JOB)
    # Only the checkpoint service reads job events: admission and preemption follow the
    # checkpoints it verified (`checkpoint.verified`), never a job's own claims.
    before = {name: await cluster.settled(name) for name in ("admission", "checkpoint")}

    hostile: list[bytes] = []
    events = job_events(JOB, "another-job")
    per_type = max(6, EXAMPLES // len(events))
    for message_type, (valid, fields) in events.items():
        for mutation in draw(mutations(fields), per_type):
            hostile.append(envelope(message_type, mutation.apply(valid)))
    hostile += envelope_faults("job.progress", events["job.progress"][0])
    hostile += envelope_faults("job.started", events["job.started"][0])
    for raw in hostile:
        await cluster.publish(subject, raw)

    await cluster.dead_lettered("checkpoint", hostile)
    audits = await cluster.dead_letter_audits()
    on_subject = [a for a in audits if a["entity"] == subject]
    assert len(on_subject) >= len(hostile)
    assert {a["actor"] for a in on_subject} == {"checkpoint"}
    for name in ("admission", "checkpoint"):
        assert await digest(cluster.rt[name]) == before[name], name

    # A valid event right after is taken and acknowledged, not dead-lettered.
    valid = envelope("job.progress", {"step": 11, "loss": 0.4})
    await cluster.publish(subject, valid)
    await eventually(lambda: cluster.caught_up("checkpoint-job-events"), within=20)
    assert valid not in await dead_letters(cluster.js, cluster.s.dead_letter("checkpoint"))


async def test_a_message_on_a_hostile_subject_is_dead_lettered_and_ingest_keeps_working(
    cluster: Cluster,
) -> None:
    """The subject itself is the producer's choice: a bidi character or a very long
    token in it must not stop the consumer that reports it."""
    now = utcnow()
    hostile = {
        cluster.s.all_gpu_telemetry.replace("*", "n\u202eode"): gpu_sample("n\u202eode", now),
        cluster.s.all_gpu_telemetry.replace("*", "n" * 300): gpu_sample("n" * 300, now),
    }
    raws = []
    for subject, data in hostile.items():
        raw = envelope("gpu.sample", data)
        raws.append(raw)
        await cluster.publish(subject, raw)
    await cluster.dead_lettered("ingest", raws)
    audits = await cluster.dead_letter_audits()
    assert any("\\u202e" in a["entity"] for a in audits)

    stored = await samples(cluster)
    gpu_subject = cluster.s.telemetry_gpu(NODE)
    await cluster.publish(gpu_subject, envelope("gpu.sample", gpu_sample(NODE, utcnow())))
    await eventually(lambda: more_than(cluster, stored), within=20)
