"""The outbox relay: publishes committed outbox rows to JetStream.

- Nats-Msg-Id = row id (the envelope id), so a row published twice (relay crash
  between the publish and the delete) is de-duplicated by the server.
- Woken by LISTEN/NOTIFY on commit, with a polling fallback for a missed NOTIFY.
- Rows are claimed with FOR UPDATE SKIP LOCKED, so several relays (replicas) never
  publish the same row at the same time and never block each other.
- Acks are pipelined: a whole batch is published before any ack is awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import dataclass

import asyncpg
from nats.js import JetStreamContext

from gpusched.contracts.subjects import check_token
from gpusched.infra import metrics
from gpusched.infra.db import asyncpg_dsn, notify_channel

log = logging.getLogger(__name__)


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
    ) -> None:
        self._js = js
        self._dsn = asyncpg_dsn(database_url)
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
        """Relay until `stop()`; reconnects to PostgreSQL after errors."""
        while not self._stopping:
            try:
                await self._connect()
                await self._loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._stopping:
                    break
                log.exception("outbox relay for %s failed; retrying", self._schema)
                await self._close()
                await asyncio.sleep(min(self._poll, 1.0))
        await self._close()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    async def _connect(self) -> None:
        if self._conn is None:
            self._conn = await asyncpg.connect(self._dsn)
        if self._listener is None:
            self._listener = await asyncpg.connect(self._dsn)
            await self._listener.add_listener(notify_channel(self._schema), self._on_notify)

    async def _close(self) -> None:
        for conn in (self._listener, self._conn):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._conn = None
        self._listener = None

    def _on_notify(self, *_: object) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while not self._stopping:
            # Clear before draining: a NOTIFY that lands during the drain sets it again.
            self._wake.clear()
            while not self._stopping and await self.drain_once() == self._batch:
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll)

    async def drain_once(self) -> int:
        """Claim, publish and delete one batch; returns the number of rows published."""
        assert self._conn is not None
        publish = self._js.publish_async
        async with self._conn.transaction():
            rows = await self._conn.fetch(self._claim_sql, self._batch)
            if not rows:
                return 0
            # RETURNING has no order; publishing in seq order keeps each subject in order.
            rows.sort(key=lambda row: row[0])
            futures = []
            for _, msg_id, subject, payload, raw_headers, _ in rows:
                # Most rows carry no trace context: skip parsing an empty object.
                headers = json.loads(raw_headers) if raw_headers != "{}" else {}
                headers["Nats-Msg-Id"] = msg_id
                futures.append(await publish(subject, payload, headers=headers))
            # Any failed ack raises here: the transaction rolls back, the rows stay, and
            # the retry is de-duplicated by Nats-Msg-Id.
            await asyncio.gather(*futures)
        now = time.time()
        observe = metrics.OUTBOX_LAG.labels(self._service).observe
        for row in rows:
            observe(max(0.0, now - row[5]))
        metrics.OUTBOX_PUBLISHED.labels(self._service).inc(len(rows))
        self.published += len(rows)
        self.batches += 1
        return len(rows)

    def stats(self) -> RelayStats:
        return RelayStats(self.published, self.batches)
