"""PostgreSQL access: the engine, and the unit of work every handler runs in.

A unit of work is one transaction in one service's schema. State changes, the inbox
record of the message that caused them and the outbox rows of the events they cause
commit together or not at all (STYLE 3, 4).
"""

from __future__ import annotations

import contextlib
import functools
import json
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import asyncpg
from pydantic import BaseModel, ValidationError
from sqlalchemy import TextClause, text
from sqlalchemy import event as sa_event
from sqlalchemy.exc import InvalidatePoolError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import AuditRecord, T
from gpusched.contracts.subjects import Subjects, check_token
from gpusched.contracts.validation import NAME_MAX, TEXT_MAX, check_text, printable
from gpusched.infra import tracing
from gpusched.infra.errors import is_outage

# A pooled connection idle for longer than this is pinged before use (it may have died
# with a PostgreSQL restart). One in steady use is not: SQLAlchemy's own pre-ping costs
# three round trips (BEGIN, a query, ROLLBACK) on every checkout, more than a short
# transaction's statements. If the server restarted within this window, the first
# statement fails instead, SQLAlchemy invalidates the pool, and the caller's retry
# (a consumer's nak, the next tick) gets a fresh connection.
IDLE_PING_S = 5.0
_IDLE_SINCE = "gpusched_idle_since"  # key in a pooled connection's info


# Every wait on PostgreSQL is bounded, so an unreachable or hung server is an outage
# (errors.is_outage) the caller waits out, never a hang: a new connection, a pooled
# connection when all are in use, and one statement (generous: a migration or a big
# batch may take a while; a statement stuck longer is a server that stopped answering).
CONNECT_TIMEOUT_S = 5.0
POOL_TIMEOUT_S = 10.0
STATEMENT_TIMEOUT_S = 60.0


def create_engine(
    url: str, *, pool_size: int = 5, tls: ssl.SSLContext | None = None
) -> AsyncEngine:
    """The engine of one service; with `tls` (infra.tls) every connection is TLS, and
    fails rather than goes plain if the server does not offer it."""
    engine = create_async_engine(
        url,
        pool_size=pool_size,
        max_overflow=pool_size,
        pool_timeout=POOL_TIMEOUT_S,
        connect_args={
            "timeout": CONNECT_TIMEOUT_S,
            "command_timeout": STATEMENT_TIMEOUT_S,
            # The server gives up too, so a statement the client abandoned does not
            # keep its locks.
            "server_settings": {"statement_timeout": str(int(STATEMENT_TIMEOUT_S * 1000) + 5000)},
            **({} if tls is None else {"ssl": tls}),
        },
    )
    sa_event.listen(engine.sync_engine, "checkin", _note_idle)
    sa_event.listen(engine.sync_engine, "checkout", _ping_if_idle)
    return engine


def _note_idle(dbapi_connection: Any, record: Any) -> None:
    record.info[_IDLE_SINCE] = time.monotonic()


def _ping_if_idle(dbapi_connection: Any, record: Any, proxy: Any) -> None:
    idle_since = record.info.get(_IDLE_SINCE)
    if idle_since is None or time.monotonic() - idle_since < IDLE_PING_S:
        return
    try:
        dbapi_connection.ping()
    except Exception as exc:
        # As pre-ping does: the server went away, so every pooled connection is stale.
        raise InvalidatePoolError(f"idle connection failed its ping: {exc}") from exc


@functools.lru_cache(maxsize=2048)
def _text(sql: str) -> TextClause:
    # A service runs the same few hundred statements over and over; building the
    # clause parses its bind parameters with a regex each time. Clauses are immutable.
    return text(sql)


def asyncpg_dsn(url: str) -> str:
    """The plain libpq DSN asyncpg wants, from a SQLAlchemy URL."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def notify_channel(schema: str) -> str:
    return f"{schema}_outbox"


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One event for ``UnitOfWork.emit_many``: the arguments of ``emit``."""

    subject: str
    message_type: str
    data: BaseModel
    correlation_id: str | None = None
    causation_id: str | None = None
    trace_headers: Mapping[str, str] | None = None


