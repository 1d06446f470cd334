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
import ssl
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StreamConfig, SubjectTransform
from nats.js.errors import NotFoundError
from pydantic import BaseModel

from gpusched.contracts import identity
from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import AuditRecord, T
from gpusched.contracts.subjects import StreamSpec, Subjects
from gpusched.contracts.validation import DEFAULT_MAX_CLOCK_SKEW_S, printable, read_message
from gpusched.infra import metrics, natsauth, tracing
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected, is_outage
from gpusched.infra.outages import Outage, describe
from gpusched.infra.tls import server_name
from gpusched.infra.watchdog import FLUSH_TIMEOUT_S, ConnectionWatchdog

log = logging.getLogger(__name__)

Handler = Callable[[Envelope, UnitOfWork], Awaitable[None]]
# A handler at the edge that keeps no state of its own (the cluster agent): no unit of
# work, no inbox; it must be idempotent by itself.
EdgeHandler = Callable[[Envelope], Awaitable[None]]
RequestHandler = Callable[[bytes], Awaitable[BaseModel]]
# The partition key of a message: messages with the same key are applied in order.
KeyOf = Callable[[Envelope], str | None]
# Called once for a batch sharing one transaction, before its handlers (Consumer.prepare).
Prepare = Callable[[Sequence[Envelope], UnitOfWork], Awaitable[None]]
# Requests one endpoint handles at once (see serve_requests).
REQUEST_CONCURRENCY = 64
# Bound of one JetStream publish that waits for its ack (a dead letter, its audit record).
PUBLISH_TIMEOUT_S = 5.0
# Bound of an ack, nak, term or in-progress: they only queue a frame for the socket.
SETTLE_TIMEOUT_S = 2.0
# What an endpoint answers while PostgreSQL or NATS is unreachable.
UNAVAILABLE_MESSAGE = (
    "a server the service depends on is unreachable right now; try again in a few seconds"
)


# A server that went silent (its process frozen, its host gone without a FIN) is
# noticed after PING_INTERVAL_S x MAX_OUTSTANDING_PINGS (infra.watchdog for the rest).
PING_INTERVAL_S: Final = 10.0
MAX_OUTSTANDING_PINGS: Final = 3


async def connect(
    url: str,
    name: str,
    credentials: Path | None = None,
    *,
    tls: ssl.SSLContext | None = None,
    ping_interval_s: float = PING_INTERVAL_S,
) -> NatsClient:
    """A NATS connection that reconnects forever (nats-py does it by itself) and says
    so in one log line when it drops and one when it is back. `credentials`: the
    process's `.creds` file (its identity; the server enforces its permissions). `tls`
    (infra.tls) is the context of a server that requires TLS (or a tls:// URL).

    While it is away, publishes queue in a bounded buffer (`pending_size`) and are sent
    on reconnect; a full buffer raises OutboundBufferLimitError, an outage. A server
    that stops answering without closing the connection is noticed within
    `ping_interval_s` x 3, and then reconnected to like one that went away (never a
    wait without end: see infra.watchdog)."""
    logger = logging.getLogger(f"{__name__}.connection")
    watchdog = ConnectionWatchdog(name, logger)

    async def on_error(exc: Exception) -> None:
        # Called for every failed reconnect attempt too: those are the outage itself,
        # already logged once by the disconnect.
        if is_outage(exc):
            logger.debug("%s: NATS connection error: %s", name, describe(exc))
        else:
            logger.warning("%s: NATS connection error: %s", name, describe(exc))

    async def on_disconnected() -> None:
        if not (nc.is_closed or nc.is_draining):  # not our own shutdown
            logger.warning("%s: lost the NATS connection; reconnecting", name)

    async def on_reconnected() -> None:
        logger.warning("%s: reconnected to NATS", name)

    async def on_closed() -> None:
        watchdog.stop()

    nc = NatsClient()
    await nc.connect(
        url,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; a float works
        connect_timeout=5,
        # A half-open connection (server host gone without a FIN) is noticed in ~30 s.
        ping_interval=ping_interval_s,  # type: ignore[arg-type]  # seconds; a float works
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        pending_size=16 * 1024 * 1024,
        flush_timeout=FLUSH_TIMEOUT_S,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        closed_cb=on_closed,
        **natsauth.connect_options(credentials),  # type: ignore[arg-type]
        tls=tls,
        tls_hostname=server_name(tls),
    )
    watchdog.start(nc)
    return nc


