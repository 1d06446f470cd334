"""A job's short-lived credentials against the real nats-server: the job client keeps
reporting on renewed credentials (the file the agent rewrites) for many lifetimes, and
comes back after its credentials expired once a renewal arrives."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from tests.conftest import Servers
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.natsauth import AuthBundle, Identity, job_user_name
from gpusched.sdk import AsyncJobClient

pytestmark = pytest.mark.timeout(120)

LIFETIME_S = 3.0


def _bundle(servers: Servers) -> AuthBundle:
    if servers.auth is None:
        pytest.skip("the NATS of this run authenticates nobody: credentials cannot expire")
    return servers.auth


def _write(bundle: AuthBundle, prefix: str, job_id: str, path: Path) -> None:
    """Credentials of `job_id` for LIFETIME_S, written as the agent writes a renewal."""
    creds = bundle.job_credentials_issuer().creds(
        Identity(job_user_name(prefix, job_id), ttl_s=LIFETIME_S)
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(creds)
    tmp.replace(path)


async def _renew(
    bundle: AuthBundle, prefix: str, job_id: str, path: Path, stop: asyncio.Event
) -> None:
    """Admission's renewal: every third of the lifetime while the allocation lives."""
    while not stop.is_set():
        _write(bundle, prefix, job_id, path)
        try:
            await asyncio.wait_for(stop.wait(), LIFETIME_S / 3)
        except TimeoutError:
            continue


@pytest.fixture
async def streams(servers: Servers, prefix: str) -> AsyncIterator[Subjects]:
    nc = await nats.connect(servers.nats_url, **servers.nats_options)
    subjects = Subjects(prefix)
    await bus.ensure_streams(nc.jetstream(), subjects.streams())
    yield subjects
    await nc.drain()


async def _stored(servers: Servers, subjects: Subjects, job_id: str, count: int) -> int:
    nc = await nats.connect(servers.nats_url, **servers.nats_options)
    try:
        msgs = await stream_messages(nc.jetstream(), subjects.job_events(job_id), count, 20)
        return len(msgs)
    finally:
        await nc.close()


async def test_a_job_keeps_reporting_for_many_lifetimes_of_its_credentials_while_renewed(
    servers: Servers, prefix: str, streams: Subjects, tmp_path: Path
) -> None:
    bundle = _bundle(servers)
    path = tmp_path / "nats.creds"
    stop = asyncio.Event()
    _write(bundle, prefix, "job-r", path)
    renewing = asyncio.create_task(_renew(bundle, prefix, "job-r", path, stop))
    try:
        async with AsyncJobClient(
            servers.nats_url, "job-r", 1, prefix=prefix, credentials=path
        ) as job:
            for step in range(1, 9):
                await asyncio.sleep(LIFETIME_S / 2)
                await job.progress(step)
            # Four lifetimes on: every event stored, none left waiting.
            assert await job.flush(10) == 0
            # Connected on the renewed credentials (a renewal swaps the connection, so
            # one instant may fall between the two).
            await eventually(lambda: _connected(job), within=10)
    finally:
        stop.set()
        await renewing
    assert await _stored(servers, streams, "job-r", 8) == 8


async def test_a_job_whose_credentials_expired_comes_back_with_the_next_renewal(
    servers: Servers, prefix: str, streams: Subjects, tmp_path: Path
) -> None:
    bundle = _bundle(servers)
    path = tmp_path / "nats.creds"
    _write(bundle, prefix, "job-x", path)
    async with AsyncJobClient(servers.nats_url, "job-x", 1, prefix=prefix, credentials=path) as job:
        await job.progress(1)
        # No renewal for longer than a lifetime (admission was away): the server drops
        # the connection; what the job reports meanwhile waits in its buffer.
        await asyncio.sleep(LIFETIME_S + 1.5)
        await job.progress(2)
        assert not job.connection_state.connected
        _write(bundle, prefix, "job-x", path)  # admission is back: a renewal
        await eventually(lambda: _connected(job), within=15)
        await job.progress(3)
        assert await job.flush(10) == 0
    assert await _stored(servers, streams, "job-x", 3) == 3


async def _connected(job: AsyncJobClient) -> bool:
    return job.connection_state.connected and job.connection_state.buffered == 0
