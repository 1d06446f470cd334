"""Scrape NVIDIA dcgm-exporter endpoints into GPU samples, one bounded round at a time.

Targets come from a file (YAML or JSON, see `parse_targets`) or from the inventory: one
per node from a URL template such as ``http://{node}:9400/metrics``. Every round fetches
all targets with at most `concurrency` in flight, each within `timeout_s` and reading at
most `max_body_bytes`, parses the pages with `ingest.dcgm` and hands every sample of the
round to the sink in one call. The fetch phase ends at 80 % of the interval (a target
still waiting then counts as a timeout) and the sink gets what is left of it, so a round
never runs into the next one and one bad target never holds up the others.

Each target's outcome is counted (`gpusched_ingest_scrapes_total`) and logged once
when it changes, not once per round.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter as Tally
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from pathlib import Path

import aiohttp
import yaml
from prometheus_client import Counter, Gauge, Histogram

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import GpuSample
from gpusched.infra.settings import IngestSettings
from gpusched.infra.textfiles import FileRefused, read_small_text
from gpusched.ingest import dcgm
from gpusched.ingest.polling import (
    BodyTooLarge,
    Sink,
    StateLog,
    hand_over,
    read_body,
    run_rounds,
)

__all__ = [
    "Outcome",
    "RoundReport",
    "Scraper",
    "Target",
    "TargetsError",
    "TargetsSource",
    "client_session",
    "configured_targets",
    "load_targets_file",
    "parse_targets",
    "targets_from_inventory",
]

log = logging.getLogger(__name__)

FETCH_SHARE = 0.8  # of the interval; the rest is the sink's

SCRAPES = Counter("gpusched_ingest_scrapes_total", "dcgm-exporter scrapes by outcome", ["outcome"])
TARGETS = Gauge(
    "gpusched_ingest_scrape_targets", "targets whose last scrape had this outcome", ["outcome"]
)
READINGS_REFUSED = Counter(
    "gpusched_ingest_scrape_readings_refused_total",
    "exporter series or GPU readings left out of a sample (NaN, negative, unlabelled, ...)",
    ["reason"],
)
ROUND_SECONDS = Histogram(
    "gpusched_ingest_scrape_round_seconds",
    "from a round's start to its sink returning",
    buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10),
)


class Outcome(StrEnum):
    OK = "ok"
    TIMEOUT = "timeout"
    UNREACHABLE = "unreachable"
    HTTP_ERROR = "http_error"
    TOO_LARGE = "too_large"
    UNPARSABLE = "unparsable"
    REFUSED = "refused"  # parsed, but the sink refused its node (e.g. not in the inventory)
    ERROR = "error"  # none of the above: a bug (its traceback is logged at debug level)


class TargetsError(ValueError):
    """A targets file or template that cannot be used; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class Target:
    url: str
    node: str | None = None  # else the page's Hostname label names the node

    @property
    def key(self) -> str:
        return self.node or self.url


def parse_targets(data: object, where: str) -> list[Target]:
    """Targets from a loaded YAML/JSON document: a list whose items are a URL, or a
    mapping with `url` and optionally `node` (which overrides the Hostname label)."""
    if not isinstance(data, list):
        raise TargetsError(f"{where}: expected a list of targets (URLs or {{url, node}})")
    targets: list[Target] = []
    for i, item in enumerate(data):
        entry = {"url": item} if isinstance(item, str) else item
        if not isinstance(entry, dict) or not isinstance(entry.get("url"), str):
            raise TargetsError(f"{where}: target {i + 1} needs a url (got {item!r})")
        node = entry.get("node")
        if node is not None and not isinstance(node, str):
            raise TargetsError(f"{where}: target {i + 1}: node must be a string")
        unknown = sorted(set(entry) - {"url", "node"})
        if unknown:
            raise TargetsError(f"{where}: target {i + 1}: unknown field(s) {', '.join(unknown)}")
        url = entry["url"]
        if not url.startswith(("http://", "https://")):
            raise TargetsError(f"{where}: target {i + 1}: {url!r} is not an http(s) URL")
        targets.append(Target(url, node))
    duplicate = [k for k, n in Tally(t.key for t in targets).items() if n > 1]
    if duplicate:
        raise TargetsError(f"{where}: listed more than once: {', '.join(sorted(duplicate))}")
    return targets


