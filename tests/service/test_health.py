"""Each service's /livez, /readyz and /metrics, served on its event loop, against the
real NATS and PostgreSQL: ready only once running with every consumer advancing, not
alive while the loop is wedged."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import BaseModel
from tests.support.waiting import eventually

from gpusched.billing import app
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.infra import bus, probe, runtime
from gpusched.infra.db import UnitOfWork
from gpusched.infra.embedded import free_port
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

REPO = Path(__file__).resolve().parents[2]


class Probe(BaseModel):
    n: int = 0


def billing_settings(settings: Settings) -> Settings:
    return settings.model_copy(
        update={
            "metrics_port": free_port(),
            "billing": settings.billing.model_copy(
                update={"price_book_path": REPO / "deploy" / "prices.yaml"}
            ),
        }
    )


@pytest.fixture
async def started(settings: Settings) -> AsyncIterator[ServiceRuntime]:
    """Billing connected and migrated, not built or running yet."""
    rt = ServiceRuntime(
        app.NAME, app.SCHEMA, billing_settings(settings), app.migrations_dir(app.__file__)
    )
    await rt.start()
    yield rt
    await rt.close()


async def get(rt: ServiceRuntime, path: str) -> tuple[int, str]:
    url = f"http://127.0.0.1:{rt.settings.metrics_port}{path}"
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(url) as response,
    ):
        return response.status, await response.text()


async def readiness(rt: ServiceRuntime) -> dict[str, Any]:
    status, body = await get(rt, "/readyz")
    verdict: dict[str, Any] = json.loads(body)
    assert (status == 200) is verdict["ready"]
    return verdict


async def test_a_service_is_alive_while_it_builds_and_ready_only_once_it_runs(
    started: ServiceRuntime,
) -> None:
    assert await get(started, "/livez") == (200, "ok\n")
    building = await readiness(started)
    assert building == {
        "service": "billing",
        "ready": False,
        "stage": "building",
        "problems": ["billing is building"],
    }

    await app.build(started)
    task = asyncio.create_task(started.run())
    try:
        ready = await eventually(lambda: _ready(started), within=15)
        assert ready["stage"] == "running" and ready["problems"] == []
        status, text = await get(started, "/metrics")
        assert status == 200
        assert 'gpusched_up{service="billing"} 1.0' in text
    finally:
        started.request_stop()
        await asyncio.wait_for(task, 15)


async def test_the_container_probe_says_ready_or_what_the_service_waits_for(
    started: ServiceRuntime,
) -> None:
    env = {"GPUSCHED_METRICS_PORT": str(started.settings.metrics_port)}
    assert await asyncio.to_thread(probe.probe, "livez", env) == (True, "livez: ok")
    assert await asyncio.to_thread(probe.probe, "readyz", env) == (
        False,
        "readyz: billing is building",
    )
    await app.build(started)
    task = asyncio.create_task(started.run())
    try:
        await eventually(lambda: _ready(started), within=15)
        assert await asyncio.to_thread(probe.probe, "readyz", env) == (True, "readyz: ok")
    finally:
        started.request_stop()
        await asyncio.wait_for(task, 15)
    ok, line = await asyncio.to_thread(probe.probe, "readyz", env)
    assert not ok and line.startswith("readyz: no answer from http://127.0.0.1:")


async def test_a_consumer_stuck_on_a_message_makes_the_service_not_ready(
    started: ServiceRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = asyncio.Event()

    async def hangs(envelope: Envelope, uow: UnitOfWork) -> None:
        await release.wait()

    s = started.subjects
    started.consume(
        bus.Consumer(
            durable="billing-health-probe",
            stream=s.stream("COMMANDS"),
            subjects=[s.command("billing", "health.probe")],
            handlers={"health.probe": hangs},
        )
    )
    task = asyncio.create_task(started.run())
    try:
        await eventually(lambda: _ready(started), within=15)
        monkeypatch.setattr(runtime, "CONSUMER_STALL_S", 0.5)
        envelope = make_envelope("health.probe", Probe(), source="test")
        await started.js.publish(
            s.command("billing", "health.probe"),
            envelope.to_bytes(),
            headers={"Nats-Msg-Id": envelope.id},
        )
        stuck = await eventually(lambda: _not_ready(started), within=15)
        [problem] = stuck["problems"]
        assert problem.startswith("consumer billing-health-probe has not advanced for")
        release.set()
        await eventually(lambda: _ready(started), within=15)
    finally:
        release.set()
        started.request_stop()
        await asyncio.wait_for(task, 15)


async def test_a_wedged_event_loop_fails_the_liveness_probe(started: ServiceRuntime) -> None:
    url = f"http://127.0.0.1:{started.settings.metrics_port}/livez"

    def probe() -> int | str:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as response:
                return int(response.status)
        except (urllib.error.URLError, TimeoutError) as exc:
            return type(exc).__name__

    assert await asyncio.to_thread(probe) == 200
    loop = asyncio.get_running_loop()
    answer = loop.run_in_executor(None, probe)
    # A blocking call on the loop: what a wedged service does.
    time.sleep(2.5)  # noqa: ASYNC251
    assert await answer in ("TimeoutError", "URLError")
    assert await asyncio.to_thread(probe) == 200


async def _ready(rt: ServiceRuntime) -> dict[str, Any] | None:
    verdict = await readiness(rt)
    return verdict if verdict["ready"] else None


async def _not_ready(rt: ServiceRuntime) -> dict[str, Any] | None:
    verdict = await readiness(rt)
    return None if verdict["ready"] else verdict
