"""`python -m bench.dashboard [--out PNG]`: the cluster dashboard rendered from a real run.

Starts the whole stack (embedded NATS and PostgreSQL, every service, the simulated
cluster of deploy/inventory/demo.yaml) and Debian's `prometheus` scraping it through
the targets file `gpusched up` writes, plays a scripted day in a few minutes (training
fills the shared pool, a large job waits, inference surges and a victim that cannot
checkpoint in time is forced, the surge ends and the GPUs go back), then asks
Prometheus for every panel of deploy/grafana/dashboards/gpusched-cluster.json over the
run (query_range, the panels' own PromQL) and draws them with matplotlib, as Grafana
would lay them out. Needs the `dashboard` extra (matplotlib) and `prometheus` on PATH.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import nats
from nats.aio.client import Client as NatsClient

from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.messages import (
    GpuRequest,
    PriorityClassName,
    SubmitJob,
    SubmitReply,
    WorkloadSpec,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.embedded import free_port
from gpusched.infra.settings import Settings
from gpusched.simcluster.demand import SIM_DEMAND, InferenceDemand

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "gpusched-cluster.json"
DEFAULT_OUT = ROOT / "docs" / "img" / "cluster-dashboard.png"
# $__rate_interval at a 1 s scrape: Grafana's rule is four scrape intervals at least.
RATE_INTERVAL = "15s"

# Fast clocks, every one an ordinary setting (as in `gpusched demo`), and an SLO.
ENV = {
    "GPUSCHED_INGEST__WINDOW_S": "2",
    "GPUSCHED_INGEST__SNAPSHOT_INTERVAL_S": "0.5",
    "GPUSCHED_AGENT__TELEMETRY_INTERVAL_S": "0.5",
    "GPUSCHED_ADMISSION__SCHEDULE_INTERVAL_S": "0.25",
    "GPUSCHED_PREEMPTION__COOLDOWN_S": "5",
    "GPUSCHED_PREEMPTION__EXPAND_HOLD_S": "8",
    "GPUSCHED_PREEMPTION__SHRINK_HOLD_S": "4",
    "GPUSCHED_PREEMPTION__MIN_LEND_S": "5",
    "GPUSCHED_PREEMPTION__MIN_RUNTIME_S": "0",
    "GPUSCHED_PREEMPTION__SHARED_BELOW": "1.0",
    "GPUSCHED_PREEMPTION__SLO_MS": json.dumps({"chat": 200}),
    "GPUSCHED_CHECKPOINT__GRACE_S": "6",
    # Every class waits for the durable stage: the sweep's 30 s persist misses the grace.
    "GPUSCHED_CHECKPOINT__STAGE_REQUIRED": json.dumps(
        {"p0-urgent": "persisted", "p1-normal": "persisted", "p2-offline": "persisted"}
    ),
    "GPUSCHED_CHECKPOINT__SWEEP_INTERVAL_S": "0.25",
    "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
    "GPUSCHED_LOG_LEVEL": "WARNING",
}


def say(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


@contextmanager
def prometheus(targets: Path, scratch: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("bench.dashboard: needs `prometheus` on PATH (apt-get install prometheus)")
    config = scratch / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "gpusched",
                        "file_sd_configs": [{"files": [str(targets)], "refresh_interval": "1s"}],
                    }
                ],
            }
        )
    )
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={scratch / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=20)


@dataclass
class Driver:
    """Submits jobs as the stack's operator and sets the simulated inference demand."""

    nc: NatsClient
    subjects: Subjects

    async def submit(
        self, name: str, team: str, priority: PriorityClassName, gpus: int, checkpoint_s: float
    ) -> str:
        job = SubmitJob(
            name=name,
            team=team,
            priority_class=priority,
            gpus=GpuRequest(count=gpus),
            workload=WorkloadSpec(
                kind="sim", steps=10_000_000, step_seconds=0.05, checkpoint_seconds=checkpoint_s
            ),
        )
        msg = await self.nc.request(
            self.subjects.api_jobs_submit, job.model_dump_json().encode(), timeout=10
        )
        reply = SubmitReply.model_validate_json(msg.data)
        if not reply.ok or reply.job_id is None:
            raise SystemExit(f"bench.dashboard: submit of {name} refused: {reply.error}")
        say(f"submitted {name} ({team}, {priority}, {gpus} GPUs)")
        return reply.job_id

    async def demand(self, gpus: float) -> None:
        env = make_envelope(SIM_DEMAND, InferenceDemand(gpus=gpus), source="dashboard")
        await self.nc.jetstream().publish(
            self.subjects.command("agent", SIM_DEMAND),
            env.to_bytes(),
            headers={"Nats-Msg-Id": env.id},
        )
        say(f"inference demand {gpus:g} GPUs")


async def connect(stack: Stack, identity: str) -> NatsClient:
    assert stack.settings.nats_url
    return await nats.connect(
        stack.settings.nats_url,
        name=f"gpusched-dashboard-{identity}",
        **natsauth.connect_options(stack.credentials.get(identity)),
    )