class UnitOfWork:
    """One transaction in `schema`. Rolls back unless `commit()` was called."""

    def __init__(self, engine: AsyncEngine, schema: str, source: str, subjects: Subjects) -> None:
        self.schema = check_token(schema, "schema")
        self.source = source
        self.subjects = subjects
        self._engine = engine
        self._conn: AsyncConnection | None = None
        self._driver: asyncpg.Connection | None = None
        # Outbox rows wait here and are written at commit in one statement with the
        # NOTIFY: a round trip per transaction instead of one per event (plus one).
        self._outbox: list[dict[str, Any]] = []
        self._committed = False
        self.emitted: list[Envelope] = []
        self._before_commit: list[Callable[[], Awaitable[None]]] = []
        self._on_commit: list[Callable[[], None]] = []

    async def __aenter__(self) -> Self:
        self._conn = await self._engine.connect()
        await self._conn.begin()
        return self

    async def snapshot(self) -> None:
        """Make this a read-only transaction that sees one snapshot: every statement
        reads the database as of the first (PostgreSQL's default shows each statement
        what was committed before it, so a view read in several statements could mix a
        job row from before a pass with allocation rows from after it). Call it first."""
        await self.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._conn is not None
        try:
            if not self._committed:
                await self._conn.rollback()
        finally:
            await self._conn.close()
            self._conn = None
            self._driver = None

    @property
    def conn(self) -> AsyncConnection:
        if self._conn is None:
            raise RuntimeError("unit of work used outside `async with`")
        return self._conn

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> Any:
        return await self.conn.execute(_text(sql), dict(params or {}))

    # --- the driver's own statements ------------------------------------------------------
    # SQLAlchemy Core spends ~100 µs of CPU per statement around the driver (compiling
    # the clause, its result machinery, a greenlet switch): more than asyncpg itself. A
    # hot path (a consumer's per-message statements) speaks asyncpg directly, in the same
    # transaction, with `$1` parameters and asyncpg's rows (`row["name"]`); jsonb comes
    # back as text (the codec SQLAlchemy installs on its connections).

    async def fetch(self, sql: str, *args: Any) -> list[asyncpg.Record]:
        """The rows of `sql` (asyncpg's statement cache prepares it once per connection)."""
        driver = await self._in_transaction()
        try:
            with tracing.statement(sql):
                rows: list[asyncpg.Record] = await driver.fetch(sql, *args)
        except Exception as exc:
            await self._invalidate_if_gone(exc)
            raise
        return rows

    async def fetchrow(self, sql: str, *args: Any) -> asyncpg.Record | None:
        """The first row of `sql`, or None."""
        driver = await self._in_transaction()
        try:
            with tracing.statement(sql):
                return await driver.fetchrow(sql, *args)
        except Exception as exc:
            await self._invalidate_if_gone(exc)
            raise

    async def _in_transaction(self) -> asyncpg.Connection:
        """The asyncpg connection under `conn`, with this unit of work's transaction
        begun. SQLAlchemy's asyncpg adapter begins it lazily, at its first statement;
        one issued past the adapter must begin it the same way, or it would run (and
        commit) on its own."""
        if self._driver is None:
            raw = await self.conn.get_raw_connection()
            adapter: Any = raw.dbapi_connection
            async with adapter._execute_mutex:
                if adapter._transaction is None:
                    await adapter._start_transaction()
            self._driver = raw.driver_connection
        return self._driver

    async def _invalidate_if_gone(self, exc: Exception) -> None:
        # SQLAlchemy only sees errors of its own statements: a connection that died under
        # a driver statement is dropped from the pool here, not handed to the next user.
        if self._conn is not None and is_outage(exc):
            self._driver = None
            with contextlib.suppress(Exception):
                await self._conn.invalidate(exc)

    def before_commit(self, write: Callable[[], Awaitable[None]]) -> None:
        """Run ``write`` in this transaction when it commits, before the outbox rows: for
        state held in memory whose rows are written once per transaction, whatever
        statements changed it."""
        self._before_commit.append(write)

    async def commit(self) -> None:
        writes, self._before_commit = self._before_commit, []
        for write in writes:
            await write()
        if self._outbox:
            await self._write_outbox()
        await self.conn.commit()
        self._committed = True
        callbacks, self._on_commit = self._on_commit, []
        for callback in callbacks:
            callback()

    def on_commit(self, callback: Callable[[], None]) -> None:
        """Run `callback` once this unit of work has committed (never if it rolls back):
        e.g. count a metric of what it did, exactly once however often it is retried."""
        self._on_commit.append(callback)

    async def flush(self) -> None:
        """Write the events emitted so far to the outbox now, in this transaction: a long
        batch of decisions is written in parts, each a short step of the event loop.
        They are published only after commit all the same (one NOTIFY at commit)."""
        if self._outbox:
            await self._write_outbox()

    async def _write_outbox(self) -> None:
        rows, self._outbox = self._outbox, []
        # WITH ORDINALITY ... ORDER BY: the rows take their seq in emit order, which is
        # the order the relay publishes them in. NOTIFY is delivered at commit, and only
        # if it commits: the relay wakes exactly when there is something durable to
        # publish. (A data-modifying WITH runs whether or not the SELECT reads it.)
        await self.fetch(
            f"WITH written AS (INSERT INTO {self.schema}.outbox (id, subject, payload, headers) "
            "SELECT r.id, r.subject, r.payload, CAST(r.headers AS jsonb) FROM unnest("
            "$1::text[], $2::text[], $3::bytea[], $4::text[]) "
            "WITH ORDINALITY AS r(id, subject, payload, headers, n) "
            "ORDER BY r.n RETURNING 1) SELECT pg_notify($5, '')",
            [row["id"] for row in rows],
            [row["subject"] for row in rows],
            [row["payload"] for row in rows],
            [row["headers"] for row in rows],
            notify_channel(self.schema),
        )

    # --- inbox ----------------------------------------------------------------------------
    async def claim(self, message_id: str, consumer: str) -> bool:
        """Record that this consumer applies `message_id`; False if it already did.

        The row commits with the effect, so a redelivery after a crash before commit
        is applied again, and one after commit is a no-op.
        """
        row = await self.fetchrow(
            f"INSERT INTO {self.schema}.inbox (message_id, consumer) VALUES ($1, $2) "
            "ON CONFLICT DO NOTHING RETURNING message_id",
            message_id,
            consumer,
        )
        return row is not None

    async def claim_many(self, message_ids: Sequence[str], consumer: str) -> set[str]:
        """`claim` for several messages in one statement: the ids this consumer had not
        applied yet (an id given twice is claimed once)."""
        rows = await self.fetch(
            f"INSERT INTO {self.schema}.inbox (message_id, consumer) "
            "SELECT DISTINCT m, $2 FROM unnest($1::text[]) AS m "
            "ON CONFLICT DO NOTHING RETURNING message_id",
            list(message_ids),
            consumer,
        )
        return {row["message_id"] for row in rows}

    # --- outbox ---------------------------------------------------------------------------
    async def emit(
        self,
        subject: str,
        message_type: str,
        data: BaseModel,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> Envelope:
        return self._stage(
            Outgoing(subject, message_type, data, correlation_id, causation_id, trace_headers),
            tracing.inject,
        )

    async def emit_many(self, events: Sequence[Outgoing]) -> list[Envelope]:
        """``emit`` for many events (a batch of decisions); written at commit with the
        rows of ``emit``, in one order."""
        current: dict[str, str] | None = None

        def current_context() -> dict[str, str]:
            # One span is current for the whole batch: inject it once.
            nonlocal current
            if current is None:
                current = tracing.inject()
            return current

        return [self._stage(event, current_context) for event in events]

    def _stage(self, event: Outgoing, current_context: Callable[[], dict[str, str]]) -> Envelope:
        envelope = make_envelope(
            event.message_type,
            event.data,
            source=self.source,
            correlation_id=event.correlation_id,
            causation_id=event.causation_id,
        )
        if tracing.recording():
            headers = tracing.produced(
                event.subject,
                envelope.id,
                event.correlation_id,
                event.message_type,
                event.trace_headers,
            )
        elif event.trace_headers is None:
            headers = current_context()
        else:
            headers = dict(event.trace_headers)
        self._outbox.append(
            {
                "id": envelope.id,
                "subject": event.subject,
                "payload": envelope.to_bytes(),
                "headers": json.dumps(headers),
            }
        )
        return envelope

    def audit_event(
        self,
        action: str,
        entity: str,
        reason: str,
        details: Mapping[str, Any] | None = None,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> Outgoing:
        """The audit record ``audit`` would emit, for ``emit_many``.

        ``entity`` and ``reason`` are often built from what a user sent (a job's GPU
        models, a node's name): they are made to fit the record (see ``_fitted``), so an
        audit record never fails the decision it records."""
        fields = {"action": action, "actor": self.source, "details": dict(details or {})}
        try:
            record = AuditRecord(entity=entity, reason=reason, time=utcnow(), **fields)
        except ValidationError:
            # Checked again only when the record refused them: most records fit as made.
            entity = _fitted(entity, NAME_MAX)
            reason = _fitted(reason, TEXT_MAX, multiline=True)
            record = AuditRecord(entity=entity, reason=reason, time=utcnow(), **fields)
        return Outgoing(
            self.subjects.audit(action),
            T.AUDIT,
            record,
            correlation_id=correlation_id or entity or None,
            causation_id=causation_id,
            trace_headers=trace_headers,
        )

    async def audit(
        self,
        action: str,
        entity: str,
        reason: str,
        details: Mapping[str, Any] | None = None,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
    ) -> Envelope:
        event = self.audit_event(
            action, entity, reason, details, correlation_id=correlation_id,
            causation_id=causation_id,
        )  # fmt: skip
        return self._stage(event, tracing.inject)


def _fitted(text: str, limit: int, *, multiline: bool = False) -> str:
    """``text`` as a bounded text field holds it: unchanged if it fits; else its control
    and bidi characters escaped (on one line) and, past ``limit`` characters, its start
    kept and its end saying how much was left out."""
    try:
        return check_text(text, max_length=limit, multiline=multiline)
    except ValueError:
        pass
    # Escaping makes a character at most 6 long (\u202e): nothing is cut here.
    text = printable(text, 6 * len(text))
    if len(text) <= limit:
        return text
    # The marker states at most len(text) characters left out: as long as it ever is.
    keep = limit - len(_left_out(len(text)))
    return text[:keep] + _left_out(len(text) - keep)


def _left_out(count: int) -> str:
    return f"... ({count} more characters)"


class UnitOfWorkFactory:
    """Makes units of work for one service; handlers receive one per message."""

    def __init__(self, engine: AsyncEngine, schema: str, source: str, subjects: Subjects) -> None:
        self.engine = engine
        self.schema = schema
        self.source = source
        self.subjects = subjects

    def __call__(self) -> UnitOfWork:
        return UnitOfWork(self.engine, self.schema, self.source, self.subjects)
