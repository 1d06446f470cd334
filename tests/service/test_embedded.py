"""The embedded NATS and PostgreSQL servers: real processes, own ports, own data dirs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import nats
import pytest
from tests.support.admission import inventory_loaded_bytes

from gpusched.infra.embedded import (
    STACK_MAX_PAYLOAD,
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedServerError,
    free_port,
)

REPO = Path(__file__).resolve().parents[2]


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by init) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def port_is_free(port: int) -> bool:
    """Whether a server could listen on `port` now (servers set SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
            sock.listen()
        except OSError:
            return False
    return True


@pytest.fixture
def nats_dir(tmp_path: Path) -> Path:
    return tmp_path / "nats"


@pytest.fixture
def embedded_nats(nats_dir: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(nats_dir)
    yield server
    server.stop()


@pytest.fixture
def pg_dir() -> Iterator[Path]:
    # Not under tmp_path: as root, PostgreSQL runs as another user that must traverse
    # every parent directory, and each new pytest session on the machine resets
    # /tmp/pytest-of-root to 0700.
    root = Path(tempfile.mkdtemp(prefix="gpusched-test-embedded-"))
    yield root / "pg"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def embedded_pg(pg_dir: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(pg_dir)
    yield server
    server.stop()


async def test_nats_starts_with_jetstream_and_stopping_frees_port_and_pid(
    embedded_nats: EmbeddedNats,
) -> None:
    url = await asyncio.to_thread(embedded_nats.start)
    assert url == f"nats://127.0.0.1:{embedded_nats.port}"
    client = await nats.connect(url)
    try:
        js = client.jetstream()
        await js.add_stream(name="ORDERS", subjects=["orders.>"])
        ack = await js.publish("orders.1", b"hello")
        assert (ack.stream, ack.seq) == ("ORDERS", 1)
    finally:
        await client.close()
    pid = embedded_nats.pid
    assert pid is not None

    embedded_nats.stop()
    embedded_nats.stop()  # idempotent

    assert embedded_nats.pid is None
    assert not process_alive(pid)
    assert port_is_free(embedded_nats.port)


async def test_nats_restarted_on_the_same_data_dir_keeps_its_streams(nats_dir: Path) -> None:
    with EmbeddedNats(nats_dir) as first:
        client = await nats.connect(first.url)
        try:
            await client.jetstream().add_stream(name="KEPT", subjects=["kept.>"])
            await client.jetstream().publish("kept.a", b"1")
        finally:
            await client.close()

    with EmbeddedNats(nats_dir) as second:
        client = await nats.connect(second.url)
        try:
            info = await client.jetstream().stream_info("KEPT")
        finally:
            await client.close()
    assert info.state.messages == 1


async def test_the_shipped_stacks_nats_carries_the_inventory_of_10000_nodes(
    nats_dir: Path,
) -> None:
    payload = inventory_loaded_bytes(10_000)
    assert len(payload) > 1024 * 1024  # over NATS's default max_payload

    with EmbeddedNats(nats_dir / "default") as default:
        client = await nats.connect(default.url)
        try:
            with pytest.raises(nats.errors.MaxPayloadError):
                await client.publish("inventory", payload)
        finally:
            await client.close()

    with EmbeddedNats(nats_dir / "stack", max_payload=STACK_MAX_PAYLOAD) as stack:
        client = await nats.connect(stack.url)
        try:
            assert client.max_payload == STACK_MAX_PAYLOAD
            js = client.jetstream()
            await js.add_stream(name="EVENTS", subjects=["events.>"])
            await js.publish("events.inventory.loaded", payload)
            stored = await js.get_msg("EVENTS", seq=1)
        finally:
            await client.close()
    assert stored.data == payload


def test_a_max_payload_over_what_nats_advises_is_refused(nats_dir: Path) -> None:
    with pytest.raises(ValueError, match="max_payload"):
        EmbeddedNats(nats_dir, max_payload=STACK_MAX_PAYLOAD + 1)
    with pytest.raises(ValueError, match="max_payload"):
        EmbeddedNats(nats_dir, max_payload=0)


def test_servers_restarted_in_place_keep_their_urls(nats_dir: Path, pg_dir: Path) -> None:
    for server in (EmbeddedNats(nats_dir), EmbeddedPostgres(pg_dir)):
        try:
            first = server.start()
            server.stop()
            assert server.start() == first
        finally:
            server.stop()


def test_nats_that_cannot_listen_raises_with_its_log(nats_dir: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = EmbeddedNats(nats_dir, port=taken.getsockname()[1])
        with pytest.raises(EmbeddedServerError, match="already in use"):
            server.start()
    assert server.pid is None


async def test_postgres_starts_accepts_queries_and_stopping_frees_port_and_pid(
    embedded_pg: EmbeddedPostgres,
) -> None:
    url = await asyncio.to_thread(embedded_pg.start)
    assert url == f"postgresql+asyncpg://postgres@127.0.0.1:{embedded_pg.port}/postgres"
    connection = await asyncpg.connect(embedded_pg.dsn)
    try:
        assert await connection.fetchval("SELECT 1") == 1
    finally:
        await connection.close()
    pid = embedded_pg.pid
    assert pid is not None

    embedded_pg.stop()
    embedded_pg.stop()  # idempotent

    assert embedded_pg.pid is None
    assert not process_alive(pid)
    assert port_is_free(embedded_pg.port)


async def test_postgres_creates_databases_idempotently(embedded_pg: EmbeddedPostgres) -> None:
    await asyncio.to_thread(embedded_pg.start)
    name = 'odd-name "quoted"'

    url = embedded_pg.create_database(name)
    assert embedded_pg.create_database(name) == url

    connection = await asyncpg.connect(embedded_pg.dsn_for(name))
    try:
        assert await connection.fetchval("SELECT current_database()") == name
    finally:
        await connection.close()


async def test_postgres_restarted_on_the_same_data_dir_keeps_its_tables(pg_dir: Path) -> None:
    with EmbeddedPostgres(pg_dir) as first:
        connection = await asyncpg.connect(first.dsn)
        try:
            await connection.execute("CREATE TABLE kept (id int); INSERT INTO kept VALUES (7)")
        finally:
            await connection.close()

    with EmbeddedPostgres(pg_dir) as second:
        connection = await asyncpg.connect(second.dsn)
        try:
            assert await connection.fetchval("SELECT id FROM kept") == 7
        finally:
            await connection.close()


# Runs a script under a subreaper that reaps every orphan and exits once none is left, so
# "the servers died" is observable as the reaper's exit and leaves no zombie behind (this
# machine's init may not reap).
REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
while True:
    try:
        os.wait()
    except ChildProcessError:
        break
"""


def test_servers_die_with_a_parent_that_is_killed(nats_dir: Path, pg_dir: Path) -> None:
    script = textwrap.dedent(
        f"""
        import json, os, threading, time
        from pathlib import Path
        from gpusched.infra.embedded import EmbeddedNats, EmbeddedPostgres

        servers = [EmbeddedNats(Path({str(nats_dir)!r})), EmbeddedPostgres(Path({str(pg_dir)!r}))]
        # Started from a thread that ends at once: the servers must outlive the thread.
        for server in servers:
            starter = threading.Thread(target=server.start)
            starter.start()
            starter.join()
        print(json.dumps([os.getpid(), *[server.pid for server in servers]]), flush=True)
        time.sleep(600)
        """
    )
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER, script], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    pids: list[int] = []
    try:
        assert reaper.stdout is not None
        parent, *pids = json.loads(reaper.stdout.readline())
        time.sleep(0.3)
        assert all(map(process_alive, pids)), "a server died with the thread that started it"

        os.kill(parent, signal.SIGKILL)

        assert reaper.wait(timeout=20) == 0
        assert not any(map(process_alive, pids))
    finally:
        for pid in filter(process_alive, pids):
            os.kill(pid, signal.SIGKILL)
        reaper.kill()
        reaper.wait()


def test_free_port_returns_a_bindable_port() -> None:
    assert port_is_free(free_port())


def wait_dead(server: EmbeddedNats | EmbeddedPostgres, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while server.returncode is None:
        assert time.monotonic() < deadline, "the server did not die"
        time.sleep(0.02)


async def test_a_sigkilled_nats_is_revived_on_the_same_port_with_its_streams(
    embedded_nats: EmbeddedNats,
) -> None:
    url = await asyncio.to_thread(embedded_nats.start)
    client = await nats.connect(url)
    try:
        await client.jetstream().add_stream(name="KEPT", subjects=["kept.>"])
        await client.jetstream().publish("kept.a", b"1")
    finally:
        await client.close()
    old_pid = embedded_nats.pid
    assert old_pid is not None

    embedded_nats.kill(signal.SIGKILL)
    wait_dead(embedded_nats)
    assert await asyncio.to_thread(embedded_nats.revive) == url

    assert embedded_nats.pid not in (None, old_pid)
    assert list(embedded_nats.data_dir.glob("*.ports")) == list(
        embedded_nats.data_dir.glob(f"*_{embedded_nats.pid}.ports")
    )
    client = await nats.connect(url)
    try:
        info = await client.jetstream().stream_info("KEPT")
    finally:
        await client.close()
    assert info.state.messages == 1


async def test_a_sigkilled_postgres_is_revived_on_the_same_port_with_its_tables(
    embedded_pg: EmbeddedPostgres,
) -> None:
    url = await asyncio.to_thread(embedded_pg.start)
    connection = await asyncpg.connect(embedded_pg.dsn)
    try:
        await connection.execute("CREATE TABLE kept (id int); INSERT INTO kept VALUES (7)")
    finally:
        await connection.close()
    old_pid = embedded_pg.pid

    embedded_pg.kill(signal.SIGKILL)
    wait_dead(embedded_pg)
    # The dead server's postmaster.pid is still there, naming it.
    assert (embedded_pg.pgdata / "postmaster.pid").read_text().split()[0] == str(old_pid)
    assert await asyncio.to_thread(embedded_pg.revive) == url

    connection = await asyncpg.connect(embedded_pg.dsn)
    try:
        assert await connection.fetchval("SELECT id FROM kept") == 7
    finally:
        await connection.close()


def test_postgres_starts_over_a_stale_postmaster_pid_naming_a_live_process_not_ours(
    pg_dir: Path,
) -> None:
    server = EmbeddedPostgres(pg_dir)
    try:
        server.start()
        server.stop()
        # A crash left the file behind, and its pid now belongs to an unrelated process.
        stranger = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            pid_file = server.pgdata / "postmaster.pid"
            pid_file.write_text(f"{stranger.pid}\n{server.pgdata}\n")
            os.chmod(pid_file, 0o600)

            server.start()

            assert server.is_running
        finally:
            stranger.kill()
            stranger.wait()
    finally:
        server.stop()


def test_postgres_refuses_to_start_on_a_data_dir_a_live_postgres_uses(pg_dir: Path) -> None:
    first = EmbeddedPostgres(pg_dir)
    second = EmbeddedPostgres(pg_dir)
    try:
        first.start()
        with pytest.raises(EmbeddedServerError, match="already runs on"):
            second.start()
        assert first.is_running
    finally:
        second.stop()
        first.stop()
