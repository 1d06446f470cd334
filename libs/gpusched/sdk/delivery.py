"""Events on their way to the control plane: a bounded buffer that outlives an outage.

A job (or the cluster agent) must not stop because NATS is away. Every event goes into
an in-memory buffer; one background task publishes the buffer in order to JetStream,
each publish bounded by a timeout. A failed or timed-out publish stays at the head of
the buffer and is tried again with backoff, under the same Nats-Msg-Id (its envelope
id), so JetStream stores it once even if an earlier attempt did land.

The caller waits for its event at most `wait_s` while the link is healthy, and not at
all while the buffer is already holding events back: a training loop never blocks on
an outage. The buffer is bounded: when it is full the oldest *droppable* event goes
first (progress and telemetry, which newer ones supersede); results (a checkpoint
confirmation, completion, a workload that stopped) are never dropped. A droppable event
may also carry a maximum age: it is dropped instead of sent once older than that.

Only the link holds events back. An event that fails for a reason of its own (larger
than the server's max_payload or than the sender may publish, refused by JetStream
three times) is logged as an error, counted in `dropped` and given up, so the events
behind it still go, in order. One larger than the sender may publish is not sent at
all: the server would cut the connection of a client that sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from nats.errors import ConnectionDrainingError, ConnectionReconnectingError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from gpusched.infra.errors import is_outage
from gpusched.infra.natsauth import message_size
from gpusched.infra.tasks import cancel_and_wait

log = logging.getLogger(__name__)

DEFAULT_CAPACITY = 10_000
DEFAULT_PUBLISH_TIMEOUT_S = 2.0
DEFAULT_WAIT_S = 2.0
_BACKOFF_FIRST_S = 0.1
_BACKOFF_MAX_S = 2.0
# JetStream answered with an error (not "unavailable"): after this many answers the
# event is given up, so that one event the server refuses cannot hold up the rest.
_REFUSALS = 3
_UNAVAILABLE = 503


def _link_failed(exc: BaseException) -> bool:
    """True when a publish failed because of the connection or the server (an outage,
    a connection being drained or re-established), not because of the event itself."""
    return is_outage(exc) or isinstance(exc, ConnectionDrainingError | ConnectionReconnectingError)


@dataclass(eq=False)
class Outgoing:
    """One event to publish: its subject, bytes and Nats-Msg-Id (its envelope id)."""

    subject: str
    data: bytes
    msg_id: str
    message_type: str
    droppable: bool = False  # superseded by newer events of its kind
    max_age_s: float | None = None  # a droppable event older than this is not sent
    headers: dict[str, str] = field(default_factory=dict)
    queued_at: float = 0.0
    delivered: asyncio.Event = field(default_factory=asyncio.Event)
    # Delivered or given up: nobody needs to wait for it any longer.
    settled: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(frozen=True, slots=True)
class DeliveryState:
    """What a framework may show: is the control plane reachable, what waits for it."""

    connected: bool
    buffered: int
    dropped: int

    def __str__(self) -> str:
        if self.buffered == 0:
            return "connected" if self.connected else "disconnected"
        link = "connected" if self.connected else "disconnected"
        return f"{link}, buffering {self.buffered}"


class EventBuffer:
    """Publishes events in order through outages; see the module docstring."""

    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        *,
        name: str,
        capacity: int = DEFAULT_CAPACITY,
        publish_timeout_s: float = DEFAULT_PUBLISH_TIMEOUT_S,
        wait_s: float = DEFAULT_WAIT_S,
        max_payload: int | None = None,
    ) -> None:
        """`max_payload`: the most this sender's credentials may publish in one message
        (a job's: ``natsauth.CLIENT_MAX_PAYLOAD``); None: what the server takes."""
        if capacity < 1:
            raise ValueError("an event buffer needs room for at least one event")
        self._max_payload = max_payload
        self._nc = nc
        self._js = js
        self._name = name
        self._capacity = capacity
        self._publish_timeout_s = publish_timeout_s
        self._wait_s = wait_s
        self._items: deque[Outgoing] = deque()
        self._in_flight: Outgoing | None = None
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._empty.set()
        self._failing = False
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.dropped = 0
        self.sent = 0

    def rebind(self, nc: NatsClient, js: JetStreamContext) -> None:
        """Send over another connection from now on (the old one was closed for good)."""
        self._nc, self._js = nc, js
        self._wake.set()

    # --- state --------------------------------------------------------------------------
    @property
    def state(self) -> DeliveryState:
        connected = self._nc.is_connected and not self._failing
        return DeliveryState(connected, len(self._items), self.dropped)

    def __len__(self) -> int:
        return len(self._items)

    # --- sending ------------------------------------------------------------------------
    async def send(self, item: Outgoing) -> bool:
        """Queue `item`; wait for its delivery a bounded time. True once it is stored."""
        if not self.put(item) or not self.state.connected or self._wait_s <= 0:
            return False  # an outage is going on: the caller keeps working
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(item.settled.wait(), self._wait_s)
        return item.delivered.is_set()

    def put(self, item: Outgoing) -> bool:
        """Queue `item` without waiting (False: the buffer is closed, it is not sent)."""
        if self._closed:
            log.warning("%s: closed; %s is not sent", self._name, item.message_type)
            return False
        size = message_size(item.data, {"Nats-Msg-Id": item.msg_id, **item.headers})
        if self._max_payload is not None and size > self._max_payload:
            log.error(
                "%s: %s is %d bytes, more than this sender may publish (%d); giving it up",
                self._name,
                item.message_type,
                size,
                self._max_payload,
            )
            self._give_up(item)
            return False
        self._ensure_running()
        item.queued_at = asyncio.get_running_loop().time()
        if len(self._items) >= self._capacity:
            self._drop_oldest_droppable()
        self._items.append(item)
        self._empty.clear()
        self._wake.set()
        return True

    async def flush(self, timeout: float) -> int:  # noqa: ASYNC109 - a bounded wait is the API
        """Wait up to `timeout` seconds for the buffer to empty; how many events are left."""
        if self._items:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._empty.wait(), timeout)
        return len(self._items)

    async def close(self, timeout: float) -> int:  # noqa: ASYNC109
        """Flush for at most `timeout` seconds, then stop; how many events were lost."""
        try:
            left = await self.flush(timeout)
        finally:
            self._closed = True
            task, self._task = self._task, None
            if task is not None:
                await cancel_and_wait(task)
        if left:
            kinds = sorted({i.message_type for i in self._items})
            log.warning(
                "%s: %d event(s) could not be delivered before closing (%s)",
                self._name,
                left,
                ", ".join(kinds),
            )
        self._items.clear()
        self._empty.set()
        return left

    # --- plumbing -----------------------------------------------------------------------
    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name=f"events-{self._name}")

    def _drop_oldest_droppable(self) -> None:
        for item in self._items:
            if item.droppable and item is not self._in_flight:
                self._give_up(item)
                return
        # Nothing may be dropped: the buffer grows past its bound rather than lose a result.

    async def _run(self) -> None:
        delay = _BACKOFF_FIRST_S
        refusals = 0
        clock = asyncio.get_running_loop()
        while True:
            if not self._items:
                self._empty.set()
                self._wake.clear()
                await self._wake.wait()
                continue
            item = self._items[0]
            if item.max_age_s is not None and clock.time() - item.queued_at > item.max_age_s:
                self._give_up(item)
                continue
            self._in_flight = item
            try:
                await self._js.publish(
                    item.subject,
                    item.data,
                    timeout=self._publish_timeout_s,
                    headers={"Nats-Msg-Id": item.msg_id, **item.headers},
                )
            except asyncio.CancelledError:
                raise
            except APIError as exc:
                if exc.code == _UNAVAILABLE or (refusals := refusals + 1) < _REFUSALS:
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, _BACKOFF_MAX_S)
                    continue
                log.error("%s: JetStream refuses %s (%s); giving it up",
                          self._name, item.message_type, exc)  # fmt: skip
                refusals = 0
                self._give_up(item)
                continue
            except Exception as exc:
                if not _link_failed(exc):
                    # The event itself cannot be sent (e.g. larger than the server's
                    # max_payload): trying again changes nothing, and it must not hold
                    # up every later event of the job.
                    log.error(
                        "%s: cannot publish %s (%s: %s); giving it up",
                        self._name,
                        item.message_type,
                        type(exc).__name__,
                        exc,
                    )
                    self._give_up(item)
                    continue
                # Not connected, no ack in time, JetStream not ready yet: all the same to
                # a job. The event stays first in line and goes again after a pause.
                if not self._failing:
                    log.warning(
                        "%s: cannot publish %s yet (%s); buffering until the control plane is back",
                        self._name,
                        item.message_type,
                        type(exc).__name__,
                    )
                self._failing = True
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_MAX_S)
                continue
            finally:
                self._in_flight = None
            if self._failing:
                log.info("%s: the control plane is back; delivering %d buffered event(s)",
                         self._name, len(self._items) - 1)  # fmt: skip
            self._failing = False
            delay = _BACKOFF_FIRST_S
            refusals = 0
            self.sent += 1
            with contextlib.suppress(ValueError):
                self._items.remove(item)  # still first, unless dropped meanwhile
            item.delivered.set()
            item.settled.set()

    def _give_up(self, item: Outgoing) -> None:
        """Drop `item` unsent (counted in `dropped`); its sender stops waiting for it."""
        with contextlib.suppress(ValueError):
            self._items.remove(item)
        self.dropped += 1
        item.settled.set()
