"""NATS/JetStream adapter: streams, durable consumers, dead letters, request/reply.

Handlers never see the broker: a consumer hands each parsed envelope and a fresh
unit of work to a handler, then acks, naks or dead-letters at the edge according to
the exception type (see infra.errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig
from nats.js.errors import NotFoundError
from pydantic import BaseModel

from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import AuditRecord, T
from gpusched.contracts.subjects import StreamSpec, Subjects
from gpusched.contracts.validation import DEFAULT_MAX_CLOCK_SKEW_S, printable, read_message
from gpusched.infra import metrics, tracing
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected

log = logging.getLogger(__name__)

Handler = Callable[[Envelope, UnitOfWork], Awaitable[None]]
# A handler at the edge that keeps no state of its own (the cluster agent): no unit of
# work, no inbox; it must be idempotent by itself.
EdgeHandler = Callable[[Envelope], Awaitable[None]]
RequestHandler = Callable[[bytes], Awaitable[BaseModel]]
# The partition key of a message: messages with the same key are applied in order.
KeyOf = Callable[[Envelope], str | None]
# Requests one endpoint handles at once (see serve_requests).
REQUEST_CONCURRENCY = 64


async def connect(url: str, name: str) -> NatsClient:
    return await nats.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
    )


async def ensure_streams(
    js: JetStreamContext, specs: Sequence[StreamSpec], *, replicas: int = 1
) -> None:
    """Create or update the streams; safe to run from every service at start."""
    for spec in specs:
        config = StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            max_age=spec.max_age_s or None,
            duplicate_window=spec.duplicate_window_s,
            num_replicas=replicas,
        )
        try:
            await js.stream_info(spec.name)
            await js.update_stream(config)
        except NotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                # Another service created it between our look-up and now.
                await js.add_stream(config)


def by_correlation(envelope: Envelope) -> str | None:
    """A partition key for consumers whose unit of order is the saga or job that the
    envelope's correlation id names."""
    return envelope.correlation_id


@dataclass
class Consumer:
    """A durable pull consumer feeding typed handlers.

    Without a `key`, messages are applied one at a time in stream order. A consumer
    whose handlers only need the order of messages that share a key (a saga, a job, an
    allocation) says so with `key`: messages with the same key are then still applied
    one at a time in stream order, while messages with different keys are applied at
    the same time, up to `concurrency` (None: the `bus.consumer_concurrency` setting).
    Messages whose key is None share one key. A service scales by running replicas on
    the same durable (they share the work, with no order between them).
    """

    durable: str
    stream: str
    subjects: Sequence[str]
    handlers: Mapping[str, Handler] = field(default_factory=dict)
    edge_handlers: Mapping[str, EdgeHandler] = field(default_factory=dict)
    key: KeyOf | None = None
    concurrency: int | None = None