# JetStream's answers when it cannot keep the replicas asked: a server outside a cluster
# (replicas > 1 not supported in non-clustered mode), too few servers in the cluster for
# the replicas (no suitable peers for placement), or too few resources left on them.
_REPLICAS_REFUSED: Final = frozenset({10074, 10005, 10023})


class StreamReplicasRefused(RuntimeError):
    """NATS cannot keep a stream with as many replicas as GPUSCHED_BUS__STREAM_REPLICAS."""


async def ensure_streams(
    js: JetStreamContext, specs: Sequence[StreamSpec], *, replicas: int = 1
) -> None:
    """Create or update the streams; safe to run from every service at start.

    A stream that exists as specified is only looked at: the services may read stream
    info but only the installer (`gpusched up`/`migrate`) may create or change a stream,
    so a service never needs the permission unless the streams are missing or stale.
    `replicas`: each stream's replica count on a NATS cluster (3 keeps every message
    through the loss of one server); StreamReplicasRefused when NATS cannot keep them."""
    try:
        await _ensure_streams(js, specs, replicas)
    except nats.js.errors.APIError as exc:
        if exc.err_code not in _REPLICAS_REFUSED or replicas == 1:
            raise
        raise StreamReplicasRefused(
            f"NATS cannot keep {replicas} replicas of each stream ({exc.description}): set "
            "GPUSCHED_BUS__STREAM_REPLICAS to at most the number of JetStream servers in "
            "the NATS cluster (1 for a single server)"
        ) from None


async def _ensure_streams(js: JetStreamContext, specs: Sequence[StreamSpec], replicas: int) -> None:
    for spec in specs:
        transform = None if spec.transform is None else SubjectTransform(*spec.transform)
        config = StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            max_age=spec.max_age_s or None,
            duplicate_window=spec.duplicate_window_s,
            num_replicas=replicas,
            subject_transform=transform,
        )
        try:
            info = await js.stream_info(spec.name)
            have = info.config
            had = have.subject_transform
            if (
                sorted(have.subjects or []) == sorted(spec.subjects)
                and (have.max_age or None) == config.max_age
                and have.duplicate_window == config.duplicate_window
                and (have.num_replicas or 1) == replicas
                and (None if had is None else (had.src, had.dest)) == spec.transform
            ):
                continue
            await js.update_stream(config)
        except NotFoundError:
            with contextlib.suppress(nats.js.errors.BadRequestError):
                # Another service created it between our look-up and now.
                await js.add_stream(config)


