"""GPU samples from a Prometheus that already scrapes dcgm-exporter (/api/v1/query).

For clusters that run Prometheus anyway: instead of scraping every exporter again,
ingest asks Prometheus for the latest DCGM readings, one instant query per metric:

    avg by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE)
        (last_over_time(DCGM_FI_DEV_GPU_UTIL{<selector>}[<max_age>s]))

`avg` folds the copies one GPU can have (two Prometheus jobs, an exporter pod that was
replaced); the MIG labels are kept so `ingest.dcgm` rolls instances up onto their GPU
exactly as it does for a scraped page. `last_over_time` over `max_age_s` leaves out a
GPU whose exporter went silent, where a bare instant query would repeat its last
reading for Prometheus's 5-minute lookback. The selector is the seed controller's
`{...}` (e.g. ``cluster="prod"``); the node label is `Hostname` unless configured.

Utilization and framebuffer are required (a GPU without them is refused by
`ingest.dcgm`), temperature and power are read when present.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

import aiohttp
from prometheus_client import Counter

from gpusched.contracts.envelope import utcnow
from gpusched.infra.settings import IngestSettings
from gpusched.ingest import dcgm
from gpusched.ingest.polling import (
    BodyTooLarge,
    Sink,
    StateLog,
    hand_over,
    read_body,
    run_rounds,
)

__all__ = ["Problem", "PrometheusError", "PrometheusSource", "build_query", "series_from_response"]

log = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 256 * 1024 * 1024  # ~1M series; far past any one cluster

QUERIES = Counter(
    "gpusched_ingest_prometheus_rounds_total",
    "Prometheus query rounds by outcome (ok, or the problem that stopped the round)",
    ["outcome"],
)
READINGS_REFUSED = Counter(
    "gpusched_ingest_prometheus_readings_refused_total",
    "Prometheus series or GPU readings left out of a sample (NaN, negative, unlabelled, ...)",
    ["reason"],
)


class Problem(StrEnum):
    UNREACHABLE = "unreachable"
    TIMEOUT = "timeout"
    BAD_QUERY = "bad_query"  # Prometheus refused the query: the selector or label is wrong
    FAILED = "failed"  # any other non-success answer


class PrometheusError(Exception):
    """One line saying what went wrong with Prometheus and what to check."""

    def __init__(self, problem: Problem, message: str) -> None:
        super().__init__(message)
        self.problem = problem


def build_query(metric: str, selector: str, node_label: str, max_age_s: float) -> str:
    return (
        f"avg by ({node_label}, gpu, GPU_I_ID, GPU_I_PROFILE) "
        f"(last_over_time({metric}{{{selector}}}[{max(1, round(max_age_s))}s]))"
    )


def series_from_response(metric: str, status: int, body: bytes) -> list[dcgm.Series]:
    """The vector of one /api/v1/query answer as series named `metric`; PrometheusError
    for anything but a successful vector."""
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if not isinstance(payload, dict) or "status" not in payload:
        raise PrometheusError(
            Problem.FAILED,
            f"HTTP {status} without a Prometheus API answer: "
            "check that prometheus_url is the server's base URL",
        )
    if payload["status"] != "success":
        kind, error = payload.get("errorType", "?"), _first_line(payload.get("error", ""))
        if kind == "bad_data":
            raise PrometheusError(
                Problem.BAD_QUERY,
                f"Prometheus refused the {metric} query ({error}): "
                "check prometheus_selector and prometheus_node_label",
            )
        raise PrometheusError(
            Problem.FAILED, f"Prometheus could not answer the {metric} query: {kind}: {error}"
        )
    data = payload.get("data")
    if not isinstance(data, dict) or data.get("resultType") != "vector":
        raise PrometheusError(Problem.FAILED, f"the {metric} query did not return a vector")
    series: list[dcgm.Series] = []
    for item in data.get("result") or []:
        labels, value = _labels_and_value(item)
        if labels is not None:
            series.append(dcgm.Series(metric, labels, value))
    return series


def _labels_and_value(item: Any) -> tuple[Mapping[str, str] | None, float]:
    # A malformed element is dropped (and shows as a missing GPU), never raised.
    try:
        labels = {str(k): str(v) for k, v in item["metric"].items()}
        return labels, float(item["value"][1])
    except (KeyError, IndexError, TypeError, ValueError, AttributeError):
        return None, math.nan


def _first_line(text: object) -> str:
    lines = str(text).splitlines()
    return lines[0] if lines else ""


class PrometheusSource:
    """Queries one Prometheus each round and hands the samples to the sink."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        sink: Sink,
        *,
        url: str,
        selector: str = "",
        node_label: str = "Hostname",
        interval_s: float = 5.0,
        timeout_s: float = 3.0,
        max_age_s: float = 30.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._session = session
        self._sink = sink
        self._endpoint = url.rstrip("/") + "/api/v1/query"
        self._queries = {m: build_query(m, selector, node_label, max_age_s) for m in dcgm.METRICS}
        self._node_label = node_label
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._state = StateLog(log, "prometheus")

    @classmethod
    def from_settings(
        cls, session: aiohttp.ClientSession, sink: Sink, settings: IngestSettings
    ) -> PrometheusSource | None:
        """The source the settings describe, or None without a prometheus_url."""
        if settings.prometheus_url is None:
            return None
        return cls(
            session,
            sink,
            url=settings.prometheus_url,
            selector=settings.prometheus_selector,
            node_label=settings.prometheus_node_label,
            interval_s=settings.prometheus_interval_s,
            timeout_s=settings.prometheus_timeout_s,
            max_age_s=settings.prometheus_max_age_s,
        )

    async def read(self) -> dcgm.Parsed:
        """The latest readings as samples, all five queries evaluated at one instant and
        within the timeout; PrometheusError says why not."""
        at = self._clock()
        try:
            async with asyncio.timeout(self._timeout_s):
                answers = await self._all_queries(at)
        except TimeoutError:
            raise PrometheusError(
                Problem.TIMEOUT,
                f"Prometheus at {self._endpoint} did not answer within {self._timeout_s} s",
            ) from None
        series = [s for answer in answers for s in answer]
        return dcgm.samples_from_series(series, at, node_label=self._node_label)

    async def _all_queries(self, at: datetime) -> list[list[dcgm.Series]]:
        # A task group, not gather: the first failure cancels the other queries, so
        # none is left running past the round.
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._query(m, q, at)) for m, q in self._queries.items()]
        except* PrometheusError as errors:
            raise errors.exceptions[0] from None
        return [task.result() for task in tasks]

    async def _query(self, metric: str, query: str, at: datetime) -> list[dcgm.Series]:
        params = {"query": query, "time": f"{at.astimezone(UTC).timestamp():.3f}"}
        try:
            async with self._session.get(self._endpoint, params=params) as resp:
                body = await read_body(resp, MAX_RESPONSE_BYTES)
                status = resp.status
        except BodyTooLarge:
            raise PrometheusError(
                Problem.FAILED, f"the {metric} answer is over {MAX_RESPONSE_BYTES} bytes"
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise PrometheusError(
                Problem.UNREACHABLE,
                f"Prometheus at {self._endpoint} is unreachable ({type(exc).__name__}: "
                f"{_first_line(exc)}): check prometheus_url",
            ) from None
        return series_from_response(metric, status, body)

    async def query_round(self) -> dict[str, str]:
        """One round: read, hand over, count; returns the nodes the sink refused. A
        Prometheus problem is counted and logged when it starts and ends, not raised."""
        started = time.monotonic()
        try:
            parsed = await self.read()
        except PrometheusError as exc:
            QUERIES.labels(exc.problem).inc()
            self._state.note(self._endpoint, exc.problem, str(exc))
            self._state.flush()
            return {}
        QUERIES.labels("ok").inc()
        self._state.note(self._endpoint, "ok")
        self._state.flush()
        for reason, n in parsed.refused.items():
            READINGS_REFUSED.labels(reason).inc(n)
        if not parsed.samples:
            return {}
        budget = started + self._interval_s - time.monotonic()
        refused = await hand_over(self._sink, parsed.samples, budget, "prometheus query", log)
        return refused or {}

    async def run(self, stop: asyncio.Event) -> None:
        async def one_round() -> None:
            await self.query_round()

        await run_rounds("prometheus query", self._interval_s, one_round, stop, log)
