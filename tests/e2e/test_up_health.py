"""`gpusched up` and the services' health endpoints: one metrics port per service (no
clash with GPUSCHED_METRICS_PORT set), progress while the services start, "ready" only
once every service's /readyz says so, and no Alembic chatter."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gpusched.cli.stack import SERVICES
from gpusched.infra.embedded import free_port
from tests.e2e.test_up import Up, _clean_env, _port_free, data_dir, ups  # noqa: F401  (fixtures)


def _free_run(length: int) -> int:
    """The first of `length` consecutive free ports, below the kernel's ephemeral range
    (as free_port picks): a run drawn from that range can be taken by any outgoing
    connection before the services bind it (a CI run's agent crash-looped so)."""
    for _ in range(50):
        base = free_port()
        if all(_port_free(base + i) for i in range(length)):
            return base
    raise AssertionError("no run of free ports")


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.timeout(300)
def test_up_gives_each_service_its_metrics_port_and_says_ready_once_every_service_is(
    tmp_path: Path,
    data_dir: Path,  # noqa: F811  (the fixture imported above)
    ups: list[Up],  # noqa: F811
) -> None:
    base = _free_run(len(SERVICES))
    env = {
        **_clean_env(data_dir),
        "GPUSCHED_METRICS_PORT": str(base),  # the README's clash: every service on one port
        "GPUSCHED_LOG_LEVEL": "INFO",  # Alembic's INFO lines would show at this level
    }
    up = Up(env, tmp_path / "logs")
    ups.append(up)
    up.wait_ready()
    printed = "".join(up.lines)

    ports = {service: base + i for i, service in enumerate(SERVICES)}
    stack = json.loads((data_dir / "stack.json").read_text())
    assert stack["metrics_ports"] == ports
    # When `up` says ready, every service says so itself.
    for service, port in ports.items():
        status, body = _get(port, "/readyz")
        assert status == 200, (service, body)
        assert json.loads(body) == {
            "service": service,
            "ready": True,
            "stage": "running",
            "problems": [],
        }
        assert _get(port, "/livez") == (200, "ok\n")
        status, text = _get(port, "/metrics")
        assert status == 200 and f'gpusched_up{{service="{service}"}} 1.0' in text
    # Progress meanwhile: what each service waited for, then that it is ready, before
    # the banner.
    banner_at = printed.index("is up and ready")
    for service in SERVICES:
        assert f"] {service:<11}ready" in printed[:banner_at], printed
    assert "is starting" in printed[:banner_at] or "is migrating" in printed[:banner_at]
    assert "alembic" not in printed.lower()
    assert "Address already in use" not in printed
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "alembic" not in logs.lower() and "Address already in use" not in logs

    targets = json.loads((data_dir / "prometheus" / "targets.json").read_text())
    assert {t["labels"]["component"]: t["targets"] for t in targets} == {
        service: [f"127.0.0.1:{port}"] for service, port in ports.items()
    }
    assert up.terminate() == 0
    assert all(_port_free(port) for port in ports.values())
