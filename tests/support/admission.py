"""The admission service as tests drive it: started in-process on the real NATS and
PostgreSQL, and a client that speaks its API and plays the services around it."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import BaseModel

from gpusched.admission import app as admission_app
from gpusched.admission.app import NAME as ADMISSION
from gpusched.admission.app import SCHEMA, AdmissionService, assemble
from gpusched.admission.wire import inventory_loaded
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointInfo,
    EvictionCompleted,
    ReserveForInference,
    ReturnToShared,
    StageName,
    StopReason,
    T,
    WorkloadStopped,
)
from gpusched.contracts.subjects import Subjects
from gpusched.domain.inventory import Pool, parse_inventory
from gpusched.domain.ledger import Ledger, PoolCapacity
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings
from tests.support.identity import harness_options
from tests.support.waiting import eventually, stream_messages

# One inference node (2 GPUs) and one shared node (4 GPUs), all A100-80GB.
SMALL_CLUSTER = """
nodes:
  - name: inf-00
    pool: inference
    gpu_model: A100-80GB
    gpus: 2
    cpu_milli: 32000
    memory_mib: 262144
  - name: shared-00
    pool: shared
    gpu_model: A100-80GB
    gpus: 4
    cpu_milli: 64000
    memory_mib: 524288
"""


def with_inventory(settings: Settings, tmp_path: Path, inventory: str) -> Settings:
    """``settings`` with admission reading ``inventory`` (YAML) and scheduling often."""
    path = tmp_path / "inventory.yaml"
    path.write_text(inventory)
    admission = settings.admission.model_copy(
        update={"inventory_path": path, "schedule_interval_s": 0.3}
    )
    return settings.model_copy(update={"admission": admission})


CHECKPOINT = CheckpointInfo(
    checkpoint_id="ckpt-7",
    step=700,
    uri="file:///ckpt/7",
    bytes=1024,
    sha256="0" * 64,
    stage=StageName.PERSISTED,
)


@dataclass
class Admission:
    rt: ServiceRuntime
    service: AdmissionService
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.rt.request_stop()
        await asyncio.wait_for(self.task, 20)

    async def capacity(self) -> dict[Pool, PoolCapacity]:
        async with self.rt.uow() as uow:
            return (await self.service.keeper.read(uow)).capacity()

    async def ledger(self) -> Ledger:
        async with self.rt.uow() as uow:
            return await self.service.keeper.read(uow)

    async def rows(self, table: str) -> int:
        async with self.rt.uow() as uow:
            result = await uow.execute(f"SELECT count(*) FROM {SCHEMA}.{table}")
            return int(result.scalar_one())


async def start_admission(settings: Settings) -> Admission:
    rt = ServiceRuntime(ADMISSION, SCHEMA, settings, migrations_dir(admission_app.__file__))
    await rt.start()
    service = await assemble(rt)
    running = Admission(rt, service, asyncio.create_task(rt.run()))

    # Asked as the test (the service's own identity may not call its API).
    assert settings.nats_url is not None
    probe = await nats.connect(settings.nats_url, **harness_options(settings))

    async def answering() -> bool:
        try:
            await probe.request(rt.subjects.api_jobs_get, b"{}", timeout=5)
        except NoRespondersError:
            return False
        return True

    try:
        # The endpoints subscribe once run() is under way.
        await eventually(answering, within=20)
    finally:
        await probe.close()
    return running


@dataclass
class Client:
    nc: NatsClient
    js: JetStreamContext
    s: Subjects

    async def request(self, subject: str, body: bytes) -> dict[str, Any]:
        reply = await self.nc.request(subject, body, timeout=15)
        data: dict[str, Any] = json.loads(reply.data)
        return data

    async def submit(self, **fields: Any) -> dict[str, Any]:
        body = {"name": "train", "team": "vision", "gpus": {"count": 2}, **fields}
        return await self.request(self.s.api_jobs_submit, json.dumps(body).encode())

    async def submitted(self, **fields: Any) -> str:
        reply = await self.submit(**fields)
        assert reply["ok"], reply
        job_id: str = reply["job_id"]
        return job_id

    async def job(self, job_id: str) -> dict[str, Any]:
        reply = await self.request(self.s.api_jobs_get, json.dumps({"job_id": job_id}).encode())
        assert reply["ok"], reply
        job: dict[str, Any] = reply["job"]
        return job

    async def job_in(self, job_id: str, state: str) -> dict[str, Any]:
        async def check() -> dict[str, Any] | None:
            job = await self.job(job_id)
            return job if job["state"] == state else None

        return await eventually(check, within=20)

    async def publish(
        self, subject: str, message_type: str, data: BaseModel, *, source: str = "test"
    ) -> Envelope:
        envelope = make_envelope(message_type, data, source=source)
        await self.js.publish(subject, envelope.to_bytes())
        return envelope

    async def events(self, subject: str, expect: int) -> list[Envelope]:
        msgs = await stream_messages(self.js, subject, expect, within=20)
        return [Envelope.from_bytes(msg.data) for msg in msgs]

    async def all_events(self, subject: str) -> list[Envelope]:
        """Every message stored on `subject` so far (the stream is read to its end)."""
        sub = await self.js.subscribe(
            subject, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL), manual_ack=False
        )
        got: list[Envelope] = []
        try:
            while True:
                got.append(Envelope.from_bytes((await sub.next_msg(timeout=1.0)).data))
        except NatsTimeout:
            return got
        finally:
            await sub.unsubscribe()

    async def audits(self, action: str, entity: str, expect: int) -> list[Envelope]:
        async def check() -> list[Envelope] | None:
            found = [
                e for e in await self.all_events(self.s.audit(action)) if e.data["entity"] == entity
            ]
            return found if len(found) >= expect else None

        return await eventually(check, within=20)

    # --- what the other services would send ---

    async def stopped(
        self, job: dict[str, Any], reason: StopReason, saga_id: str | None = None
    ) -> Envelope:
        return await self.publish(
            self.s.event("agent", T.WORKLOAD_STOPPED),
            T.WORKLOAD_STOPPED,
            WorkloadStopped(
                allocation_id=job["allocation_id"],
                job_id=job["job_id"],
                reason=reason,
                stopped_at=datetime.now(UTC),
                exit_code=0,
                saga_id=saga_id,
            ),
        )

    async def eviction_completed(self, job: dict[str, Any], saga_id: str) -> Envelope:
        return await self.publish(
            self.s.event("checkpoint", T.EVICTION_COMPLETED),
            T.EVICTION_COMPLETED,
            EvictionCompleted(
                saga_id=saga_id,
                request_id=f"req-{saga_id}",
                allocation_id=job["allocation_id"],
                job_id=job["job_id"],
                checkpoint=CHECKPOINT,
            ),
        )

    async def reserve(
        self, decision_id: str, allocation_ids: list[str], free_gpus: int = 0
    ) -> Envelope:
        return await self.publish(
            self.s.command(ADMISSION, T.RESERVE_FOR_INFERENCE),
            T.RESERVE_FOR_INFERENCE,
            ReserveForInference(
                reservation_id="res-1",
                decision_id=decision_id,
                allocation_ids=allocation_ids,
                free_gpus=free_gpus,
            ),
        )

    async def return_gpus(self, decision_id: str, gpus: int) -> Envelope:
        return await self.publish(
            self.s.command(ADMISSION, T.RETURN_TO_SHARED),
            T.RETURN_TO_SHARED,
            ReturnToShared(reservation_id="res-1", decision_id=decision_id, gpus=gpus),
        )


def inventory_loaded_bytes(nodes: int) -> bytes:
    """admission's inventory.loaded as its outbox writes it, for `nodes` 8-GPU nodes of
    two NVLink islands each (~109 bytes a node)."""
    inventory = parse_inventory(
        {"nodes": [{"name_prefix": "gpu-node", "count": nodes, "pool": "shared",
                    "gpu_model": "A100-80GB", "gpus": 8, "cpu_milli": 128000,
                    "memory_mib": 1048576, "nvlink_islands": [[0, 1, 2, 3], [4, 5, 6, 7]]}]}
    )  # fmt: skip
    event = make_envelope(T.INVENTORY_LOADED, inventory_loaded(inventory), source=ADMISSION)
    return event.to_bytes()
