"""A cluster of 10,000 nodes on the real NATS and PostgreSQL: admission's
inventory.loaded (every node, over NATS's default 1 MiB) goes out on a server set up as
the stacks gpusched ships (8 MiB), instead of being parked."""

from __future__ import annotations

from pathlib import Path

import nats
import pytest
from tests.support.admission import SCHEMA, start_admission, with_inventory
from tests.support.identity import harness_options
from tests.support.waiting import stream_messages

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import T
from gpusched.contracts.subjects import Subjects
from gpusched.infra.natsauth import CLIENT_MAX_PAYLOAD
from gpusched.infra.settings import Settings

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


async def test_admission_announces_an_inventory_of_10000_nodes_in_one_event(
    settings: Settings, tmp_path: Path
) -> None:
    assert settings.nats_url is not None
    observer = await nats.connect(settings.nats_url, **harness_options(settings))
    if observer.max_payload <= CLIENT_MAX_PAYLOAD:
        await observer.close()
        pytest.skip("the external NATS of this run takes no more than NATS's default")
    admission = await start_admission(with_inventory(settings, tmp_path, INVENTORY))
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
    finally:
        await admission.stop()
        await observer.close()