async def scenario(stack: Stack) -> None:
    """A day of the cluster in about three minutes."""
    subjects = Subjects(stack.settings.subject_prefix)
    client = await connect(stack, natsauth.FIRST_OPERATOR)
    simulator = await connect(stack, natsauth.SIMULATOR)
    try:
        run = Driver(client, subjects)
        sim = Driver(simulator, subjects)
        await sim.demand(8.0)
        # Training fills the 40 shared GPUs; the p2 sweep checkpoints too slowly for the
        # 6 s grace, so evicting it will be forced and its work lost (and credited).
        await run.submit("sweep-lr", "research", PriorityClassName.P2_OFFLINE, 8, 30.0)
        await run.submit("llm-pretrain", "foundation", PriorityClassName.P1_NORMAL, 16, 0.2)
        await run.submit("vision-ft", "vision", PriorityClassName.P1_NORMAL, 16, 0.2)
        await asyncio.sleep(15)
        await run.submit("llm-70b", "foundation", PriorityClassName.P1_NORMAL, 32, 0.2)
        await run.submit("ablation", "research", PriorityClassName.P2_OFFLINE, 8, 0.2)
        await asyncio.sleep(20)
        await sim.demand(22.0)  # 92 % of the 24 inference GPUs
        await asyncio.sleep(60)
        await sim.demand(4.0)  # the surge ends
        await asyncio.sleep(60)
    finally:
        await client.close()
        await simulator.close()


async def query_range(
    session: aiohttp.ClientSession, url: str, expr: str, start: float, end: float
) -> list[dict[str, Any]]:
    params = {"query": expr, "start": str(start), "end": str(end), "step": "2s"}
    async with session.get(f"{url}/api/v1/query_range", params=params) as response:
        body = await response.json()
    if body.get("status") != "success":
        raise SystemExit(f"bench.dashboard: Prometheus refused {expr!r}: {body}")
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


async def panel_data(url: str, start: float, end: float) -> list[dict[str, Any]]:
    """Every panel of the dashboard with the series its queries return over the run."""
    board = json.loads(DASHBOARD.read_text())
    panels = []
    async with aiohttp.ClientSession() as session:
        for panel in board["panels"]:
            series = []
            for target in panel["targets"]:
                expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
                for found in await query_range(session, url, expr, start, end):
                    legend = target["legendFormat"]
                    for key, value in found["metric"].items():
                        legend = legend.replace("{{" + key + "}}", value)
                    points = [(float(t) - start, float(v)) for t, v in found["values"]]
                    series.append((legend, points))
            panels.append({**panel, "series": series})
    return panels


def render(panels: list[dict[str, Any]], out: Path, minutes: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plt.style.use("dark_background")
    columns = 2
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(16, 3.1 * rows), squeeze=False)
    figure.patch.set_facecolor("#111217")
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_facecolor("#181b1f")
        ax.set_title(panel["title"], loc="left", fontsize=11, color="#d8d9da")
        unit = panel["fieldConfig"]["defaults"].get("unit")
        stacked = panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
        series = [(name, points) for name, points in panel["series"] if points]
        if not series:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", color="#8e8e8e")
        elif stacked and len({len(p) for _, p in series}) == 1:
            xs = [t for t, _ in series[0][1]]
            ax.stackplot(xs, *[[v for _, v in p] for _, p in series], alpha=0.6,
                         labels=[name for name, _ in series])  # fmt: skip
        else:
            for name, points in series:
                ax.plot([t for t, _ in points], [v for _, v in points], label=name, linewidth=1.6)
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0%}"))
        elif unit:
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _, u=unit: f"{v:g} {u}"))
        ax.grid(color="#2c3235", linewidth=0.6)
        ax.tick_params(colors="#9fa7b3", labelsize=8)
        clock = FuncFormatter(lambda v, _: f"{int(v // 60)}:{int(v % 60):02d}")
        ax.xaxis.set_major_formatter(clock)
        if series:
            ax.legend(fontsize=7, loc="upper left", ncols=3, framealpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    figure.suptitle(
        f"gpusched cluster: deploy/grafana/dashboards/gpusched-cluster.json, a real run of "
        f"{minutes:.0f} min (time in m:ss)",
        color="#d8d9da",
        fontsize=13,
    )
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=80, facecolor=figure.get_facecolor())
    say(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="gpusched-dashboard-"))
    try:
        stack = Stack(
            Settings(data_dir=scratch / "data"),
            env=ENV,
            log_dir=scratch / "logs",
        )
        say("starting the stack")
        stack.start()
        try:
            asyncio.run(stack.wait_until_ready(300))
            with prometheus(stack.prometheus_targets, scratch) as url:
                start = time.time()
                asyncio.run(scenario(stack))
                end = time.time()
                time.sleep(3)  # the last scrapes
                panels = asyncio.run(panel_data(url, start, end))
        finally:
            stack.stop()
        render(panels, args.out, (end - start) / 60)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
