"""dcgm scrape: 1,000 dcgm-exporter endpoints scraped every 5 s from one process.

The exporters are real HTTP servers in a child process (bench/dcgm_exporters.py), one
port each, serving an 8-GPU page of every default counter. Rounds of `Scraper`
(fetch, parse with ingest.dcgm, hand the round's samples to a sink that records when
it got them) alternate with baseline rounds: the same GETs through the same client
settings and concurrency, the body read and nothing else. Each round starts on a 5 s
tick, as the service's loop does.

scrape-to-sink: from a round's tick (when every target is due) to the sink holding
its samples; the sink takes a round at once, so within a round every target's figure
is that round's. CPU: this process's CPU time over the round, per target.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp

from bench.harness import Context, Figure, percentile
from gpusched.contracts.messages import GpuSample
from gpusched.infra.settings import IngestSettings
from gpusched.ingest import scrape

BENCH = "dcgm"
ENDPOINTS = int(os.environ.get("BENCH_DCGM_ENDPOINTS", "1000"))
ROUNDS = int(os.environ.get("BENCH_DCGM_ROUNDS", "6"))
INTERVAL_S = float(os.environ.get("BENCH_DCGM_INTERVAL", "5"))
CONCURRENCY = int(
    os.environ.get("BENCH_DCGM_CONCURRENCY", str(IngestSettings().scrape_concurrency))
)
TIMEOUT_S = IngestSettings().scrape_timeout_s
GPUS = 8


@dataclass(frozen=True)
class Round:
    to_sink_s: float  # tick -> the sink has the round (baseline: -> last body read)
    cpu_ms_per_target: float
    ok: int


class RecordingSink:
    def __init__(self) -> None:
        self.readings = 0

    async def __call__(self, samples: list[GpuSample]) -> dict[str, str]:
        self.readings += sum(len(s.gpus) for s in samples)
        return {}


async def raw_round(
    session: aiohttp.ClientSession, urls: list[str], started: float, cpu0: float
) -> Round:
    slots = asyncio.Semaphore(CONCURRENCY)

    async def get(url: str) -> bool:
        async with slots:
            try:
                async with asyncio.timeout(TIMEOUT_S):
                    async with session.get(url) as resp:
                        await resp.read()
                        return resp.status == 200
            except (TimeoutError, aiohttp.ClientError, OSError):
                return False

    ok = sum(await asyncio.gather(*(get(u) for u in urls)))
    return Round(time.monotonic() - started, _cpu_ms(cpu0, len(urls)), ok)


async def scrape_round(
    scraper: scrape.Scraper, targets: list[scrape.Target], started: float, cpu0: float
) -> Round:
    report = await scraper.scrape_round(targets)
    if report.sink_at_s is None:
        raise RuntimeError("the round handed nothing to the sink: see the scrape log")
    ok = sum(o is scrape.Outcome.OK for o in report.outcomes.values())
    return Round(report.sink_at_s, _cpu_ms(cpu0, len(targets)), ok)


def _cpu_ms(cpu0: float, targets: int) -> float:
    return (time.process_time() - cpu0) * 1000 / targets


def start_exporters(ctx: Context) -> tuple[subprocess.Popen[str], list[tuple[str, str]]]:
    ctx.progress(f"dcgm: starting {ENDPOINTS} exporters ({GPUS} GPUs each)")
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.dcgm_exporters", "--count", str(ENDPOINTS)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # the child prints once ready, or exits
    if not line:
        child.wait(timeout=10)
        raise RuntimeError(f"the exporters exited ({child.returncode}) before listening")
    return child, [(node, url) for node, url in json.loads(line)]


async def run(ctx: Context) -> list[Figure]:
    child, endpoints = start_exporters(ctx)
    try:
        return await measure(ctx, endpoints)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        try:
            child.wait(timeout=15)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=10)


async def measure(ctx: Context, endpoints: list[tuple[str, str]]) -> list[Figure]:
    urls = [url for _, url in endpoints]
    targets = [scrape.Target(url, node) for node, url in endpoints]
    sink = RecordingSink()
    raw: list[Round] = []
    scraped: list[Round] = []
    loop = asyncio.get_running_loop()
    async with (
        scrape.client_session(CONCURRENCY, INTERVAL_S) as raw_session,
        scrape.client_session(CONCURRENCY, INTERVAL_S) as scrape_session,
    ):
        scraper = scrape.Scraper(
            scrape_session,
            sink,
            interval_s=INTERVAL_S,
            timeout_s=TIMEOUT_S,
            concurrency=CONCURRENCY,
            max_body_bytes=IngestSettings().scrape_max_body_bytes,
        )
        tick = loop.time()
        for r in range(ROUNDS):
            # Alternate which side goes first, so neither always meets a warmer machine.
            for side in ("raw", "scrape") if r % 2 == 0 else ("scrape", "raw"):
                await asyncio.sleep(max(0.0, tick - loop.time()))
                started, cpu0 = time.monotonic(), time.process_time()
                if side == "raw":
                    raw.append(await raw_round(raw_session, urls, started, cpu0))
                else:
                    scraped.append(await scrape_round(scraper, targets, started, cpu0))
                done = (raw if side == "raw" else scraped)[-1]
                ctx.progress(
                    f"dcgm: round {r + 1} {side}: {done.to_sink_s:.2f} s, "
                    f"{done.cpu_ms_per_target:.2f} ms CPU/target, {done.ok}/{len(urls)} ok"
                )
                tick += INTERVAL_S
    per_target_latency = [rnd.to_sink_s for rnd in scraped for _ in urls]
    per_target_raw = [rnd.to_sink_s for rnd in raw for _ in urls]
    figures = [
        Figure(
            BENCH,
            "scrape_to_sink_p99",
            percentile(per_target_latency, 99),
            "s",
            percentile(per_target_raw, 99),
        ),
        Figure(
            BENCH,
            "cpu_per_scrape",
            sum(r.cpu_ms_per_target for r in scraped) / len(scraped),
            "ms",
            sum(r.cpu_ms_per_target for r in raw) / len(raw),
        ),
        Figure(BENCH, "scraped_ok_min", min(r.ok for r in scraped) / len(urls), "fraction"),
        Figure(BENCH, "readings_per_round", sink.readings / len(scraped), "GPU readings"),
    ]
    # Not a result: what else the machine ran, to read the others by.
    figures.append(Figure(BENCH, "machine_load_1m", os.getloadavg()[0], "runnable tasks"))
    figures += [
        Figure(BENCH, f"scrape_to_sink.round{i + 1}", s.to_sink_s, "s", b.to_sink_s)
        for i, (s, b) in enumerate(zip(scraped, raw, strict=True))
    ]
    return figures
