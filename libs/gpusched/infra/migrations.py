"""Alembic migrations, one schema and one version table per service.

Each service keeps its revisions in `services/gpusched/<service>/migrations/`, whose
env.py calls `run_env()`. `migrate()` runs them idempotently under an advisory lock,
so several replicas starting at once do not race.
"""

from __future__ import annotations

import logging
import zlib
from pathlib import Path

from alembic import command, context, op
from alembic.config import Config
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import AsyncEngine

from gpusched.contracts.subjects import check_token


async def migrate(engine: AsyncEngine, schema: str, script_location: Path) -> None:
    check_token(schema, "schema")
    # Alembic's INFO lines ("Context impl PostgresqlImpl.", "Will assume transactional
    # DDL.") say nothing an operator needs at every start of every service.
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        logging.getLogger("alembic").setLevel(logging.WARNING)
    async with engine.begin() as conn:
        await conn.execute(
            text("SELECT pg_advisory_xact_lock(:k)"), {"k": zlib.crc32(schema.encode())}
        )
        await conn.execute(text(f"CREATE SCHEMA IF NOT EXISTS {schema}"))
        await conn.run_sync(_upgrade, schema, script_location)


def _upgrade(conn: Connection, schema: str, script_location: Path) -> None:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location))
    cfg.attributes["connection"] = conn
    cfg.attributes["schema"] = schema
    command.upgrade(cfg, "head")


def run_env() -> None:
    """The body of every service's migrations/env.py (online mode only)."""
    conn = context.config.attributes["connection"]
    schema = context.config.attributes["schema"]
    context.configure(
        connection=conn,
        version_table_schema=schema,
        version_table="alembic_version",
        transactional_ddl=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def current_schema() -> str:
    """The schema the running migration targets (inside a revision's upgrade())."""
    schema = context.config.attributes["schema"]
    assert isinstance(schema, str)
    return schema


def create_outbox_and_inbox(schema: str) -> None:
    """The delivery tables every service has in its own schema (DESIGN §5)."""
    op.execute(
        f"""
        CREATE TABLE {schema}.outbox (
            seq        bigserial PRIMARY KEY,
            id         text NOT NULL UNIQUE,
            subject    text NOT NULL,
            payload    bytea NOT NULL,
            headers    jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            created_at timestamptz NOT NULL DEFAULT clock_timestamp()
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {schema}.inbox (
            message_id text NOT NULL,
            consumer   text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now(),
            PRIMARY KEY (message_id, consumer)
        )
        """
    )


def create_outbox_parked(schema: str) -> None:
    """Where the outbox relay sets aside a row that can never be published (NATS refuses
    it for what it is, e.g. over the server's max_payload), so the rows behind it go on;
    an operator publishes or drops it (docs/operating.md, "Parked outbox rows")."""
    op.execute(
        f"""
        CREATE TABLE {schema}.outbox_parked (
            seq        bigint PRIMARY KEY,
            id         text NOT NULL,
            subject    text NOT NULL,
            payload    bytea NOT NULL,
            headers    jsonb NOT NULL,
            created_at timestamptz NOT NULL,
            parked_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
            error      text NOT NULL
        )
        """
    )


def migrations_dir(service_file: str) -> Path:
    """`migrations/` beside a service module (pass `__file__`)."""
    return Path(service_file).resolve().parent / "migrations"
