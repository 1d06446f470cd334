"""The SDK's first connect is bounded; the reconnects after it are not."""

from __future__ import annotations

import asyncio

import nats
import pytest
from tests.conftest import Servers
from tests.support.waiting import eventually

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import T
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.embedded import EmbeddedNats
from gpusched.sdk import AsyncJobClient, JobClientError
from gpusched.sdk.client import FIRST_CONNECT_S

pytestmark = pytest.mark.timeout(120)

# Room for a busy machine on top of the documented bound.
_SLACK_S = 5.0


def _tasks_besides_this_one() -> set[asyncio.Task[object]]:
    return {task for task in asyncio.all_tasks() if task is not asyncio.current_task()}


async def test_a_first_connect_to_a_nats_nobody_runs_gives_up_with_one_clear_line(
    own_nats: EmbeddedNats, prefix: str
) -> None:
    url = own_nats.url
    await asyncio.to_thread(own_nats.stop)  # its port is now closed: nobody listens
    before = _tasks_besides_this_one()
    with_password = url.replace("nats://", "nats://someone:s3cret@")
    job = AsyncJobClient(with_password, "job-nobody", 1, prefix=prefix)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(JobClientError) as raised:
        await asyncio.wait_for(job.connect(), FIRST_CONNECT_S + _SLACK_S)
    took = loop.time() - began
    assert FIRST_CONNECT_S - 0.5 <= took < FIRST_CONNECT_S + _SLACK_S
    message = str(raised.value)
    assert "\n" not in message
    assert url in message and "s3cret" not in message  # the URL, not its password
    assert "GPUSCHED_NATS_URL" in message and "running" in message
    assert "refused" in message.lower()  # what went wrong on the last attempt
    # Nothing of the attempts keeps running (no reconnect loop, no reader).
    await asyncio.sleep(0.2)
    assert _tasks_besides_this_one() <= before


async def test_a_first_connect_the_server_refuses_gives_up_instead_of_retrying_for_ever(
    servers: Servers, prefix: str
) -> None:
    if servers.auth is None:
        pytest.skip("this NATS lets any client in")
    # No credentials: the server answers every attempt with an authorization violation.
    job = AsyncJobClient(servers.nats_url, "job-nocreds", 1, prefix=prefix)
    with pytest.raises(
        JobClientError, match=r"cannot connect to NATS at .* credentials"
    ) as refused:
        await asyncio.wait_for(job.connect(), FIRST_CONNECT_S + _SLACK_S)
    # The server's own answer, when the client read it before the connection was closed
    # (a reset does not replace it); under load only the reset may have been seen.
    assert "uthorization" in str(refused.value) or "ConnectionReset" in str(refused.value)


async def test_after_its_first_connect_a_job_waits_out_an_outage_longer_than_that_bound(
    own_nats: EmbeddedNats, prefix: str
) -> None:
    subjects = Subjects(prefix)
    events = subjects.job_events("job-long")
    nc = await nats.connect(own_nats.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    try:
        await bus.ensure_streams(nc.jetstream(), subjects.streams())
        job = AsyncJobClient(own_nats.url, "job-long", 1, prefix=prefix)
        await job.connect()
        try:
            await asyncio.to_thread(own_nats.stop)
            await eventually(lambda: _true(not job.connection_state.connected), within=20)
            await job.started()
            await asyncio.sleep(FIRST_CONNECT_S + 2.0)
            await asyncio.to_thread(own_nats.start)
            assert await job.flush(30) == 0
        finally:
            await job.close(timeout=5)
        msg = await nc.jetstream().get_last_msg(subjects.stream("JOBS"), events)
        assert Envelope.from_bytes(msg.data).type == T.JOB_STARTED
    finally:
        await nc.close()


async def _true(value: bool) -> bool:
    return value