class PullFeed:
    """An ack-free pull consumer read as a stream of batches (the telemetry fold).

    nats-py's `fetch` waits for each message of a batch with a task and a timer of its
    own: more than an ingest replica spends folding the message. Here the pull requests
    are plain publishes whose replies land in one subscription callback that only
    appends; `next_batch` hands over whatever arrived. Up to two requests of `batch`
    are outstanding, so the server always has one to fill while a batch is folded;
    without acks nothing is redelivered, so the only bound needed is on what waits
    here (at most two batches, as nats-py's own client-side limits would be).

    A request ends when the server delivered its `batch`, answered with a status
    (expired, no messages, consumer deleted: the status says why), or, lost with a
    dropped connection, `expires_s` plus a second after it was sent.
    """

    def __init__(
        self,
        nc: NatsClient,
        stream: str,
        consumer: str,
        *,
        batch: int,
        expires_s: float = 5.0,
    ) -> None:
        self._nc = nc
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._batch = batch
        self._expires_s = expires_s
        self._request = json.dumps({"batch": batch, "expires": int(expires_s * 1e9)}).encode()
        self._inbox = ""
        self._sub: Subscription | None = None
        self._arrived: list[Msg] = []
        self._wake = asyncio.Event()
        # Outstanding requests, oldest first (the server fills them in that order):
        # [messages still due, when it is surely over].
        self._open: deque[list[float]] = deque()
        self.problem: str | None = None  # a status that says the consumer is gone

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._on_message)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._sub.unsubscribe(), SETTLE_TIMEOUT_S)
            self._sub = None

    async def _on_message(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self._arrived.append(msg)
            if self._open:
                head = self._open[0]
                head[0] -= 1
                if head[0] <= 0:
                    self._open.popleft()
        elif status != "100":  # not a heartbeat: the oldest request is over
            if self._open:
                self._open.popleft()
            if status not in ("404", "408"):
                description = msg.headers.get("Description", "") if msg.headers else ""
                self.problem = f"{status} {description}".strip()
        self._wake.set()

    async def _ask(self) -> None:
        now = time.monotonic()
        while self._open and self._open[0][1] < now:
            self._open.popleft()  # lost (a dropped connection): it will never answer
        # Two requests in flight at most, and never more than two batches waiting here.
        while len(self._open) < 2 and (
            len(self._arrived) + sum(due for due, _ in self._open) + self._batch <= 2 * self._batch
        ):
            self._open.append([self._batch, now + self._expires_s + 1.0])
            await self._nc.publish(self._next_subject, self._request, reply=self._inbox)

    async def next_batch(self, wait_s: float) -> list[Msg]:
        """What arrived since the last call, waiting up to `wait_s` for something.
        Raises TimeoutError if nothing came, ConsumerGone if the server says the
        consumer is no more."""
        deadline = time.monotonic() + wait_s
        while not self._arrived:
            if self.problem is not None:
                raise ConsumerGone(self.problem)
            await self._ask()
            self._wake.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("no message")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), remaining)
        batch, self._arrived = self._arrived, []
        await self._ask()
        return batch


