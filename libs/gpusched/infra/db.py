"""PostgreSQL access: the engine, and the unit of work every handler runs in.

A unit of work is one transaction in one service's schema. State changes, the inbox
record of the message that caused them and the outbox rows of the events they cause
commit together or not at all (STYLE 3, 4).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import TracebackType
from typing import Any, Self

from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import AuditRecord, T
from gpusched.contracts.subjects import Subjects, check_token
from gpusched.infra import tracing


def create_engine(url: str, *, pool_size: int = 5) -> AsyncEngine:
    return create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)


def asyncpg_dsn(url: str) -> str:
    """The plain libpq DSN asyncpg wants, from a SQLAlchemy URL."""
    return url.replace("postgresql+asyncpg://", "postgresql://", 1)


def notify_channel(schema: str) -> str:
    return f"{schema}_outbox"


class UnitOfWork:
    """One transaction in `schema`. Rolls back unless `commit()` was called."""

    def __init__(self, engine: AsyncEngine, schema: str, source: str, subjects: Subjects) -> None:
        self.schema = check_token(schema, "schema")
        self.source = source
        self.subjects = subjects
        self._engine = engine
        self._conn: AsyncConnection | None = None
        self._emitted = 0
        self._committed = False
        self.emitted: list[Envelope] = []

    async def __aenter__(self) -> Self:
        self._conn = await self._engine.connect()
        await self._conn.begin()
        return self

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

    @property
    def conn(self) -> AsyncConnection:
        if self._conn is None:
            raise RuntimeError("unit of work used outside `async with`")
        return self._conn

    async def execute(self, sql: str, params: Mapping[str, Any] | None = None) -> Any:
        return await self.conn.execute(text(sql), dict(params or {}))

    async def commit(self) -> None:
        if self._emitted:
            # NOTIFY is delivered at commit, and only if it commits: the relay wakes
            # exactly when there is something durable to publish.
            await self.execute("SELECT pg_notify(:ch, '')", {"ch": notify_channel(self.schema)})
        await self.conn.commit()
        self._committed = True

    # --- inbox ----------------------------------------------------------------------------
    async def claim(self, message_id: str, consumer: str) -> bool:
        """Record that this consumer applies `message_id`; False if it already did.

        The row commits with the effect, so a redelivery after a crash before commit
        is applied again, and one after commit is a no-op.
        """
        result = await self.execute(
            f"INSERT INTO {self.schema}.inbox (message_id, consumer) VALUES (:m, :c) "
            "ON CONFLICT DO NOTHING RETURNING message_id",
            {"m": message_id, "c": consumer},
        )
        return result.first() is not None

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
        envelope = make_envelope(
            message_type,
            data,
            source=self.source,
            correlation_id=correlation_id,
            causation_id=causation_id,
        )
        headers = dict(trace_headers) if trace_headers is not None else tracing.inject()
        await self.execute(
            f"INSERT INTO {self.schema}.outbox (id, subject, payload, headers) "
            "VALUES (:id, :subject, :payload, CAST(:headers AS jsonb))",
            {
                "id": envelope.id,
                "subject": subject,
                "payload": envelope.to_bytes(),
                "headers": json.dumps(headers),
            },
        )
        self._emitted += 1
        self.emitted.append(envelope)
        return envelope

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
        record = AuditRecord(
            action=action,
            actor=self.source,
            entity=entity,
            reason=reason,
            details=dict(details or {}),
            time=utcnow(),
        )
        return await self.emit(
            self.subjects.audit(action),
            T.AUDIT,
            record,
            correlation_id=correlation_id or entity,
            causation_id=causation_id,
        )


class UnitOfWorkFactory:
    """Makes units of work for one service; handlers receive one per message."""

    def __init__(self, engine: AsyncEngine, schema: str, source: str, subjects: Subjects) -> None:
        self.engine = engine
        self.schema = schema
        self.source = source
        self.subjects = subjects

    def __call__(self) -> UnitOfWork:
        return UnitOfWork(self.engine, self.schema, self.source, self.subjects)
