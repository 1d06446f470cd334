"""Prometheus metrics shared by every service, and the HTTP endpoint of each process.

One port per process (`GPUSCHED_METRICS_PORT`) serves `/metrics`, `/livez` and
`/readyz` (health.py), on the service's own event loop: a loop that stops turning stops
answering all three, so a wedged service fails its liveness probe.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gpusched.infra.health import Health

log = logging.getLogger(__name__)

MESSAGES = Counter(
    "gpusched_messages_total",
    "Messages taken from the bus, by consumer, type and outcome",
    ["service", "consumer", "type", "outcome"],
)
HANDLER_SECONDS = Histogram(
    "gpusched_handler_seconds",
    "Time to apply one message (transaction included)",
    ["service", "consumer"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
DEAD_LETTERS = Counter(
    "gpusched_dead_letters_total", "Messages sent to the dead-letter subject", ["service", "reason"]
)
OUTBOX_PUBLISHED = Counter(
    "gpusched_outbox_published_total", "Outbox rows published to JetStream", ["service"]
)
OUTBOX_LAG = Histogram(
    "gpusched_outbox_lag_seconds",
    "Commit-to-publish latency of outbox rows",
    ["service"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
OUTBOX_OLDEST_UNPUBLISHED = Gauge(
    "gpusched_outbox_oldest_unpublished_seconds",
    "Age of the oldest outbox row not yet published (0 when the outbox is empty)",
    ["service"],
)
OUTBOX_UNPUBLISHED = Gauge(
    "gpusched_outbox_unpublished_rows", "Outbox rows not yet published", ["service"]
)
OUTBOX_PARKED = Counter(
    "gpusched_outbox_parked_total",
    "Outbox rows set aside in outbox_parked because NATS refused them for what they are",
    ["service"],
)
OUTAGES = Counter(
    "gpusched_outages_total",
    "Times a component found PostgreSQL or NATS unreachable and began waiting it out",
    ["service", "component"],
)
OUTAGE_ACTIVE = Gauge(
    "gpusched_outage_active",
    "1 while a component waits out an outage of PostgreSQL or NATS",
    ["service", "component"],
)
API_REQUESTS = Counter(
    "gpusched_api_requests_total",
    "Request/reply calls, by subject and outcome",
    ["service", "subject", "outcome"],
)
UP = Gauge("gpusched_up", "1 while the service is running", ["service"])
ACCESS_REFUSED = Counter(
    "gpusched_access_refused_total",
    "API requests refused as forbidden for the caller's identity, by action",
    ["service", "action"],
)


# A scrape in two steps. The source runs on the event loop, between two awaits of
# whoever changes the state it reads, and copies what it needs; the builder it returns
# makes the metric families from that copy in a worker thread, where the (per-sample,
# slow) building and formatting no longer stalls the loop.
Build = Callable[[], Iterable[Metric]]
ScrapeSource = Callable[[], Build]


class _ScrapeSources(Collector):
    """Metrics computed when scraped, from state a service already holds in memory (a
    queue, a ledger, a telemetry window): nothing is kept up to date per message."""

    def __init__(self) -> None:
        self.sources: dict[str, ScrapeSource] = {}
        self._prepared: dict[str, Build] = {}
        self._failing: set[str] = set()

    def describe(self) -> Iterable[Metric]:
        return ()  # the families vary with the state; nothing to check at registration

    def prepare(self) -> None:
        """Take every source's copy of its state (on the event loop)."""
        self._prepared = {}
        for name, source in list(self.sources.items()):
            try:
                self._prepared[name] = source()
            except Exception:
                self._failed(name)

    def collect(self) -> Iterable[Metric]:
        for name, build in list(self._prepared.items()):
            try:
                families = list(build())
            except Exception:
                self._failed(name)
                continue
            self._failing.discard(name)
            yield from families

    def _failed(self, name: str) -> None:
        # One failing source costs its own metrics, never the scrape; logged once.
        if name not in self._failing:
            log.exception("metrics source %s failed; its metrics are left out", name)
            self._failing.add(name)


_SCRAPED = _ScrapeSources()
REGISTRY.register(_SCRAPED)


def gauge_family(name: str, documentation: str, *labels: str) -> GaugeMetricFamily:
    """An empty gauge family for a scrape source to fill (`add_metric(values, value)`)."""
    return GaugeMetricFamily(name, documentation, labels=list(labels))


def on_scrape(name: str, source: ScrapeSource) -> None:
    """At every scrape, call `source` on the event loop and the builder it returns in a
    worker thread (see Build). Registering a name again replaces its source: a process
    that runs a service twice (a test) reports the latest."""
    _SCRAPED.sources[name] = source


def exposition() -> bytes:
    """The text of /metrics, synchronously (tests, benchmarks): both steps in a row."""
    _SCRAPED.prepare()
    return generate_latest(REGISTRY)


class HealthServer:
    """`/metrics`, `/livez` and `/readyz` of one process, served on its event loop."""

    def __init__(self, health: Health) -> None:
        self._health = health
        self._runner: web.AppRunner | None = None
        # One scrape at a time: the prepared copies belong to the scrape that took them.
        self._scraping = asyncio.Lock()

    async def start(self, host: str, port: int) -> None:
        """Listen on host:port; port 0 means no endpoint at all (the setting's default)."""
        if not port or self._runner is not None:
            return
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/livez", self._livez)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            raise OSError(
                exc.errno,
                f"cannot serve /metrics and health on {host}:{port} ({exc.strerror}); "
                "set GPUSCHED_METRICS_PORT to a free port",
            ) from exc
        self._runner = runner

    async def stop(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _metrics(self, request: web.Request) -> web.Response:
        async with self._scraping:
            _SCRAPED.prepare()  # the copies of in-memory state, on the loop
            body = await asyncio.to_thread(generate_latest, REGISTRY)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _livez(self, request: web.Request) -> web.Response:
        # Answering at all is the proof: this runs on the service's event loop.
        return web.Response(text="ok\n")

    async def _readyz(self, request: web.Request) -> web.Response:
        verdict = await self._health.verdict()
        return web.Response(
            status=200 if verdict.ready else 503,
            text=json.dumps(verdict.as_json()) + "\n",
            content_type="application/json",
        )