def load_targets_file(path: Path) -> list[Target]:
    try:
        data = yaml.safe_load(read_small_text(path))
    except (OSError, FileRefused, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise TargetsError(f"cannot read scrape targets {path}: {exc}".splitlines()[0]) from exc
    return parse_targets(data, str(path))


def targets_from_inventory(nodes: Iterable[str], template: str) -> list[Target]:
    """One target per inventory node, named after it: ``http://{node}:9400/metrics``."""
    if "{node}" not in template:
        raise TargetsError(f"scrape URL template {template!r} must contain {{node}}")
    return [Target(template.replace("{node}", node), node) for node in sorted(set(nodes))]


TargetsSource = Callable[[], Awaitable[Sequence[Target]]]


def configured_targets(
    settings: IngestSettings, inventory_nodes: Callable[[], Awaitable[Iterable[str]]]
) -> TargetsSource | None:
    """What `Scraper.run` asks each round, from the settings: the targets file (read
    now, so a bad file stops the start with its one-line error), else one target per
    node the inventory holds at that round, else None (scraping is off)."""
    if settings.scrape_targets_file is not None:
        listed = load_targets_file(settings.scrape_targets_file)

        async def from_file() -> Sequence[Target]:
            return listed

        return from_file
    template = settings.scrape_url_template
    if template is None:
        return None

    async def from_inventory() -> Sequence[Target]:
        return targets_from_inventory(await inventory_nodes(), template)

    return from_inventory


@dataclass(frozen=True, slots=True)
class _Fetched:
    target: Target
    outcome: Outcome
    detail: str = ""
    samples: tuple[GpuSample, ...] = ()
    refused_readings: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What one round did: each target's outcome, the samples handed to the sink and
    what it refused, and when the sink had them (seconds after the round started)."""

    outcomes: dict[str, Outcome]
    details: dict[str, str]
    samples: int
    refused: dict[str, str]
    sink_at_s: float | None


def client_session(concurrency: int, interval_s: float) -> aiohttp.ClientSession:
    """The HTTP client for scraping (create it inside the running loop, close it at
    the end). Connections are kept between rounds, as Prometheus keeps its own, so a
    round does not pay a TCP handshake per target; names resolve once a minute."""
    connector = aiohttp.TCPConnector(
        limit=concurrency, keepalive_timeout=max(15.0, 3 * interval_s), ttl_dns_cache=60
    )
    return aiohttp.ClientSession(
        connector=connector, headers={"Accept": "text/plain"}, raise_for_status=False
    )


class Scraper:
    """Scrapes its targets each round; hold one per process (it keeps the connection
    pool and each target's last outcome for logging on change)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        sink: Sink,
        *,
        interval_s: float,
        timeout_s: float,
        concurrency: int,
        max_body_bytes: int,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._session = session
        self._sink = sink
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(concurrency)
        self._max_body = max_body_bytes
        self._clock = clock
        self._states = StateLog(log, "scrape target")

    @classmethod
    def from_settings(
        cls, session: aiohttp.ClientSession, sink: Sink, settings: IngestSettings
    ) -> Scraper:
        return cls(
            session,
            sink,
            interval_s=settings.scrape_interval_s,
            timeout_s=settings.scrape_timeout_s,
            concurrency=settings.scrape_concurrency,
            max_body_bytes=settings.scrape_max_body_bytes,
        )

    async def scrape_round(self, targets: Sequence[Target]) -> RoundReport:
        """Fetch and parse every target, then hand the samples to the sink, all within
        the interval. Nothing a target does (hang, 500, garbage, a huge page) raises."""
        started = time.monotonic()
        fetch_deadline = started + self._interval_s * FETCH_SHARE
        tasks = {asyncio.create_task(self._fetch(t, fetch_deadline)): t for t in targets}
        fetched: list[_Fetched] = []
        if tasks:
            done, pending = await asyncio.wait(tasks, timeout=fetch_deadline - time.monotonic())
            for task in pending:
                task.cancel()
            if pending:
                # Cancelled fetches unwind at once; the bound is for one that would not.
                await asyncio.wait(pending, timeout=1.0)
            for task, target in tasks.items():
                fetched.append(_result(task, target, done))
        samples = [s for f in fetched for s in f.samples]
        refused, sink_at = await self._hand_over(samples, started)
        report = self._settle(fetched, refused, sink_at, len(samples))
        ROUND_SECONDS.observe(time.monotonic() - started)
        return report

    async def _hand_over(
        self, samples: list[GpuSample], started: float
    ) -> tuple[dict[str, str], float | None]:
        if not samples:
            return {}, None
        budget = started + self._interval_s - time.monotonic()
        refused = await hand_over(self._sink, samples, budget, "dcgm scrape", log)
        if refused is None:
            return {}, None
        return refused, time.monotonic() - started

    def _settle(
        self,
        fetched: list[_Fetched],
        refused: dict[str, str],
        sink_at: float | None,
        samples: int,
    ) -> RoundReport:
        outcomes: dict[str, Outcome] = {}
        details: dict[str, str] = {}
        for f in fetched:
            outcome, detail = f.outcome, f.detail
            mine = [refused[s.node] for s in f.samples if s.node in refused]
            if outcome is Outcome.OK and mine:
                outcome, detail = Outcome.REFUSED, "; ".join(mine)
            outcomes[f.target.key] = outcome
            details[f.target.key] = detail
            SCRAPES.labels(outcome).inc()
            for reason, n in f.refused_readings.items():
                READINGS_REFUSED.labels(reason).inc(n)
            where = "" if f.target.node is None else f"{f.target.url}: "
            self._states.note(f.target.key, outcome, where + detail)
        self._states.flush()
        self._states.forget_others(set(outcomes))
        tally = Tally(outcomes.values())
        for outcome in Outcome:
            TARGETS.labels(outcome).set(tally.get(outcome, 0))
        return RoundReport(outcomes, details, samples, refused, sink_at)

    async def _fetch(self, target: Target, deadline: float) -> _Fetched:
        async with self._slots:
            left = min(self._timeout_s, deadline - time.monotonic())
            if left <= 0:
                return _Fetched(target, Outcome.TIMEOUT, "not scraped in the round")
            try:
                async with asyncio.timeout(left):
                    status, body = await self._get(target.url)
            except TimeoutError:
                return _Fetched(target, Outcome.TIMEOUT, f"no answer within {left:.1f} s")
            except BodyTooLarge:
                return _Fetched(
                    target, Outcome.TOO_LARGE, f"page larger than {self._max_body} bytes"
                )
            except (aiohttp.ClientError, OSError) as exc:
                return _Fetched(target, Outcome.UNREACHABLE, _one_line(exc))
        if status != 200:
            return _Fetched(target, Outcome.HTTP_ERROR, f"HTTP {status}")
        return _parse(target, body, self._clock())

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self._session.get(url, allow_redirects=False) as resp:
            if resp.status != 200:
                return resp.status, b""
            return resp.status, await read_body(resp, self._max_body)

    async def run(self, targets: TargetsSource, stop: asyncio.Event) -> None:
        """Scrape every interval until `stop`; `targets` is asked afresh each round
        (the inventory changes)."""

        async def one_round() -> None:
            await self.scrape_round(await targets())

        await run_rounds("dcgm scrape", self._interval_s, one_round, stop, log)


def _result(
    task: asyncio.Task[_Fetched], target: Target, done: set[asyncio.Task[_Fetched]]
) -> _Fetched:
    if task not in done or task.cancelled():
        return _Fetched(target, Outcome.TIMEOUT, "not scraped in the round")
    exc = task.exception()
    if exc is None:
        return task.result()
    log.debug("scrape target %s: unexpected failure", target.key, exc_info=exc)
    return _Fetched(target, Outcome.ERROR, _one_line(exc))


def _parse(target: Target, body: bytes, at: datetime) -> _Fetched:
    try:
        series = dcgm.parse_exporter_text(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return _Fetched(target, Outcome.UNPARSABLE, _one_line(exc))
    parsed = dcgm.samples_from_series(series, at, node=target.node)
    refused = dict(parsed.refused)
    if not parsed.samples:
        detail = "no usable DCGM GPU series" + (f" (refused: {refused})" if refused else "")
        return _Fetched(target, Outcome.UNPARSABLE, detail, (), refused)
    return _Fetched(target, Outcome.OK, "", tuple(parsed.samples), refused)


def _one_line(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