class DeadLetters:
    """Publishes unusable messages to `<p>.dlq.<service>` and an audit record."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, service: str) -> None:
        self._js = js
        self._subjects = subjects
        self._service = service

    async def send(self, msg: Msg, consumer: str, reason: str, error: str) -> None:
        headers = {
            "Gpusched-Original-Subject": printable(msg.subject, 500),
            "Gpusched-Consumer": consumer,
            "Gpusched-Reason": reason,
            "Gpusched-Error": printable(error, 500),
        }
        await self._js.publish(self._subjects.dead_letter(self._service), msg.data, headers=headers)
        record = AuditRecord(
            action="message.dead_lettered",
            actor=self._service,
            # Subject and error may carry what the edge refused: escaped, bounded.
            entity=printable(msg.subject, 200),
            reason=printable(f"{reason}: {error}", 1000),
            details={"consumer": consumer, "bytes": len(msg.data)},
            time=utcnow(),
        )
        envelope = make_envelope(T.AUDIT, record, source=self._service)
        await self._js.publish(
            self._subjects.audit("message.dead_lettered"),
            envelope.to_bytes(),
            headers={"Nats-Msg-Id": envelope.id},
        )
        metrics.DEAD_LETTERS.labels(self._service, reason).inc()
        log.warning("dead-lettered message on %s (%s): %s", msg.subject, reason, error)


class ConsumerRunner:
    """Fetches a consumer's messages and applies them, `concurrency` at a time.

    Fetched messages go to one lane per key; a lane applies its messages one after
    another, so a key's messages keep their stream order while different keys overlap
    their database round trips. Fetching continues while lanes work, as long as fewer
    than `max(fetch_batch, concurrency)` fetched messages wait: a bound that keeps every
    fetched message far inside its ack wait.
    """

    def __init__(
        self,
        js: JetStreamContext,
        consumer: Consumer,
        uow_factory: UnitOfWorkFactory | None,
        dead_letters: DeadLetters,
        *,
        service: str,
        max_deliver: int,
        ack_wait_s: float,
        fetch_batch: int,
        nak_delay_s: float,
        concurrency: int = 1,
        max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    ) -> None:
        self._js = js
        self._c = consumer
        self._uow = uow_factory
        self._dlq = dead_letters
        self._service = service
        self._max_deliver = max_deliver
        self._ack_wait = ack_wait_s
        self._batch = fetch_batch
        self._nak_delay = nak_delay_s
        # Without a key nothing says which messages may overlap: one at a time.
        if consumer.key is None:
            self._concurrency = 1
        elif consumer.concurrency is not None:
            self._concurrency = consumer.concurrency
        else:
            self._concurrency = concurrency
        if self._concurrency < 1:
            raise ValueError(f"consumer {consumer.durable}: concurrency must be at least 1")
        self._stopping = False
        self._max_skew = max_clock_skew_s
        # Types outside the public registry that this consumer handles itself.
        self._own_types = frozenset((*consumer.handlers, *consumer.edge_handlers))

    @property
    def concurrency(self) -> int:
        return self._concurrency

    async def run(self) -> None:
        config = ConsumerConfig(
            durable_name=self._c.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self._ack_wait,
            # The server stops redelivering one beyond our own limit; we dead-letter
            # at max_deliver ourselves so nothing is dropped silently.
            max_deliver=self._max_deliver + 1,
            filter_subjects=list(self._c.subjects),
        )
        sub = await self._subscribe(config)
        lanes = _Lanes(self.process, self._concurrency)
        capacity = max(self._batch, self._concurrency)
        try:
            while not self._stopping:
                lanes.raise_failure()
                room = capacity - lanes.waiting
                if room <= 0:
                    await lanes.room()
                    continue
                try:
                    msgs = await sub.fetch(min(self._batch, room), timeout=1.0)
                except (NatsTimeout, TimeoutError):
                    # An idle fetch: nothing to do in the last second.
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception:
                    if self._stopping:
                        break
                    log.exception("fetch failed on %s; retrying", self._c.durable)
                    await asyncio.sleep(0.5)
                    continue
                for msg in msgs:
                    key, envelope = self._partition(msg)
                    lanes.add(key, msg, envelope)
            # Stopping: every fetched message is applied (and acked) or nak'ed by its
            # lane before the subscription goes, so none waits out its ack wait.
            await lanes.drain()
            lanes.raise_failure()
        finally:
            lanes.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    def _partition(self, msg: Msg) -> tuple[str, Envelope | None]:
        """The lane of a message, and its envelope if it parses (a malformed one goes to
        the shared lane and is dead-lettered there)."""
        if self._concurrency == 1 or self._c.key is None:
            return _ONE_LANE, None
        try:
            envelope = self._read(msg)
        except MalformedMessage:
            return _ONE_LANE, None
        try:
            key = self._c.key(envelope)
        except Exception:
            # A payload the key function cannot read: the handler will say why.
            key = None
        return (_ONE_LANE if key is None else f"k:{key}"), envelope

    async def _subscribe(self, config: ConsumerConfig) -> JetStreamContext.PullSubscription:
        try:
            # Creating a durable that exists with the same config is a no-op, so every
            # replica may do it at start.
            await self._js.add_consumer(self._c.stream, config)
        except nats.js.errors.BadRequestError as exc:
            log.warning("consumer %s exists with another config: %s", self._c.durable, exc)
        return await self._js.pull_subscribe_bind(self._c.durable, stream=self._c.stream)

    def stop(self) -> None:
        self._stopping = True

    def _read(self, msg: Msg) -> Envelope:
        """The envelope and its payload, validated once at the edge (contracts.validation)."""
        return read_message(
            msg.data,
            msg.subject,
            utcnow(),
            max_clock_skew_s=self._max_skew,
            also_known=self._own_types,
        )

    async def process(self, msg: Msg, parsed: Envelope | None = None) -> None:
        started = time.perf_counter()
        consumer = self._c.durable
        message_type = "unknown"
        outcome = "applied"
        try:
            envelope = parsed if parsed is not None else self._read(msg)
            message_type = envelope.type
            handler = self._c.handlers.get(envelope.type)
            edge_handler = self._c.edge_handlers.get(envelope.type)
            if handler is None and edge_handler is None:
                # A known type this consumer does not apply; an unknown type or a newer
                # version than this build reads was dead-lettered by `_read`.
                outcome = "ignored"
                await msg.ack()
                return
            with tracing.continued(
                f"{self._service} apply {envelope.type}",
                msg.headers,
                {
                    "messaging.message.id": envelope.id,
                    "gpusched.correlation": str(envelope.correlation_id),
                },
            ):
                if edge_handler is not None:
                    await edge_handler(envelope)
                else:
                    assert handler is not None and self._uow is not None
                    async with self._uow() as uow:
                        if await uow.claim(envelope.id, consumer):
                            await handler(envelope, uow)
                            await uow.commit()
                        else:
                            outcome = "duplicate"
            await msg.ack()
        except MalformedMessage as exc:
            outcome = "dead_lettered"
            await self._dlq.send(msg, consumer, "malformed", str(exc))
            await msg.term()
        except Rejected as exc:
            outcome = "dead_lettered"
            await self._dlq.send(msg, consumer, "rejected", str(exc))
            await msg.term()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            attempts = msg.metadata.num_delivered if msg.metadata else 1
            if attempts >= self._max_deliver:
                outcome = "dead_lettered"
                log.exception("giving up on %s after %d attempts", msg.subject, attempts)
                await self._dlq.send(msg, consumer, "failing", f"{type(exc).__name__}: {exc}")
                await msg.term()
            else:
                outcome = "retried"
                log.warning("handler failed on %s (attempt %d): %r", msg.subject, attempts, exc)
                await msg.nak(delay=self._nak_delay * attempts)
        finally:
            metrics.MESSAGES.labels(self._service, consumer, message_type, outcome).inc()
            metrics.HANDLER_SECONDS.labels(self._service, consumer).observe(
                time.perf_counter() - started
            )


# The lane of messages without a key (and of every message at concurrency 1).
_ONE_LANE = "-"

_ApplyMessage = Callable[[Msg, Envelope | None], Awaitable[None]]


class _Lanes:
    """One FIFO lane per key, each drained by its own task; at most `concurrency`
    messages are being applied at once."""

    def __init__(self, apply: _ApplyMessage, concurrency: int) -> None:
        self._apply = apply
        self._slots = asyncio.Semaphore(concurrency)
        self._queues: dict[str, deque[tuple[Msg, Envelope | None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._failure: BaseException | None = None
        self.waiting = 0  # fetched messages not yet applied

    def add(self, key: str, msg: Msg, envelope: Envelope | None) -> None:
        self.waiting += 1
        queue = self._queues.get(key)
        if queue is not None:
            # The key's lane is busy: it takes this message after the ones before it.
            queue.append((msg, envelope))
            return
        self._queues[key] = deque([(msg, envelope)])
        task = asyncio.create_task(self._drain_lane(key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain_lane(self, key: str) -> None:
        queue = self._queues[key]
        try:
            while queue:
                msg, envelope = queue[0]
                async with self._slots:
                    await self._apply(msg, envelope)
                queue.popleft()
                self.waiting -= 1
                self._room.set()
        except Exception as exc:
            # Only the ack/nak/dead letter itself can fail here (the connection is
            # gone): the runner stops and the service fails loudly, as one message at
            # a time did; unacked messages are redelivered.
            if self._failure is None:
                self._failure = exc
            self.waiting -= len(queue)
            self._room.set()
        finally:
            # No await since the lane found its queue empty: a message added for this
            # key from now on starts a new lane.
            del self._queues[key]

    async def room(self) -> None:
        """Wait until a lane finished a message (or failed)."""
        self._room.clear()
        await self._room.wait()

    def raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def cancel(self) -> None:
        for task in self._tasks:
            task.cancel()


async def serve_requests(
    nc: NatsClient,
    subject: str,
    handler: RequestHandler,
    *,
    service: str,
    queue: str,
    concurrency: int = REQUEST_CONCURRENCY,
) -> Subscription:
    """Request/reply endpoint in a queue group (replicas share the load).

    The handler returns the reply model; it must turn bad input into an error reply
    itself. An unexpected exception still gets a reply ({ok: false, internal}).

    Up to ``concurrency`` requests are handled at once (nats-py would run them one at a
    time), so a handler may group concurrent requests into one transaction. Each reply
    still leaves only after its own handler returned. When no request is waiting, the
    callback waits for those in hand: a draining subscription (shutdown) therefore
    answers every request it took before the connection closes.
    """
    slots = asyncio.Semaphore(concurrency)
    in_hand: set[asyncio.Task[None]] = set()

    async def handle(msg: Msg) -> None:
        outcome = "ok"
        try:
            with tracing.continued(f"{service} {subject}", msg.headers):
                try:
                    reply = await handler(msg.data)
                    body = reply.model_dump_json().encode()
                except Exception as exc:
                    outcome = "internal_error"
                    log.exception("request handler failed on %s", subject)
                    body = json.dumps(
                        {"ok": False, "error": {"code": "internal", "message": str(exc)[:500]}}
                    ).encode()
                if msg.reply:
                    await msg.respond(body)
        except Exception:
            # Only the reply itself failed (the connection is closing): the client's
            # request times out and it retries; nothing else depends on this task.
            log.exception("could not answer a request on %s", subject)
        finally:
            slots.release()
            metrics.API_REQUESTS.labels(service, subject, outcome).inc()

    async def on_request(msg: Msg) -> None:
        await slots.acquire()
        task = asyncio.create_task(handle(msg))
        in_hand.add(task)
        task.add_done_callback(in_hand.discard)
        if sub.pending_msgs == 0 and in_hand:
            await asyncio.wait(set(in_hand))

    sub = await nc.subscribe(subject, queue=queue, cb=on_request)
    return sub
