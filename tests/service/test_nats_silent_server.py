"""A NATS server that stops answering without closing the connection (its process
frozen, its host gone without a FIN) is an outage the client gets over, never a wait
without end: the services' connection (`bus.connect`) notices it, drops the socket it
cannot close and reconnects once the server answers again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.errors import OutboundBufferLimitError
from tests.support.waiting import eventually

from gpusched.infra import bus
from gpusched.infra.embedded import EmbeddedNats, free_port

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def scratch() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpusched-test-silent-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def test_a_frozen_server_with_unsent_data_is_left_and_reconnected_to_when_it_thaws(
    scratch: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="gpusched.infra.bus.connection")
    server = EmbeddedNats(scratch / "nats", port=free_port())
    url = await asyncio.to_thread(server.start)
    pid = server.pid
    assert pid is not None
    nc = await bus.connect(url, "silent-test", ping_interval_s=1.0)
    frozen = False
    try:
        await nc.flush(timeout=5)
        os.kill(pid, signal.SIGSTOP)
        frozen = True
        # More than the kernel's socket buffers hold: the rest stays in the client's
        # transport, so closing the socket has something it cannot deliver.
        chunk = b"x" * (256 * 1024)
        for _ in range(48):
            try:
                await nc.publish("silent.test", chunk)
            except OutboundBufferLimitError:
                break
        # Noticed by the pings (1 s here), then the old socket is aborted: nats-py
        # reports the disconnection only once that socket is closed.
        await eventually(lambda: _async("lost the NATS connection" in caplog.text), within=60)
        assert "aborting it to reconnect" in caplog.text
        assert not nc.is_connected

        os.kill(pid, signal.SIGCONT)
        frozen = False
        await eventually(lambda: _async(nc.is_connected), within=60)
        # The connection works again, end to end.
        observer = await nats.connect(url)
        try:
            got: asyncio.Queue[bytes] = asyncio.Queue()

            async def on_message(msg: nats.aio.msg.Msg) -> None:
                await got.put(msg.data)

            await observer.subscribe("after.thaw", cb=on_message)

            # nats-py writes a flush's PING straight to the socket, ahead of the SUB still
            # queued for its flusher, so the observer's flush can return before the server
            # has its subscription: publish until one arrives.
            async def delivered() -> bool:
                await nc.publish("after.thaw", b"back")
                await nc.flush(timeout=10)
                with contextlib.suppress(TimeoutError):
                    return await asyncio.wait_for(got.get(), 0.5) == b"back"
                return False

            await eventually(delivered, within=20)
        finally:
            await observer.close()
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        await asyncio.wait_for(nc.close(), 30)
        await asyncio.to_thread(server.stop)


async def _async(value: bool) -> bool:
    return value
