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
from gpusched.infra import metrics, tracing
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected

log = logging.getLogger(__name__)

Handler = Callable[[Envelope, UnitOfWork], Awaitable[None]]
# A handler at the edge that keeps no state of its own (the cluster agent): no unit of
# work, no inbox; it must be idempotent by itself.
EdgeHandler = Callable[[Envelope], Awaitable[None]]
RequestHandler = Callable[[bytes], Awaitable[BaseModel]]


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


@dataclass
class Consumer:
    """A durable pull consumer feeding typed handlers, one message at a time.

    Messages of one consumer are applied in order; a service scales by running
    replicas on the same durable (they share the work).
    """

    durable: str
    stream: str
    subjects: Sequence[str]
    handlers: Mapping[str, Handler] = field(default_factory=dict)
    edge_handlers: Mapping[str, EdgeHandler] = field(default_factory=dict)


class DeadLetters:
    """Publishes unusable messages to `<p>.dlq.<service>` and an audit record."""

    def __init__(self, js: JetStreamContext, subjects: Subjects, service: str) -> None:
        self._js = js
        self._subjects = subjects
        self._service = service

    async def send(self, msg: Msg, consumer: str, reason: str, error: str) -> None:
        headers = {
            "Gpusched-Original-Subject": msg.subject,
            "Gpusched-Consumer": consumer,
            "Gpusched-Reason": reason,
            "Gpusched-Error": error[:500],
        }
        await self._js.publish(self._subjects.dead_letter(self._service), msg.data, headers=headers)
        record = AuditRecord(
            action="message.dead_lettered",
            actor=self._service,
            entity=msg.subject,
            reason=f"{reason}: {error}"[:1000],
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
        self._stopping = False

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
        while not self._stopping:
            try:
                msgs = await sub.fetch(self._batch, timeout=1.0)
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
                await self.process(msg)
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

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

    async def process(self, msg: Msg) -> None:
        started = time.perf_counter()
        consumer = self._c.durable
        message_type = "unknown"
        outcome = "applied"
        try:
            envelope = Envelope.from_bytes(msg.data)
            message_type = envelope.type
            handler = self._c.handlers.get(envelope.type)
            edge_handler = self._c.edge_handlers.get(envelope.type)
            if handler is None and edge_handler is None:
                # A type this consumer does not apply (e.g. a newer producer's type).
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


async def serve_requests(
    nc: NatsClient,
    subject: str,
    handler: RequestHandler,
    *,
    service: str,
    queue: str,
) -> Subscription:
    """Request/reply endpoint in a queue group (replicas share the load).

    The handler returns the reply model; it must turn bad input into an error reply
    itself. An unexpected exception still gets a reply ({ok: false, internal}).
    """

    async def on_request(msg: Msg) -> None:
        outcome = "ok"
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
        metrics.API_REQUESTS.labels(service, subject, outcome).inc()

    return await nc.subscribe(subject, queue=queue, cb=on_request)
