"""Scraping dcgm-exporter endpoints over real HTTP into ingest on the real NATS and
PostgreSQL: what is stored, refused and counted, and that one bad target never holds
up a round."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from prometheus_client import REGISTRY
from tests.support.dcgm import fixture_text, http_server, text
from tests.support.waiting import eventually

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    GpuSample,
    InventoryLoaded,
    InventoryNode,
    PoolSnapshot,
    T,
)
from gpusched.infra.embedded import free_port
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest import app
from gpusched.ingest.fold import TelemetryFold
from gpusched.ingest.polling import Sink
from gpusched.ingest.scrape import Outcome, Scraper, Target

INVENTORY = InventoryLoaded(
    nodes=[
        InventoryNode(name="inf-1", pool="inference", gpu_model="A100-80GB", gpus=2),
        InventoryNode(name="sh-1", pool="shared", gpu_model="A100-80GB", gpus=2),
    ]
)


@dataclass
class Ingest:
    runtime: ServiceRuntime
    fold: TelemetryFold

    def sink(self) -> Sink:
        """The sink a test hands the scraper: the replica's fold, as the service's."""

        async def sink(samples: list[GpuSample]) -> dict[str, str]:
            return self.fold.accept_samples(samples)

        return sink


@pytest.fixture
async def ingest(settings: Settings) -> AsyncIterator[Ingest]:
    fast = settings.model_copy(
        update={
            "ingest": IngestSettings(window_s=30.0, snapshot_interval_s=0.1, flush_interval_s=0.1)
        }
    )
    runtime = ServiceRuntime(app.NAME, app.SCHEMA, fast, migrations_dir(app.__file__))
    await runtime.start()
    fold = await app.build(runtime)
    task = asyncio.create_task(runtime.run())
    subject = runtime.subjects.event("admission", T.INVENTORY_LOADED)
    envelope = make_envelope(T.INVENTORY_LOADED, INVENTORY, source="test")
    await runtime.js.publish(subject, envelope.to_bytes())

    async def inventory_applied() -> bool:
        return fold.membership is not None and "inf-1" in fold.membership.nodes

    try:
        await eventually(inventory_applied)
        yield Ingest(runtime, fold)
    finally:
        runtime.request_stop()
        await asyncio.wait_for(task, 15)


async def snapshot_where(rt: ServiceRuntime, reporting: dict[str, int]) -> PoolSnapshot:
    """The first pool snapshot with these reporting-GPU counts per pool."""
    sub = await rt.js.subscribe(
        rt.subjects.event("ingest", T.POOL_SNAPSHOT),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        manual_ack=False,
    )
    last: PoolSnapshot | None = None
    try:
        for _ in range(400):
            try:
                msg = await sub.next_msg(timeout=20)
            except NatsTimeout:
                break
            last = Envelope.from_bytes(msg.data).payload(PoolSnapshot)
            if {p.pool: p.reporting_gpus for p in last.pools} == reporting:
                return last
    finally:
        await sub.unsubscribe()
    raise AssertionError(f"no snapshot reporting {reporting} (last: {last!r})")


def scrapes(outcome: Outcome) -> float:
    return REGISTRY.get_sample_value("gpusched_ingest_scrapes_total", {"outcome": outcome}) or 0.0


async def test_a_round_folds_the_good_targets_and_counts_each_bad_one(
    ingest: Ingest,
) -> None:
    release = asyncio.Event()

    async def hangs(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="")

    routes = {
        "/sh-1": text(fixture_text()),  # Hostname node-a; the target names it sh-1
        "/inf-1": text(fixture_text("inf-1")),
        "/stranger": text(fixture_text("stranger")),  # not in the inventory
        "/hangs": hangs,
        "/error": text("upstream broke", status=500),
        "/garbage": text("<html>this is not an exporter</html>\n{{{"),
        "/huge": text("# " + "x" * 200_000 + "\n"),
    }
    before = {o: scrapes(o) for o in Outcome}
    async with http_server(routes) as base, aiohttp.ClientSession() as session:
        targets = [
            Target(f"{base}/sh-1", node="sh-1"),
            Target(f"{base}/inf-1"),
            Target(f"{base}/stranger"),
            Target(f"{base}/hangs", node="hung-1"),
            Target(f"{base}/error", node="err-1"),
            Target(f"{base}/garbage", node="junk-1"),
            Target(f"{base}/huge", node="huge-1"),
            Target(f"http://127.0.0.1:{free_port()}/metrics", node="gone-1"),
        ]
        scraper = Scraper(
            session,
            ingest.sink(),
            interval_s=3.0,
            timeout_s=0.5,
            concurrency=4,
            max_body_bytes=100_000,
        )
        report = await scraper.scrape_round(targets)
        release.set()

    assert report.outcomes == {
        "sh-1": Outcome.OK,
        f"{base}/inf-1": Outcome.OK,
        f"{base}/stranger": Outcome.REFUSED,
        "hung-1": Outcome.TIMEOUT,
        "err-1": Outcome.HTTP_ERROR,
        "junk-1": Outcome.UNPARSABLE,
        "huge-1": Outcome.TOO_LARGE,
        "gone-1": Outcome.UNREACHABLE,
    }
    assert "not in the inventory" in report.details[f"{base}/stranger"]
    assert report.details["err-1"] == "HTTP 500"
    assert report.refused.keys() == {"stranger"}
    counted = {o: scrapes(o) - before[o] for o in Outcome}
    assert counted == {
        Outcome.OK: 2,
        Outcome.REFUSED: 1,
        Outcome.TIMEOUT: 1,
        Outcome.HTTP_ERROR: 1,
        Outcome.UNPARSABLE: 1,
        Outcome.TOO_LARGE: 1,
        Outcome.UNREACHABLE: 1,
        Outcome.ERROR: 0,
    }
    # Both known nodes' two GPUs (the fixture's NaN GPU 2 is refused by the parser).
    snapshot = await snapshot_where(ingest.runtime, {"inference": 2, "shared": 2})
    by_pool = {p.pool: p for p in snapshot.pools}
    assert by_pool["shared"].util == pytest.approx((0.87 + 0.5) / 2)
    assert "stranger" not in ingest.fold.window.node_names()


async def test_a_target_slower_than_the_round_is_cut_off_and_the_rest_still_go(
    ingest: Ingest,
) -> None:
    """More targets than slots, most of them hung past the round: the round still ends,
    hands the good page over, and counts every hung target as a timeout."""
    release = asyncio.Event()

    async def hangs(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="")

    routes = {"/good": text(fixture_text()), "/hangs": hangs}
    async with http_server(routes) as base, aiohttp.ClientSession() as session:
        hung = [Target(f"{base}/hangs", node=f"hung-{i}") for i in range(6)]
        # The per-target timeout alone (3 waves of 2 slots x 1.5 s) would outlast the
        # fetch phase of a 2 s interval: the round's own deadline ends it.
        scraper = Scraper(
            session,
            ingest.sink(),
            interval_s=2.0,
            timeout_s=1.5,
            concurrency=2,
            max_body_bytes=100_000,
        )
        report = await scraper.scrape_round([Target(f"{base}/good", node="sh-1"), *hung])
        release.set()

    assert report.outcomes["sh-1"] is Outcome.OK
    assert {report.outcomes[t.key] for t in hung} == {Outcome.TIMEOUT}
    assert "not scraped in the round" in {report.details[t.key] for t in hung}
    await snapshot_where(ingest.runtime, {"inference": 0, "shared": 2})


async def test_a_target_that_stays_down_is_logged_once_and_once_when_it_is_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    healthy = True

    async def flaky(_: web.Request) -> web.Response:
        if healthy:
            return web.Response(text=fixture_text())
        return web.Response(status=503)

    stored: list[list[GpuSample]] = []

    async def sink(samples: list[GpuSample]) -> dict[str, str]:
        stored.append(samples)
        return {}

    caplog.set_level(logging.INFO, logger="gpusched.ingest.scrape")
    async with http_server({"/flaky": flaky}) as base, aiohttp.ClientSession() as session:
        scraper = Scraper(
            session, sink, interval_s=2.0, timeout_s=1.0, concurrency=2, max_body_bytes=100_000
        )
        target = [Target(f"{base}/flaky", node="n-1")]
        await scraper.scrape_round(target)
        healthy = False
        for _ in range(3):
            await scraper.scrape_round(target)
        healthy = True
        await scraper.scrape_round(target)
        await scraper.scrape_round(target)

    lines = [r.getMessage() for r in caplog.records if r.name == "gpusched.ingest.scrape"]
    assert lines == [
        f"scrape target n-1: http_error: {base}/flaky: HTTP 503",
        "scrape target n-1: ok again (was http_error)",
    ]
    assert [len(s) for s in stored] == [1, 1, 1]


async def test_the_scrape_loop_goes_on_when_a_round_fails() -> None:
    """A sink that raises loses its round's readings, not the loop."""
    calls: list[int] = []

    async def failing_sink(samples: list[GpuSample]) -> dict[str, str]:
        calls.append(len(samples))
        raise RuntimeError("database away")

    stop = asyncio.Event()
    async with http_server({"/m": text(fixture_text())}) as base, aiohttp.ClientSession() as s:
        scraper = Scraper(
            s, failing_sink, interval_s=0.5, timeout_s=0.4, concurrency=2, max_body_bytes=100_000
        )

        async def targets() -> list[Target]:
            if len(calls) >= 3:
                stop.set()
            return [Target(f"{base}/m", node="n-1")]

        await asyncio.wait_for(scraper.run(targets, stop), 30)
    assert calls[:3] == [1, 1, 1]
