"""The outbox relay: publishes committed outbox rows to JetStream.

- Nats-Msg-Id = row id (the envelope id), so a row published twice (relay crash
  between the publish and the delete) is de-duplicated by the server.
- Woken by LISTEN/NOTIFY on commit, with a polling fallback for a missed NOTIFY.
- Rows are claimed with FOR UPDATE SKIP LOCKED, so several relays (replicas) never
  publish the same row at the same time and never block each other.
- Acks are pipelined: a whole batch is published before any ack is awaited.
- Nothing waits unbounded: a batch not published and acked within `ACK_TIMEOUT_S`
  (acks lost, or the client's pending-ack slots full) is rolled back
  (it is published again later, de-duplicated by Nats-Msg-Id); a lost PostgreSQL or
  LISTEN connection is opened again, with backoff, logging one warning per outage.
- `gpusched_outbox_oldest_unpublished_seconds` is the age of the oldest row still
  waiting (0 when empty), refreshed every poll: it rises during any outage, unlike the
  commit-to-publish histogram that only sees rows once they are published.
- A row NATS refuses for what it is (over the server's max_payload, a subject no
  stream takes) would fail every batch it is in, and every row behind it would wait:
  after a batch fails so, the rows are published one at a time, and each one refused
  on its own is moved to `outbox_parked` (logged, counted in
  `gpusched_outbox_parked_total`, audited as `outbox.parked`); the rest go on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import asyncpg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import TooManyStalledMsgsError

from gpusched.contracts.envelope import make_envelope, utcnow
from gpusched.contracts.messages import AuditRecord, T
from gpusched.contracts.subjects import Subjects, check_token
from gpusched.contracts.validation import printable
from gpusched.infra import metrics
from gpusched.infra.db import asyncpg_dsn, notify_channel
from gpusched.infra.errors import Unavailable, is_outage
from gpusched.infra.outages import Outage

log = logging.getLogger(__name__)

# How long a batch waits for its publish acks before it is rolled back and retried.
ACK_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
QUERY_TIMEOUT_S = 30.0
# Publishes between two turns of the event loop within a batch.
YIELD_EVERY = 100


@dataclass(frozen=True)
class RelayStats:
    published: int
    batches: int


class OutboxRelay:
    def __init__(
        self,
        js: JetStreamContext,
        database_url: str,
        schema: str,
        *,
        service: str,
        batch: int = 1000,
        poll_interval_s: float = 0.5,
        nats_connected: Callable[[], bool] | None = None,
        tls: ssl.SSLContext | None = None,
        subjects: Subjects | None = None,
    ) -> None:
        self._js = js
        # While NATS is away, publishing would only pile copies of the batch into the
        # client's reconnect buffer (and hold the rows' locks for the ack timeout).
        self._nats_connected = nats_connected
        self._dsn = asyncpg_dsn(database_url)
        self._tls = tls
        self._schema = check_token(schema, "schema")
        self._service = service
        self._batch = batch
        self._poll = poll_interval_s
        self._wake = asyncio.Event()
        self._stopping = False
        self._conn: asyncpg.Connection | None = None
        self._listener: asyncpg.Connection | None = None
        self.published = 0
        self.batches = 0
        self._outage = Outage(log, service, f"outbox relay {self._schema}")
        self._stopped = asyncio.Event()
        self._backlog_checked = 0.0  # monotonic time of the last gauge refresh
        # Where `outbox.parked` audit records go.
        self._subjects = Subjects() if subjects is None else subjects
        self._park_sql = (
            f"INSERT INTO {self._schema}.outbox_parked "
            f"(seq, id, subject, payload, headers, created_at, error) "
            f"VALUES ($1, $2, $3, $4, $5::jsonb, to_timestamp($6), $7) "
            f"ON CONFLICT (seq) DO NOTHING"
        )
        self._backlog_sql = (
            f"SELECT count(*), COALESCE(extract(epoch from now() - ("
            f"SELECT created_at FROM {self._schema}.outbox ORDER BY seq LIMIT 1)), 0)::float8 "
            f"FROM {self._schema}.outbox"
        )
        # Claim and delete in one statement: the rows stay locked (and deleted) only
        # inside this transaction, so a failed ack rolls them back for the next try.
        # `= ANY(ARRAY(...))`, not `IN (...)`: IN plans a hash join over a seq scan of
        # the whole backlog per batch; ANY is an index scan. Epoch as float8: asyncpg
        # would decode numeric into a Decimal per row.
        self._claim_sql = (
            f"DELETE FROM {self._schema}.outbox WHERE seq = ANY(ARRAY("
            f"SELECT seq FROM {self._schema}.outbox ORDER BY seq LIMIT $1 "
            f"FOR UPDATE SKIP LOCKED)) "
            f"RETURNING seq, id, subject, payload, headers, "
            f"extract(epoch from created_at)::float8 AS created"
        )

    async def run(self) -> None:
        """Relay until `stop()`; waits out PostgreSQL and NATS outages (one warning
        each), opening lost connections again."""
        while not self._stopping:
            try:
                await self._connect()
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._stopping:
                    break
                if is_outage(exc) or isinstance(exc, TooManyStalledMsgsError):
                    self._outage.begin(exc)
                else:
                    log.warning(
                        "outbox relay for %s: a batch failed (%r); publishing its rows one "
                        "at a time to set aside the one NATS refuses",
                        self._schema,
                        exc,
                    )
                    try:
                        await self._isolate(self._batch)
                        continue  # every row of the batch published or set aside
                    except Exception as isolating:
                        if is_outage(isolating):
                            self._outage.begin(isolating)
                        else:
                            log.exception("outbox relay for %s failed; retrying", self._schema)
                await self._close_broken()
                # A refresh while NATS is away still reaches PostgreSQL: the gauge rises.
                with contextlib.suppress(Exception):
                    await self._refresh_backlog(force=True)
                await self._outage.backoff(self._stopped)
        await self._close()

    def stop(self) -> None:
        self._stopping = True
        self._stopped.set()
        self._wake.set()

    async def _connect(self) -> None:
        if self._conn is None:
            self._conn = await self._open()
        if self._listener is None:
            self._listener = await self._open()
            await self._listener.add_listener(notify_channel(self._schema), self._on_notify)
            # A NOTIFY sent while there was no listener is lost: drain once now.
            self._wake.set()

    async def _open(self) -> asyncpg.Connection:
        return await asyncpg.connect(
            self._dsn, timeout=CONNECT_TIMEOUT_S, command_timeout=QUERY_TIMEOUT_S, ssl=self._tls
        )

    async def _close_broken(self) -> None:
        """Close the connections a failure left unusable (a PostgreSQL restart closes
        both); a NATS outage leaves them open for the next try."""
        for name in ("_conn", "_listener"):
            conn: asyncpg.Connection | None = getattr(self, name)
            if conn is not None and conn.is_closed():
                setattr(self, name, None)
        if self._conn is None or self._listener is None:
            await self._close()

    async def _close(self) -> None:
        for conn in (self._listener, self._conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.close(timeout=CONNECT_TIMEOUT_S), CONNECT_TIMEOUT_S)
                if not conn.is_closed():
                    conn.terminate()
        self._conn = None
        self._listener = None

    def _on_notify(self, *_: object) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            # A listener that died (PostgreSQL restarted) hears no NOTIFY: open it again.
            if self._listener is None or self._listener.is_closed():
                raise ConnectionError("the LISTEN connection was closed")
            # Clear before draining: a NOTIFY that lands during the drain sets it again.
            self._wake.clear()
            while not self._stopping and await self.drain_once() == self._batch:
                pass
            self._outage.end()
            await self._refresh_backlog()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll)

    async def _refresh_backlog(self, *, force: bool = False) -> None:
        """Set the backlog gauges, at most once per poll interval (wakes on NOTIFY can
        come thousands of times a second)."""
        now = time.monotonic()
        if self._conn is None or (not force and now - self._backlog_checked < self._poll):
            return
        self._backlog_checked = now
        row = await self._conn.fetchrow(self._backlog_sql, timeout=QUERY_TIMEOUT_S)
        assert row is not None
        metrics.OUTBOX_UNPUBLISHED.labels(self._service).set(row[0])
        metrics.OUTBOX_OLDEST_UNPUBLISHED.labels(self._service).set(max(0.0, row[1]))

    async def drain_once(self) -> int:
        """Claim, publish and delete one batch; returns the number of rows published."""
        assert self._conn is not None
        if self._nats_connected is not None and not self._nats_connected():
            raise Unavailable("NATS is not connected")
        publish = self._js.publish_async
        async with self._conn.transaction():
            rows = await self._conn.fetch(self._claim_sql, self._batch)
            if not rows:
                return 0
            # RETURNING has no order; publishing in seq order keeps each subject in order.
            rows.sort(key=lambda row: row[0])
            futures: list[asyncio.Future[PubAck]] = []

            async def publish_all() -> None:
                for number, (_, msg_id, subject, payload, raw_headers, _) in enumerate(rows, 1):
                    # Most rows carry no trace context: skip parsing an empty object.
                    headers = json.loads(raw_headers) if raw_headers != "{}" else {}
                    headers["Nats-Msg-Id"] = msg_id
                    futures.append(await publish(subject, payload, headers=headers))
                    if number % YIELD_EVERY == 0:
                        # A publish rarely waits, so a full batch would hold the event
                        # loop (and the service's API on it) for tens of milliseconds.
                        await asyncio.sleep(0)
                await asyncio.gather(*futures)

            try:
                # One bound for the whole batch: the publishes (which wait only when the
                # client's pending-ack slots are full) and every ack. Not a bound per
                # publish (`wait_stall`): before Python 3.12 each such wait_for is a task
                # and a trip through the event loop, ~1 ms apiece behind a busy loop.
                # Any failed or missing ack raises here: the transaction rolls back, the
                # rows stay, and the retry is de-duplicated by Nats-Msg-Id.
                await asyncio.wait_for(publish_all(), ACK_TIMEOUT_S)
            except BaseException:
                # Acks lost with a dropped connection never come: cancelling their
                # futures frees nats-py's pending-ack slots, which would otherwise fill
                # up and stall every later publish.
                for future in futures:
                    future.cancel()
                raise
        now = time.time()
        observe = metrics.OUTBOX_LAG.labels(self._service).observe
        for row in rows:
            observe(max(0.0, now - row[5]))
        metrics.OUTBOX_PUBLISHED.labels(self._service).inc(len(rows))
        self.published += len(rows)
        self.batches += 1
        return len(rows)

    async def _isolate(self, rows: int) -> None:
        """Publish up to `rows` rows one at a time, each in its own transaction; a row
        refused for what it is goes to outbox_parked. An outage raises (the rows stay)."""
        assert self._conn is not None
        for _ in range(rows):
            parked: tuple[int, str, str, int, str] | None = None
            async with self._conn.transaction():
                claimed = await self._conn.fetch(self._claim_sql, 1)
                if not claimed:
                    return
                seq, msg_id, subject, payload, raw_headers, created = claimed[0]
                headers = json.loads(raw_headers) if raw_headers != "{}" else {}
                headers["Nats-Msg-Id"] = msg_id
                try:
                    await asyncio.wait_for(
                        self._js.publish(subject, payload, headers=headers), ACK_TIMEOUT_S
                    )
                except Exception as exc:
                    if is_outage(exc) or isinstance(exc, TooManyStalledMsgsError):
                        raise
                    error = f"{type(exc).__name__}: {exc}"[:2000]
                    await self._conn.execute(self._park_sql, seq, msg_id, subject, payload,
                                             raw_headers, created, error)  # fmt: skip
                    parked = (seq, msg_id, subject, len(payload), error)
            if parked is not None:
                await self._parked(*parked)
            else:
                metrics.OUTBOX_PUBLISHED.labels(self._service).inc()
                self.published += 1

    async def _parked(self, seq: int, msg_id: str, subject: str, size: int, error: str) -> None:
        """Say that a row was set aside: log, metric, and (best effort: the row itself is
        the record) an audit record."""
        metrics.OUTBOX_PARKED.labels(self._service).inc()
        log.error(
            "outbox relay for %s: NATS refused row %d (%s, %d bytes, %s): set aside in "
            "%s.outbox_parked (docs/operating.md, 'Parked outbox rows')",
            self._schema, seq, subject, size, error, self._schema,
        )  # fmt: skip
        record = AuditRecord(
            action="outbox.parked",
            actor=self._service,
            entity=printable(msg_id, 200),
            reason=printable(f"NATS refused the event for {subject} ({size} bytes): {error}", 1000),
            details={"seq": seq, "subject": subject, "bytes": size, "schema": self._schema},
            time=utcnow(),
        )
        envelope = make_envelope(
            T.AUDIT,
            record,
            source=self._service,
            envelope_id=str(uuid.uuid5(uuid.NAMESPACE_URL, f"outbox.parked/{msg_id}")),
        )
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self._js.publish(
                    self._subjects.audit("outbox.parked"),
                    envelope.to_bytes(),
                    headers={"Nats-Msg-Id": envelope.id},
                ),
                ACK_TIMEOUT_S,
            )

    def stats(self) -> RelayStats:
        return RelayStats(self.published, self.batches)
