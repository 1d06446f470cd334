"""What keeps a NATS connection from waiting without end on a server gone silent.

nats-py notices a server that stopped answering by its pings, and then, before it
reconnects, closes the old socket and waits until it is closed, with no timeout.
`ConnectionWatchdog` aborts a socket that cannot close; FLUSH_TIMEOUT_S bounds a publish
that has to flush a full buffer. Both the services' connection (`bus.connect`) and the
training SDK's use them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from nats.aio.client import Client as NatsClient

# A dropped connection's socket still open after this long is aborted.
CLOSE_STUCK_S: Final = 5.0
# A publish that had to flush a full buffer waits at most this long (a FlushTimeoutError
# is reported and the data stays buffered) instead of without end.
FLUSH_TIMEOUT_S: Final = 10.0


class ConnectionWatchdog:
    """Aborts the socket of a dropped connection that nats-py cannot close.

    Before it reconnects, nats-py closes the old socket and waits until it is closed
    (`_attempt_reconnect`: `await transport.wait_closed()`, with no timeout). asyncio
    closes a socket only once what was written to it is delivered, so with a server
    that stopped reading (its process frozen) and a full send buffer, that wait lasts
    until the kernel gives up on the peer (minutes) or for ever, and the client never
    reconnects. This task looks once a second: a connection that has been reconnecting
    for CLOSE_STUCK_S with the socket it had still open gets that socket aborted (its
    unsent data is dropped: the outbox and the consumers send or fetch it again)."""

    def __init__(self, name: str, logger: logging.Logger) -> None:
        self._name = name
        self._log = logger
        self._task: asyncio.Task[None] | None = None

    def start(self, nc: NatsClient) -> None:
        self._task = asyncio.get_running_loop().create_task(self._watch(nc))

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _watch(self, nc: NatsClient) -> None:
        since: float | None = None
        stuck: asyncio.WriteTransport | None = None
        while not nc.is_closed:
            await asyncio.sleep(1.0)
            if not nc.is_reconnecting:
                since, stuck = None, None
                continue
            now = time.monotonic()
            if since is None:
                since, stuck = now, _socket_of(nc)
            elif stuck is not None and now - since >= CLOSE_STUCK_S:
                if not stuck.is_closing() or stuck.get_write_buffer_size():
                    self._log.warning(
                        "%s: the dropped NATS connection's socket did not close in %.0f s "
                        "(the server stopped reading); aborting it to reconnect",
                        self._name,
                        now - since,
                    )
                    stuck.abort()
                stuck = None


def _socket_of(nc: NatsClient) -> asyncio.WriteTransport | None:
    """The asyncio transport under nats-py's connection (its TCP/TLS transport's
    writer), if it has one of that shape."""
    writer = getattr(getattr(nc, "_transport", None), "_io_writer", None)
    transport = getattr(writer, "transport", None)
    return transport if isinstance(transport, asyncio.WriteTransport) else None
