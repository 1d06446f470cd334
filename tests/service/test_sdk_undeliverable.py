"""An event that can never be published does not hold up the job's later events."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from tests.conftest import Servers
from tests.support.identity import job_credentials_file
from tests.support.waiting import stream_messages

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import T
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.natsauth import CLIENT_MAX_PAYLOAD
from gpusched.sdk import AsyncJobClient

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def observer(servers: Servers, prefix: str) -> AsyncIterator[NatsClient]:
    nc = await nats.connect(servers.nats_url, **servers.nats_options)
    await bus.ensure_streams(nc.jetstream(), Subjects(prefix).streams())
    yield nc
    await nc.drain()


async def test_an_event_over_what_a_job_may_publish_is_given_up_and_the_later_ones_arrive(
    servers: Servers, prefix: str, observer: NatsClient, tmp_path: Path
) -> None:
    job = AsyncJobClient(
        servers.nats_url,
        "job-big",
        1,
        prefix=prefix,
        credentials=job_credentials_file(servers.auth, prefix, "job-big", tmp_path),
    )
    await job.connect()
    try:
        await job.started()
        # A metric the contract accepts (2,000 short strings) that is larger than what
        # a job may publish in one message (1 MiB; the server would cut it off) and,
        # where the server takes less, than the server's max_payload.
        samples = ["x" * 1000] * 2000
        assert min(observer.max_payload, CLIENT_MAX_PAYLOAD) < len(str(samples))
        loop = asyncio.get_running_loop()
        began = loop.time()
        await job.progress(1, samples=samples)
        assert loop.time() - began < 1.0  # given up at once, not waited for
        await job.progress(2, loss=0.5)
        await job.completed(2)
        assert await job.flush(10) == 0
        assert job.connection_state.dropped == 1
    finally:
        await job.close(timeout=5)

    subject = Subjects(prefix).job_events("job-big")
    msgs = await stream_messages(observer.jetstream(), subject, 3, within=10)
    events = [Envelope.from_bytes(m.data) for m in msgs]
    assert [(e.type, e.data.get("step")) for e in events] == [
        (T.JOB_STARTED, None),
        (T.JOB_PROGRESS, 2),
        (T.JOB_COMPLETED, 2),
    ]