class ConsumerGone(Exception):
    """The server answered a pull request with a status that is not about timing (the
    consumer was deleted, or the request broke one of its limits)."""


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

    With a key, `batch` > 1 lets messages of different keys that are waiting at the
    same time share one transaction, up to `batch` of them: each still has its inbox
    row, and its effects commit with it. A batch that fails in any way is rolled back
    and its messages are applied one by one, so every outcome (dead letter, retry,
    outage) is decided for each message exactly as without a batch. Only messages
    that arrive together or wait for a busy consumer are batched: one arriving at an
    idle consumer is applied at once, alone.
    """

    durable: str
    stream: str
    subjects: Sequence[str]
    handlers: Mapping[str, Handler] = field(default_factory=dict)
    edge_handlers: Mapping[str, EdgeHandler] = field(default_factory=dict)
    key: KeyOf | None = None
    concurrency: int | None = None
    batch: int = 1
    # With `batch` > 1: called with the envelopes a shared transaction is about to apply
    # (in stream order, duplicates left out), in that transaction, before their handlers,
    # so that what they will read can be read for all of them at once (a round trip per
    # batch, not per message). A hook that raises fails the batch like a handler does:
    # everything rolls back and each message is applied alone, without the hook.
    prepare: Prepare | None = None


def _first_copies(
    items: Sequence[tuple[Msg, Envelope | None]], unclaimed: set[str]
) -> list[Envelope]:
    """The envelopes of a batch its handlers will apply: those not applied before, each
    id once, in order."""
    seen: set[str] = set()
    first: list[Envelope] = []
    for _, envelope in items:
        if envelope is not None and envelope.id in unclaimed and envelope.id not in seen:
            seen.add(envelope.id)
            first.append(envelope)
    return first


class DeadLetters:
    """Publishes unusable messages to `<p>.dlq.<service>` and an audit record.

    Each publish waits at most `PUBLISH_TIMEOUT_S` for its ack and raises an outage if
    NATS does not answer; the caller retries. Both publishes carry a Nats-Msg-Id made
    from the consumer and the message's stream sequence, so a retry, or the redelivery
    of a message whose term was lost, is stored once.
    """

    def __init__(self, js: JetStreamContext, subjects: Subjects, service: str) -> None:
        self._js = js
        self._subjects = subjects
        self._service = service

    async def send(
        self, msg: Msg, consumer: str, reason: str, error: str, *, subject: str | None = None
    ) -> None:
        """`subject`: the subject the message was published on, where the stream stores
        it under another (a subject transform); `msg.subject` otherwise."""
        subject = msg.subject if subject is None else subject
        headers = {
            "Gpusched-Original-Subject": printable(subject, 500),
            "Gpusched-Consumer": consumer,
            "Gpusched-Reason": reason,
            "Gpusched-Error": printable(error, 500),
        }
        dedup_id = _dead_letter_id(msg, self._service, consumer)
        if dedup_id is not None:
            headers["Nats-Msg-Id"] = dedup_id
        await self._js.publish(
            self._subjects.dead_letter(self._service),
            msg.data,
            headers=headers,
            timeout=PUBLISH_TIMEOUT_S,
        )
        record = AuditRecord(
            action="message.dead_lettered",
            actor=self._service,
            # Subject and error may carry what the edge refused: escaped, bounded.
            entity=printable(subject, 200),
            reason=printable(f"{reason}: {error}", 1000),
            details={"consumer": consumer, "bytes": len(msg.data)},
            time=utcnow(),
        )
        envelope = make_envelope(
            T.AUDIT,
            record,
            source=self._service,
            envelope_id=None if dedup_id is None else str(uuid.uuid5(uuid.NAMESPACE_URL, dedup_id)),
        )
        await self._js.publish(
            self._subjects.audit("message.dead_lettered"),
            envelope.to_bytes(),
            headers={"Nats-Msg-Id": envelope.id},
            timeout=PUBLISH_TIMEOUT_S,
        )
        metrics.DEAD_LETTERS.labels(self._service, reason).inc()
        log.warning("dead-lettered message on %s (%s): %s", subject, reason, error)


def _dead_letter_id(msg: Msg, service: str, consumer: str) -> str | None:
    """The same id for every delivery of one stream message to one consumer."""
    try:
        sequence = msg.metadata.sequence.stream
    except Exception:
        return None  # not a JetStream message (a test's plain publish)
    return f"dlq-{service}-{consumer}-{sequence}"


class ConsumerRunner:
    """Fetches a consumer's messages and applies them, `concurrency` at a time.

    Fetched messages go to one lane per key; a lane applies its messages one after
    another, so a key's messages keep their stream order while different keys overlap
    their database round trips. Fetching continues while lanes work, as long as fewer
    than `max(fetch_batch, concurrency)` fetched messages wait: a bound that keeps every
    fetched message far inside its ack wait.

    An outage (`errors.is_outage`) is not the message's fault: the message stays in
    hand (its ack wait kept fresh with in-progress acks), fetching pauses, and the same
    message is applied again after a backoff until it succeeds or fails for a reason of
    its own. Only such failures spend the message's `max_deliver` budget.
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
        if consumer.batch < 1:
            raise ValueError(f"consumer {consumer.durable}: batch must be at least 1")
        # Batches need keys (the order they keep) and a unit of work to share.
        self._batch_max = consumer.batch if consumer.key is not None and uow_factory else 1
        self._stopping = False
        self._stopped = asyncio.Event()
        self._outage = Outage(log, service, f"consumer {consumer.durable}")
        self._max_skew = max_clock_skew_s
        # Types outside the public registry that this consumer handles itself.
        self._own_types = frozenset((*consumer.handlers, *consumer.edge_handlers))
        # What readiness reads (runtime): subscribed, and when the fetch loop last turned.
        self.subscribed = False
        self.last_turn = time.monotonic()

    @property
    def concurrency(self) -> int:
        return self._concurrency

    @property
    def durable(self) -> str:
        return self._c.durable

    @property
    def waiting_out_outage(self) -> bool:
        return self._outage.active

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
        sub = await self._subscribe_when_reachable(config)
        if sub is None:
            return  # stopped before NATS answered
        self.subscribed = True
        lanes: _Lanes | _BatchLanes
        if self._batch_max > 1:
            lanes = _BatchLanes(self._apply_batch, self._concurrency, self._batch_max)
        else:
            lanes = _Lanes(self._apply, self._concurrency)
        heartbeat = asyncio.create_task(self._keep_in_hand(lanes))
        fetching = Outage(log, self._service, f"consumer {self._c.durable} fetch")
        capacity = max(self._batch, self._concurrency)
        try:
            while not self._stopping:
                self.last_turn = time.monotonic()
                if self._outage.active:
                    # Messages in hand wait for a server: fetch no more until it is back.
                    await _first_of(self._outage.over(), self._stopped.wait())
                    continue
                room = capacity - lanes.waiting
                if room <= 0:
                    await _first_of(lanes.room(), self._stopped.wait())
                    continue
                try:
                    msgs = await sub.fetch(min(self._batch, room), timeout=1.0)
                except (NatsTimeout, TimeoutError):
                    # An idle fetch (or NATS away: nats-py reconnects meanwhile).
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if self._stopping:
                        break
                    if is_outage(exc):
                        fetching.begin(exc)
                    else:
                        # E.g. the consumer is gone (a NATS restart without its store).
                        log.warning(
                            "fetch failed on %s: %s; subscribing again",
                            self._c.durable,
                            describe(exc),
                        )
                        with contextlib.suppress(Exception):
                            sub = await self._subscribe(config)
                    await fetching.backoff(self._stopped)
                    continue
                fetching.end()
                for msg in msgs:
                    key, envelope = self._partition(msg)
                    lanes.add(key, msg, envelope)
            # Stopping: every fetched message is applied (and acked) or left for
            # redelivery by its lane before the subscription goes.
            await lanes.drain()
        finally:
            heartbeat.cancel()
            lanes.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sub.unsubscribe(), SETTLE_TIMEOUT_S)

    async def _subscribe_when_reachable(
        self, config: ConsumerConfig
    ) -> JetStreamContext.PullSubscription | None:
        waiting = Outage(log, self._service, f"consumer {self._c.durable} subscribe")
        while not self._stopping:
            try:
                sub = await self._subscribe(config)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_outage(exc):
                    raise
                waiting.begin(exc)
                await waiting.backoff(self._stopped)
                continue
            waiting.end()
            return sub
        return None

    async def _apply(self, msg: Msg, parsed: Envelope | None) -> None:
        """Apply one message until it is settled; an outage keeps it in hand."""
        while await self.process(msg, parsed) is False:
            if self._stopping:
                # Left unacked: redelivered after its ack wait, and the inbox makes a
                # second application harmless.
                return
            await self._outage.backoff(self._stopped)
        self._outage.end()

    async def _apply_batch(self, items: list[tuple[Msg, Envelope | None]]) -> None:
        """Apply messages of different keys in one transaction when they can share one;
        on any failure, roll back and apply each alone (`_apply`)."""
        shared = [item for item in items if self._shares_transaction(item[1])]
        alone = [item for item in items if not self._shares_transaction(item[1])]
        if len(shared) > 1 and not self._stopping:
            try:
                await self._process_together(shared)
                shared = []
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Nothing of the batch committed: each message now meets its own fate.
                log.debug(
                    "a batch of %d on %s failed (%r); applying one by one",
                    len(shared),
                    self._c.durable,
                    exc,
                )
        for msg, envelope in (*shared, *alone):
            await self._apply(msg, envelope)

    def _shares_transaction(self, envelope: Envelope | None) -> bool:
        # Parsed, and for a handler with a unit of work (not an edge one, not ignored).
        return (
            envelope is not None
            and envelope.type in self._c.handlers
            and envelope.type not in self._c.edge_handlers
        )

    async def _process_together(self, items: list[tuple[Msg, Envelope | None]]) -> None:
        """Apply `items` in one unit of work and ack them all; raises (with nothing
        committed) if any of them fails."""
        assert self._uow is not None
        started = time.perf_counter()
        consumer = self._c.durable
        outcomes: list[str] = []
        async with self._uow() as uow:
            # One inbox statement for the whole batch (a round trip per message before).
            unclaimed = await uow.claim_many(
                [envelope.id for _, envelope in items if envelope is not None], consumer
            )
            if self._c.prepare is not None:
                await self._c.prepare(_first_copies(items, unclaimed), uow)
            for msg, envelope in items:
                assert envelope is not None
                with tracing.processing(
                    self._service,
                    msg.subject,
                    msg.headers,
                    message_id=envelope.id,
                    conversation_id=envelope.correlation_id,
                    consumer=consumer,
                    message_type=envelope.type,
                ):
                    if envelope.id in unclaimed:
                        unclaimed.discard(envelope.id)  # a second copy in the batch: a duplicate
                        await self._c.handlers[envelope.type](envelope, uow)
                        outcomes.append("applied")
                    else:
                        outcomes.append("duplicate")
            await uow.commit()
        # Committed: an ack that does not arrive only means a redelivery, which the
        # inbox makes harmless.
        each = (time.perf_counter() - started) / len(items)
        for (msg, envelope), outcome in zip(items, outcomes, strict=True):
            try:
                await msg.ack()  # only queues a frame (as in `process`)
            except Exception as exc:
                log.warning("could not ack a message on %s: %s", msg.subject, describe(exc))
            assert envelope is not None
            metrics.MESSAGES.labels(self._service, consumer, envelope.type, outcome).inc()
            metrics.HANDLER_SECONDS.labels(self._service, consumer).observe(each)

    async def _keep_in_hand(self, lanes: _Lanes | _BatchLanes) -> None:
        """In-progress acks for every message fetched and not yet settled, so JetStream
        does not redeliver (and count) a message that waits out an outage in a lane."""
        interval = max(0.5, self._ack_wait / 4)
        while True:
            await asyncio.sleep(interval)
            for msg in lanes.held():
                # Best effort: with NATS away it fails, and the message may be
                # redelivered later, which the inbox makes harmless.
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(msg.in_progress(), SETTLE_TIMEOUT_S)

    def _partition(self, msg: Msg) -> tuple[str, Envelope | None]:
        """The lane of a message, and its envelope if it parses (a malformed one goes to
        the shared lane and is dead-lettered there)."""
        if (self._concurrency == 1 and self._batch_max == 1) or self._c.key is None:
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
        self._stopped.set()

    def _read(self, msg: Msg) -> Envelope:
        """The envelope and its payload, validated once at the edge (contracts.validation)."""
        return read_message(
            msg.data,
            msg.subject,
            utcnow(),
            max_clock_skew_s=self._max_skew,
            also_known=self._own_types,
        )

    async def process(self, msg: Msg, parsed: Envelope | None = None) -> bool:
        """Apply `msg` once and settle it (ack, nak, or dead letter and term).

        False when an outage stopped it: the message is still in hand, unsettled, for
        the caller to apply again once the server is back."""
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
                return True
            with tracing.processing(
                self._service,
                msg.subject,
                msg.headers,
                message_id=envelope.id,
                conversation_id=envelope.correlation_id,
                consumer=consumer,
                message_type=envelope.type,
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
            return await self._dead_letter(msg, consumer, "malformed", str(exc))
        except Rejected as exc:
            outcome = "dead_lettered"
            return await self._dead_letter(msg, consumer, "rejected", str(exc))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if is_outage(exc):
                # Not this message's fault: it stays in hand and is applied again (the
                # rolled-back attempt left nothing; an applied one is now in the inbox).
                outcome = "outage"
                self._outage.begin(exc)
                return False
            attempts = msg.metadata.num_delivered if msg.metadata else 1
            if attempts >= self._max_deliver:
                outcome = "dead_lettered"
                log.error("giving up on %s after %d attempts", msg.subject, attempts, exc_info=exc)
                return await self._dead_letter(
                    msg, consumer, "failing", f"{type(exc).__name__}: {exc}"
                )
            outcome = "retried"
            log.warning("handler failed on %s (attempt %d): %r", msg.subject, attempts, exc)
            await _settle(msg.nak(delay=self._nak_delay * attempts), msg, "nak")
        finally:
            metrics.MESSAGES.labels(self._service, consumer, message_type, outcome).inc()
            metrics.HANDLER_SECONDS.labels(self._service, consumer).observe(
                time.perf_counter() - started
            )
        return True

    async def _dead_letter(self, msg: Msg, consumer: str, reason: str, error: str) -> bool:
        """Dead-letter and terminate `msg`; False (still in hand) if NATS is away."""
        try:
            await self._dlq.send(msg, consumer, reason, error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if is_outage(exc):
                self._outage.begin(exc)
                return False
            # The dead-letter stream refuses it (e.g. too large): say so loudly rather
            # than block the consumer behind it forever.
            log.error(
                "could not dead-letter a message on %s (%s: %s)",
                msg.subject,
                reason,
                error,
                exc_info=exc,
            )
        await _settle(msg.term(), msg, "term")
        return True


# The lane of messages without a key (and of every message at concurrency 1).
_ONE_LANE = "-"

_ApplyMessage = Callable[[Msg, Envelope | None], Awaitable[None]]


async def _settle(action: Awaitable[None], msg: Msg, what: str) -> None:
    """An ack/nak/term that cannot fail the service: if the connection dropped, the
    message is redelivered after its ack wait and the inbox makes that harmless."""
    try:
        await asyncio.wait_for(action, SETTLE_TIMEOUT_S)
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        log.warning("could not %s a message on %s: %s", what, msg.subject, describe(exc))


async def _first_of(*waits: Awaitable[object]) -> None:
    """Wait until the first of `waits` is done; cancel the others."""
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


class _InHand:
    """What both kinds of lanes share: the fetched messages per key, the tasks applying
    them, and the event a finished message sets."""

    _queues: dict[str, deque[tuple[Msg, Envelope | None]]]
    _tasks: set[asyncio.Task[None]]
    _room: asyncio.Event

    async def room(self) -> None:
        """Wait until a message was finished."""
        self._room.clear()
        await self._room.wait()

    def held(self) -> list[Msg]:
        """Every fetched message not yet settled."""
        return [msg for queue in self._queues.values() for msg, _ in queue]

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.wait(set(self._tasks))

    def cancel(self) -> None:
        # Cancelled: the messages still in hand are redelivered after their ack wait.
        for task in self._tasks:
            task.cancel()


class _Lanes(_InHand):
    """One FIFO lane per key, each drained by its own task; at most `concurrency`
    messages are being applied at once. A message that cannot be applied never stops
    its lane or the runner: it is left for redelivery."""

    def __init__(self, apply: _ApplyMessage, concurrency: int) -> None:
        self._apply = apply
        self._slots = asyncio.Semaphore(concurrency)
        self._queues: dict[str, deque[tuple[Msg, Envelope | None]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
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
                try:
                    async with self._slots:
                        await self._apply(msg, envelope)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    # Applying settles every outcome itself; whatever still escapes
                    # (a bug) costs this message a redelivery, never the service.
                    log.error("could not apply a message on %s", msg.subject, exc_info=exc)
                queue.popleft()
                self.waiting -= 1
                self._room.set()
        finally:
            # No await since the lane found its queue empty: a message added for this
            # key from now on starts a new lane. (Cancelled: the rest are redelivered.)
            self.waiting -= len(queue)
            del self._queues[key]


_ApplyBatch = Callable[[list[tuple[Msg, Envelope | None]]], Awaitable[None]]


class _BatchLanes(_InHand):
    """`_Lanes` whose workers take the head messages of up to `batch` waiting lanes at
    a time: each key's messages still go one after another, in stream order, while up
    to `concurrency` batches of different keys are applied at once. Messages that
    arrive together, or while every worker is busy, share a batch; a lone message at an
    idle consumer is applied at once, alone."""

    def __init__(self, apply: _ApplyBatch, concurrency: int, batch: int) -> None:
        self._apply = apply
        self._concurrency = concurrency
        self._batch = batch
        self._queues: dict[str, deque[tuple[Msg, Envelope | None]]] = {}
        # Keys with a message waiting and none being applied, in the order they became so.
        self._ready: deque[str] = deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self.waiting = 0  # fetched messages not yet applied

    def add(self, key: str, msg: Msg, envelope: Envelope | None) -> None:
        self.waiting += 1
        queue = self._queues.get(key)
        if queue is not None:
            queue.append((msg, envelope))  # after the ones before it (ready or in hand)
            return
        self._queues[key] = deque([(msg, envelope)])
        self._ready.append(key)
        if len(self._tasks) < self._concurrency:
            task = asyncio.create_task(self._work())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _work(self) -> None:
        while self._ready:
            keys = [self._ready.popleft() for _ in range(min(self._batch, len(self._ready)))]
            try:
                await self._apply([self._queues[key][0] for key in keys])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Applying settles every outcome itself; whatever still escapes (a bug)
                # costs these messages a redelivery, never the service.
                log.error("could not apply a batch of %d messages", len(keys), exc_info=exc)
            for key in keys:
                queue = self._queues[key]
                queue.popleft()
                self.waiting -= 1
                if queue:
                    self._ready.append(key)
                else:
                    del self._queues[key]
            self._room.set()


async def serve_requests(
    nc: NatsClient,
    subject: str,
    handler: RequestHandler,
    *,
    service: str,
    queue: str,
    concurrency: int = REQUEST_CONCURRENCY,
    clients_account: str | None = None,
) -> Subscription:
    """Request/reply endpoint in a queue group (replicas share the load).

    The handler returns the reply model; it must turn bad input into an error reply
    itself. An outage (PostgreSQL or NATS unreachable; every wait under the handler is
    bounded) gets {ok: false, unavailable, "try again in a few seconds"}, logged once
    per outage; any other exception still gets a reply ({ok: false, internal}).

    Up to ``concurrency`` requests are handled at once (nats-py would run them one at a
    time), so a handler may group concurrent requests into one transaction. Each reply
    still leaves only after its own handler returned. The handler finds who asks in
    identity.current_caller (from the server's Nats-Request-Info header; see
    contracts.identity). When no request is waiting, the
    callback waits for those in hand: a draining subscription (shutdown) therefore
    answers every request it took before the connection closes.
    """
    slots = asyncio.Semaphore(concurrency)
    in_hand: set[asyncio.Task[None]] = set()
    outage = Outage(log, service, f"endpoint {subject}")

    async def handle(msg: Msg) -> None:
        outcome = "ok"
        identity.current_caller.set(identity.caller_from_headers(msg.headers, clients_account))
        try:
            with tracing.serving(service, subject, msg.headers):
                try:
                    reply = await handler(msg.data)
                    body = reply.model_dump_json().encode()
                    outage.end()
                except Exception as exc:
                    if is_outage(exc):
                        outcome = "unavailable"
                        outage.begin(exc)
                        error = {"code": "unavailable", "message": UNAVAILABLE_MESSAGE}
                    else:
                        outcome = "internal_error"
                        log.exception("request handler failed on %s", subject)
                        error = {"code": "internal", "message": str(exc)[:500]}
                    body = json.dumps({"ok": False, "error": error}).encode()
                if msg.reply:
                    await asyncio.wait_for(msg.respond(body), SETTLE_TIMEOUT_S)
        except Exception as exc:
            # Only the reply itself failed (the connection dropped or is closing): the
            # client's request times out and it retries; nothing else depends on this.
            log.warning("could not answer a request on %s: %s", subject, describe(exc))
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
