"""`gpusched up` as an operator runs it: it starts, stays up through crashes, is found by
the CLI through its data dir, refuses a second copy, and SIGTERM stops everything."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import psutil
import pytest

from gpusched.cli.client import ApiClient
from gpusched.cli.stack import Stack
from gpusched.infra.embedded import STACK_MAX_PAYLOAD
from gpusched.infra.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _clean_env(data_dir: Path) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("GPUSCHED_")  # embedded servers, whatever the caller set
    }  # fmt: skip
    env.update({"GPUSCHED_DATA_DIR": str(data_dir), "GPUSCHED_LOG_LEVEL": "WARNING"})
    return env


def _gpusched(
    *args: str, env: dict[str, str], timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpusched.cli.main", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


class Up:
    """One `gpusched up` child process and the lines it printed."""

    def __init__(self, env: dict[str, str], log_dir: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpusched.cli.main", "up", "--log-dir", str(log_dir)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []

    def wait_ready(self, timeout: float = 180) -> str:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            assert line or self.process.poll() is None, f"up exited early: {self.lines}"
            self.lines.append(line)
            if "is up and ready" in line:
                return line
        raise AssertionError(f"not ready in {timeout}s: {self.lines}")

    def terminate(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=60)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Not under tmp_path: as root, PostgreSQL runs as another user that must traverse
    # every parent directory, and each new pytest session on the machine resets
    # /tmp/pytest-of-root to 0700.
    root = Path(tempfile.mkdtemp(prefix="gpusched-test-up-"))
    yield root / "data"
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    started: list[Up] = []
    yield started
    for up in started:
        up.kill()


def _stack_file(data_dir: Path) -> dict[str, object]:
    content = json.loads((data_dir / "stack.json").read_text())
    assert isinstance(content, dict)
    return content


def _get_answers_not_found(env: dict[str, str], within_s: float = 60) -> None:
    deadline = time.monotonic() + within_s
    while True:
        done = _gpusched("get", "job-000000000000", env=env)
        # Admission answers: the job does not exist (one line on stderr, exit 1).
        if "not_found" in done.stderr and done.returncode == 1:
            return
        assert time.monotonic() < deadline, (done.stdout, done.stderr)
        time.sleep(0.5)


@pytest.mark.timeout(420)
def test_up_survives_kill_9_is_found_through_its_data_dir_and_keeps_its_ports(
    tmp_path: Path, data_dir: Path, ups: list[Up]
) -> None:
    env = _clean_env(data_dir)
    up = Up(env, tmp_path / "logs")
    ups.append(up)
    banner = up.wait_ready()
    match = re.search(r"NATS (nats://127\.0\.0\.1:(\d+)), PostgreSQL (\S+:(\d+)/\S+)", banner)
    assert match, banner
    nats_url, nats_port, pg_port = match.group(1), int(match.group(2)), int(match.group(4))
    stack = _stack_file(data_dir)
    assert stack["nats_url"] == nats_url and stack["running"] is True
    assert (data_dir / "stack.json").stat().st_mode & 0o777 == 0o600

    # The CLI finds the stack through GPUSCHED_DATA_DIR alone: no URL exported.
    _get_answers_not_found(env)

    # A second `up` on the same data dir refuses, and starts no servers.
    second = _gpusched("up", env=env, timeout=60)
    assert second.returncode == 1
    assert second.stderr.splitlines() == [
        f"gpusched: a stack already runs on data dir {data_dir} (pid {up.process.pid}); "
        "stop it first, or set GPUSCHED_DATA_DIR to another directory"
    ]
    assert second.stdout == ""
    assert "Traceback" not in second.stdout + second.stderr

    # kill -9 of a service: it comes back and serves; nothing else stops.
    pids = stack["pids"]
    assert isinstance(pids, dict)
    os.kill(pids["admission"], signal.SIGKILL)
    time.sleep(0.5)
    _get_answers_not_found(env)
    assert up.process.poll() is None
    assert all(psutil.pid_exists(pids[name]) for name in ("ingest", "nats", "postgres"))
    deadline = time.monotonic() + 10
    while _stack_file(data_dir)["pids"]["admission"] == pids["admission"]:  # type: ignore[index]
        assert time.monotonic() < deadline, "the stack file still names the dead pid"
        time.sleep(0.2)

    # kill -9 of nats-server: it comes back on its port, and the API answers again.
    os.kill(pids["nats"], signal.SIGKILL)
    time.sleep(1.0)
    _get_answers_not_found(env)
    assert _stack_file(data_dir)["nats_url"] == nats_url

    children = psutil.Process(up.process.pid).children(recursive=True)
    assert up.terminate() == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [p.pid for p in alive]
    assert _port_free(nats_port) and _port_free(pg_port)
    assert _stack_file(data_dir)["running"] is False

    # The next `up` on this data dir serves on the same ports: clients keep their URL.
    again = Up(env, tmp_path / "logs")
    ups.append(again)
    assert nats_url in again.wait_ready()
    assert f":{pg_port}/" in again.lines[-1]
    assert again.terminate() == 0


def test_the_cli_against_a_dead_url_fails_fast_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]  # nothing listens there once closed
    env = _clean_env(tmp_path / "data")
    env["GPUSCHED_NATS_URL"] = f"nats://127.0.0.1:{dead}"

    started = time.monotonic()
    done = _gpusched("get", "job-000000000000", env=env)

    assert time.monotonic() - started < 5
    assert done.returncode == 3
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"gpusched: cannot reach NATS at nats://127.0.0.1:{dead} (connection refused). "
        "Is the stack up? Start it with `gpusched up`, or set GPUSCHED_NATS_URL."
    ]


def test_migrate_against_a_dead_postgres_fails_fast_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    env = _clean_env(tmp_path / "data")
    env["GPUSCHED_NATS_URL"] = f"nats://127.0.0.1:{dead}"
    env["GPUSCHED_DATABASE_URL"] = f"postgresql+asyncpg://postgres@127.0.0.1:{dead}/gpusched"

    started = time.monotonic()
    done = _gpusched("migrate", env=env)

    assert time.monotonic() - started < 5
    assert done.returncode == 3
    assert len(done.stderr.splitlines()) == 1
    assert done.stderr.startswith(
        f"gpusched: cannot reach PostgreSQL at postgresql://postgres@127.0.0.1:{dead}/"
    )


def test_the_cli_without_a_stack_says_how_to_start_one(tmp_path: Path) -> None:
    done = _gpusched("get", "job-000000000000", env=_clean_env(tmp_path / "nowhere"))

    assert done.returncode == 2
    assert len(done.stderr.splitlines()) == 1
    assert "no stack found" in done.stderr and "gpusched up" in done.stderr


@pytest.mark.timeout(300)
async def test_a_stack_brings_back_a_killed_server_and_service_and_counts_the_restarts(
    tmp_path: Path, data_dir: Path
) -> None:
    # The API a fault suite drives: Stack.kill(name) and Stack.restarts(name).
    settings = Settings(
        nats_url=None, database_url=None, subject_prefix="upfault", data_dir=data_dir
    )
    stack = Stack(settings, services=("admission",), log_dir=tmp_path / "logs")
    await asyncio.to_thread(stack.start)
    try:
        await stack.wait_until_ready(120)
        pg_port = stack.settings.database_url

        for name in ("postgres", "nats", "admission"):
            before = stack.pid(name)
            stack.kill(name)
            deadline = time.monotonic() + 60
            while stack.restarts(name) < 1:
                assert time.monotonic() < deadline, f"{name} did not come back"
                await asyncio.sleep(0.1)
            assert stack.pid(name) != before

        assert stack.settings.database_url == pg_port
        await stack.wait_until_ready(120)
        async with ApiClient(
            stack.settings.nats_url or "", "upfault", credentials=stack.settings.nats_credentials
        ) as api:
            await api.wait_until_serving()
        assert stack.failure is None
        # The stack's NATS, restarted with its configuration, takes an inventory.loaded
        # of more than ~10,000 nodes (docs/operating.md).
        client = await nats.connect(
            stack.settings.nats_url or "",
            user_credentials=str(stack.settings.nats_credentials),
        )
        try:
            assert client.max_payload == STACK_MAX_PAYLOAD
        finally:
            await client.close()
    finally:
        await asyncio.to_thread(stack.stop)


def test_the_cli_says_which_stack_file_it_cannot_read(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "stack.json").write_text("{not json")

    done = _gpusched("get", "job-000000000000", env=_clean_env(data_dir))

    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"gpusched: {data_dir / 'stack.json'} is not a valid stack file; remove it and start "
        "the stack again (`gpusched up`), or set GPUSCHED_NATS_URL"
    ]


@pytest.mark.timeout(180)
def test_up_gives_up_on_a_crash_looping_service_in_one_line_and_exits_1(
    tmp_path: Path, data_dir: Path
) -> None:
    env = _clean_env(data_dir)
    # Admission cannot start with an invalid inventory: it dies at every start (a
    # missing file is caught before anything starts, see below).
    broken = tmp_path / "broken.yaml"
    broken.write_text("nodes: 5\n")
    env["GPUSCHED_ADMISSION__INVENTORY_PATH"] = str(broken)

    started = time.monotonic()
    done = _gpusched("up", "--log-dir", str(tmp_path / "logs"), env=env, timeout=150)

    assert done.returncode == 1
    assert time.monotonic() - started < 120
    lines = [line for line in done.stderr.splitlines() if line.startswith("gpusched:")]
    assert len(lines) == 1, done.stderr
    assert "'admission' is crash-looping" in lines[0]
    assert str(tmp_path / "logs" / "admission.log") in lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert _stack_file(data_dir)["running"] is False


def test_up_outside_the_repository_names_the_missing_file_and_starts_nothing(
    tmp_path: Path,
) -> None:
    env = _clean_env(tmp_path / "data")
    env["GPUSCHED_BILLING__PRICE_BOOK_PATH"] = str(tmp_path / "no-prices.yaml")

    done = _gpusched("up", env=env)

    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"gpusched: the price book {tmp_path / 'no-prices.yaml'} does not exist (relative to "
        f"{REPO}); set GPUSCHED_BILLING__PRICE_BOOK_PATH or start gpusched from the "
        "repository's directory"
    ]
    assert not (tmp_path / "data" / "nats").exists()
