"""A cluster of 10,000 nodes on the real NATS and PostgreSQL: admission's
inventory.loaded (every node, over NATS's default 1 MiB) goes out on a server set up as
the stacks gpusched ships (8 MiB), instead of being parked, and the services that
project it (ingest's pool membership, preemption's NVLink islands) apply all of it."""

from __future__ import annotations

import time
from pathlib import Path

import nats
import pytest
from tests.support.admission import SCHEMA, start_admission, with_inventory
from tests.support.identity import harness_options
from tests.support.services import running
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import T
from gpusched.contracts.subjects import Subjects
from gpusched.infra.natsauth import CLIENT_MAX_PAYLOAD
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings
from gpusched.ingest import app as ingest_app
from gpusched.preemption import app as preemption_app

pytestmark = pytest.mark.timeout(240)

NODES = 10_000
INVENTORY = f"""
nodes:
  - name_prefix: gpu-node
    count: {NODES}
    pool: shared
    gpu_model: A100-80GB
    gpus: 8
    cpu_milli: 128000
    memory_mib: 1048576
    nvlink_islands: [[0, 1, 2, 3], [4, 5, 6, 7]]
"""


async def count(runtime: ServiceRuntime, table: str) -> int:
    async with runtime.uow() as uow:
        row = await uow.fetchrow(f"SELECT count(*) AS n FROM {runtime.schema}.{table}")
    assert row is not None
    return int(row["n"])


async def test_an_inventory_of_10000_nodes_goes_out_in_one_event_and_is_applied(
    settings: Settings, tmp_path: Path
) -> None:
    assert settings.nats_url is not None
    observer = await nats.connect(settings.nats_url, **harness_options(settings))
    if observer.max_payload <= CLIENT_MAX_PAYLOAD:
        await observer.close()
        pytest.skip("the external NATS of this run takes no more than NATS's default")
    configured = with_inventory(settings, tmp_path, INVENTORY)
    admission = await start_admission(configured)
    try:
        s = Subjects(settings.subject_prefix)
        [msg] = await stream_messages(
            observer.jetstream(), s.event("admission", T.INVENTORY_LOADED), 1, within=120
        )
        assert len(msg.data) > 1024 * 1024
        nodes = Envelope.from_bytes(msg.data).data["nodes"]
        assert len(nodes) == NODES
        assert nodes[-1]["gpu_groups"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
        async with admission.rt.uow() as uow:
            row = await uow.fetchrow(f"SELECT count(*) AS n FROM {SCHEMA}.outbox_parked")
        assert row is not None and row["n"] == 0

        began = time.monotonic()
        async with (
            running(configured, ingest_app) as ingest,
            running(configured, preemption_app) as preemption,
        ):

            async def applied() -> bool:
                return (
                    await count(ingest, "nodes") == NODES
                    and await count(preemption, "gpu_islands") == NODES * 8
                )

            assert await eventually(applied, within=180)
        print(f"ingest and preemption applied {NODES} nodes in {time.monotonic() - began:.1f} s")
    finally:
        await admission.stop()
        await observer.close()
