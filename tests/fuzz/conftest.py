"""Fixtures of the fuzz suite: the services start once per module (hypothesis draws
many inputs against one running service), each module with its own database and
subject prefix."""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from gpusched.infra.db import asyncpg_dsn
from gpusched.infra.settings import Settings
from tests.conftest import Servers, harness_credentials_in, install


@pytest.fixture(scope="module")
async def module_settings(servers: Servers) -> AsyncIterator[Settings]:
    name = f"gpusched_fuzz_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(asyncpg_dsn(servers.admin_database_url))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    scratch = Path(tempfile.mkdtemp(prefix="gpusched-fuzz-"))
    base, _, _ = servers.admin_database_url.rpartition("/")
    prefix = f"f{uuid.uuid4().hex[:10]}"
    security = await install(servers, prefix, scratch / "auth")
    yield Settings(
        nats_url=servers.nats_url,
        # The services run as the harness, as in the service tests (tests/conftest.py).
        nats_credentials=harness_credentials_in(security),
        database_url=f"{base}/{name}",
        subject_prefix=prefix,
        data_dir=scratch / "data",
        security=security,
    )
    shutil.rmtree(scratch, ignore_errors=True)
    admin = await asyncpg.connect(asyncpg_dsn(servers.admin_database_url))
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()
