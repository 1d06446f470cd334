"""A real Prometheus (Debian's `prometheus`) scraping every service of a running stack
and evaluating deploy/prometheus/alerts.yml through a scripted surge: the alerts the
scenario should raise fire, every other rule stays quiet.

The rules are the shipped ones with every duration divided by SCALE (a `for: 10m`
becomes 10 s, a `[5m]` window 5 s, the 30-minute queue-wait threshold 30 s), so the
scenario takes a minute instead of hours; thresholds that are not durations are kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from gpusched.cli.stack import SERVICES, Stack
from gpusched.contracts.messages import PriorityClassName
from gpusched.infra.settings import Settings
from tests.e2e.test_main_flow import FAST, Cluster, cluster_on
from tests.support.dcgm import PROMETHEUS, Prometheus, prometheus_server
from tests.support.stacks import ready
from tests.support.waiting import eventually

ALERTS = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "alerts.yml"
SCALE = 60
# The scenario: training fills part of the shared pool, a job too large for what is
# left waits, and inference demand surges to 92 % of its pool; the controller holds the
# surge for EXPAND_HOLD_S before it lends shared GPUs, which brings P99 back down.
EXPAND_HOLD_S = 15
SLO_MS = 200.0
EXPECTED = {"InferenceP99NearSlo", "TrainingQueueWaitLong", "GpuIdleFragmentation"}

NO_PROMETHEUS = "no `prometheus` on PATH (Debian: apt-get install prometheus; `make test` does)"


def _scaled(duration: str) -> str:
    value, unit = int(duration[:-1]), duration[-1]
    seconds = value * {"s": 1, "m": 60, "h": 3600}[unit]
    return f"{max(1, seconds // SCALE)}s"


def scaled_rules(text: str) -> str:
    """alerts.yml with every duration (for:, range windows, the queue-wait threshold in
    seconds) divided by SCALE."""
    rules = yaml.safe_load(text)
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = _scaled(rule["for"])
            expr = re.sub(r"\[(\d+[smh])\]", lambda m: f"[{_scaled(m.group(1))}]", rule["expr"])
            if rule["alert"] == "TrainingQueueWaitLong":
                expr, count = re.subn(r"> 1800\b", f"> {1800 // SCALE}", expr)
                assert count == 1, "the queue-wait threshold moved; scale it here too"
            rule["expr"] = expr
    return yaml.safe_dump(rules, sort_keys=False)


def rule_names() -> set[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {rule["alert"] for group in rules["groups"] for rule in group["rules"]}


@dataclass
class AlertLog:
    """Every alert seen firing, with its labels, polled from Prometheus."""

    firing: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    now_firing: set[str] = field(default_factory=set)

    def note(self, alerts: list[dict[str, Any]]) -> None:
        self.now_firing = set()
        for alert in alerts:
            if alert["state"] == "firing":
                name = alert["labels"]["alertname"]
                self.now_firing.add(name)
                self.firing.setdefault(name, []).append(alert["labels"])


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Prometheus, Path]]:
    """Prometheus with the scaled rules, scraping the targets file the stack writes."""
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    targets = tmp_path / "data" / "prometheus" / "targets.json"

    def config(scratch: Path) -> str:
        (scratch / "alerts.yml").write_text(scaled_rules(ALERTS.read_text()))
        return json.dumps(
            {
                "global": {
                    "scrape_interval": "1s",
                    "scrape_timeout": "1s",
                    "evaluation_interval": "1s",
                },
                "rule_files": [str(scratch / "alerts.yml")],
                "scrape_configs": [
                    {
                        "job_name": "gpusched",
                        "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                    }
                ],
            }
        )

    with prometheus_server(config) as server:
        yield server, targets


@pytest.fixture
async def stack(settings: Settings, tmp_path: Path) -> AsyncIterator[Stack]:
    running = Stack(
        settings.model_copy(update={"data_dir": tmp_path / "data"}),
        env={
            **FAST,
            "GPUSCHED_PREEMPTION__EXPAND_HOLD_S": str(EXPAND_HOLD_S),
            "GPUSCHED_PREEMPTION__SLO_MS": json.dumps({"chat": SLO_MS}),
        },
        log_dir=tmp_path / "logs",
    )
    async with ready(running):
        yield running


async def query(session: aiohttp.ClientSession, url: str, expr: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/api/v1/query", params={"query": expr}) as response:
        body = await response.json()
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def value_of(session: aiohttp.ClientSession, url: str, expr: str) -> float | None:
    result = await query(session, url, expr)
    return float(result[0]["value"][1]) if result else None


@pytest.mark.timeout(420)
async def test_a_real_prometheus_fires_the_surge_alerts_and_keeps_the_others_quiet(
    stack: Stack, prometheus: tuple[Prometheus, Path]
) -> None:
    server, targets = prometheus
    assert targets == stack.prometheus_targets
    log = AlertLog()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        url = server.url

        async def every_service_scraped() -> bool:
            server.check_running()
            try:
                up = await query(session, url, 'up{job="gpusched"} == 1')
                services = await query(session, url, "gpusched_up == 1")
            except aiohttp.ClientError:
                return False  # not listening yet
            return len(up) == len(SERVICES) and len(services) == len(SERVICES)

        await eventually(every_service_scraped, within=60)
        # What the rules said before the first scrapes (every series absent) is
        # re-evaluated within a couple of evaluation intervals.
        await asyncio.sleep(3)

        async def watch() -> None:
            while True:
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(f"{url}/api/v1/alerts") as response:
                        log.note((await response.json())["data"]["alerts"])
                await asyncio.sleep(0.5)

        watcher = asyncio.create_task(watch())
        try:
            async for cluster in cluster_on(stack.settings):
                await run_scenario(cluster, session, url, log)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    assert set(log.firing) >= EXPECTED, server.log_tail()
    quiet = rule_names() - EXPECTED
    fired_wrongly = {name: log.firing[name][:3] for name in quiet & set(log.firing)}
    assert not fired_wrongly, fired_wrongly
    assert {labels["service"] for labels in log.firing["InferenceP99NearSlo"]} == {"chat"}
    assert {labels["team"] for labels in log.firing["TrainingQueueWaitLong"]} == {"e2e"}
    idle = {labels["pool"] for labels in log.firing["GpuIdleFragmentation"]}
    assert idle <= {"inference", "shared"} and "shared" in idle


async def run_scenario(
    cluster: Cluster, session: aiohttp.ClientSession, url: str, log: AlertLog
) -> None:
    offline = await cluster.submit("offline", PriorityClassName.P2_OFFLINE, 8)
    normal = await cluster.submit("normal", PriorityClassName.P1_NORMAL, 16)
    for job in (offline, normal):
        await eventually(lambda job=job: _is_running(cluster, job), within=60)
    # 16 of the 40 shared GPUs are left: a 32-GPU job waits.
    await cluster.submit("too-large", PriorityClassName.P1_NORMAL, 32)

    async def waiting() -> float | None:
        return await value_of(session, url, 'gpusched_queue_jobs{team="e2e",class="p1-normal"}')

    assert await eventually(waiting, within=30) == 1

    await cluster.demand(22.0)  # 22 GPUs of work on 24 inference GPUs: P99 ~370 ms
    await eventually(lambda: _firing(log, "InferenceP99NearSlo"), within=60)

    # The controller lends shared GPUs after its hold; P99 falls and the alert resolves.
    async def lent() -> float | None:
        found = await value_of(
            session, url, 'sum(gpusched_gpus{pool="shared",state=~"lent|reserved"})'
        )
        return found if found else None

    assert await eventually(lent, within=60) == 8
    expansions = 'sum(gpusched_controller_decisions_total{decision="expand"})'
    assert await eventually(lambda: value_of(session, url, expansions), within=10) == 1
    await eventually(lambda: _resolved(log, "InferenceP99NearSlo"), within=60)

    await eventually(lambda: _firing(log, "TrainingQueueWaitLong"), within=60)
    await eventually(lambda: _firing(log, "GpuIdleFragmentation"), within=60)
    # The surge's own figures, as the dashboard shows them.
    assert await value_of(session, url, 'max(gpusched_pool_utilization{pool="inference"})')
    assert await value_of(session, url, 'max(gpusched_inference_slo_ms{service="chat"})') == SLO_MS


async def _is_running(cluster: Cluster, job_id: str) -> bool:
    return await cluster.state(job_id) == "running"


async def _firing(log: AlertLog, name: str) -> bool:
    return name in log.firing


async def _resolved(log: AlertLog, name: str) -> bool:
    return name in log.firing and name not in log.now_firing
