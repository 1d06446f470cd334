"""`gpusched up` as an operator runs it: everything starts, SIGTERM stops everything."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil

from gpusched.cli.client import ApiClient

REPO = Path(__file__).resolve().parents[2]


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def test_up_serves_the_api_and_sigterm_leaves_no_process_and_frees_the_ports(
    tmp_path: Path,
) -> None:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("GPUSCHED_")  # embedded servers, whatever the caller set
    }  # fmt: skip
    env.update({"GPUSCHED_DATA_DIR": str(tmp_path / "data"), "GPUSCHED_LOG_LEVEL": "WARNING"})
    # A blocking Popen in an async test on purpose: this process only waits on it.
    up = subprocess.Popen(  # noqa: ASYNC220
        [sys.executable, "-m", "gpusched.cli.main", "up", "--log-dir", str(tmp_path / "logs")],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert up.stdout is not None
        banner = ""
        deadline = time.monotonic() + 60
        while "gpusched is up" not in banner and time.monotonic() < deadline:
            banner = up.stdout.readline()
            assert banner or up.poll() is None, "gpusched up exited early"
        match = re.search(r"NATS (nats://127\.0\.0\.1:(\d+)), PostgreSQL \S+:(\d+)/", banner)
        assert match, banner
        nats_url, nats_port, pg_port = match.group(1), int(match.group(2)), int(match.group(3))

        children = psutil.Process(up.pid).children(recursive=True)
        assert len(children) >= 8  # NATS, PostgreSQL and six services (and their helpers)
        async with ApiClient(nats_url) as api:
            await api.wait_until_serving()
            reply = await api.get("job-000000000000")
        assert not reply.ok and reply.error and reply.error.code == "not_found"

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.info if hasattr(p, "info") else p.pid for p in alive]
        assert _port_free(nats_port) and _port_free(pg_port)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
