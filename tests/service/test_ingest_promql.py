"""The Prometheus query source against a real Prometheus (Debian's `prometheus`),
started here and scraping the recorded dcgm-exporter page over real HTTP; and against
servers that are away, slow or not a Prometheus at all."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from tests.support.dcgm import PROMETHEUS, fixture_text, http_server, running_prometheus, text
from tests.support.waiting import eventually

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import GpuSample
from gpusched.infra.embedded import free_port
from gpusched.ingest import dcgm
from gpusched.ingest.promql import Problem, PrometheusError, PrometheusSource

NO_PROMETHEUS = "no `prometheus` on PATH (Debian: apt-get install prometheus; `make test` does)"


@dataclass
class Running:
    url: str
    session: aiohttp.ClientSession


async def no_sink(samples: list[GpuSample]) -> dict[str, str]:
    raise AssertionError("this test reads, it does not hand over")


@pytest.fixture(scope="module")
async def prometheus() -> AsyncIterator[Running]:
    """One Prometheus for the module: it scrapes two exporter pages, node-a (the
    recorded one, MIG and a NaN GPU included) and node-b, every second."""
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    pages = {"/metrics": text(fixture_text() + _other_node_page())}
    async with http_server(pages) as exporter, aiohttp.ClientSession() as session:
        with running_prometheus(exporter.removeprefix("http://")) as server:

            async def has_series() -> bool:
                server.check_running()
                try:
                    source = PrometheusSource(session, no_sink, url=server.url)
                    parsed = await source.read()
                except PrometheusError:
                    return False
                return {s.node for s in parsed.samples} == {"node-a", "node-b"}

            try:
                await eventually(has_series, within=60)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; prometheus log: {server.log_tail()}") from None
            yield Running(server.url, session)


def _other_node_page() -> str:
    return (
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="node-b",cluster="other"} 40\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="node-b",cluster="other"} 100\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0",Hostname="node-b",cluster="other"} 900\n'
    )


async def test_the_query_source_reads_what_a_scrape_of_the_same_page_reads(
    prometheus: Running,
) -> None:
    source = PrometheusSource(prometheus.session, no_sink, url=prometheus.url)
    parsed = await source.read()

    direct = dcgm.samples_from_series(dcgm.parse_exporter_text(fixture_text()), utcnow())
    [node_a] = [s for s in parsed.samples if s.node == "node-a"]
    assert node_a.gpus == direct.samples[0].gpus  # MIG roll-up included, GPU 2 refused
    assert parsed.refused["bad_value"] == 1


async def test_the_selector_narrows_the_query_like_the_seed_controllers(
    prometheus: Running,
) -> None:
    source = PrometheusSource(
        prometheus.session, no_sink, url=prometheus.url, selector='cluster="other"'
    )
    parsed = await source.read()

    [node_b] = parsed.samples
    assert node_b.node == "node-b"
    assert [(g.index, g.util, g.mem_used_mib, g.mem_total_mib) for g in node_b.gpus] == [
        (0, 0.4, 100, 1000)
    ]


async def test_the_samples_reach_the_sink_once_per_round(prometheus: Running) -> None:
    handed: list[list[GpuSample]] = []

    async def sink(samples: list[GpuSample]) -> dict[str, str]:
        handed.append(samples)
        return {"node-b": "node 'node-b' is not in the inventory"}

    source = PrometheusSource(prometheus.session, sink, url=prometheus.url)
    refused = await source.query_round()

    assert [sorted(s.node for s in samples) for samples in handed] == [["node-a", "node-b"]]
    assert list(refused) == ["node-b"]


async def test_a_selector_prometheus_cannot_parse_is_a_bad_query(prometheus: Running) -> None:
    source = PrometheusSource(
        prometheus.session, no_sink, url=prometheus.url, selector='Hostname=~"("'
    )
    with pytest.raises(PrometheusError, match=r"refused the DCGM_FI_DEV_.* query") as caught:
        await source.read()
    assert caught.value.problem is Problem.BAD_QUERY
    assert "\n" not in str(caught.value)


async def test_an_unreachable_prometheus_is_one_clear_error() -> None:
    async with aiohttp.ClientSession() as session:
        source = PrometheusSource(
            session, no_sink, url=f"http://127.0.0.1:{free_port()}", timeout_s=2.0
        )
        with pytest.raises(PrometheusError, match=r"unreachable.*check prometheus_url") as caught:
            await source.read()
    assert caught.value.problem is Problem.UNREACHABLE


async def test_a_prometheus_that_does_not_answer_in_time_is_a_timeout() -> None:
    release = asyncio.Event()

    async def hangs(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="{}")

    async with http_server({"/api/v1/query": hangs}) as base, aiohttp.ClientSession() as s:
        source = PrometheusSource(s, no_sink, url=base, timeout_s=0.5)
        with pytest.raises(PrometheusError, match=r"did not answer within 0\.5 s") as caught:
            await source.read()
        release.set()
    assert caught.value.problem is Problem.TIMEOUT


async def test_a_server_that_is_not_prometheus_is_told_apart() -> None:
    routes = {
        "/api/v1/query": text("<html>login</html>", status=200),
        "/sub/api/v1/query": text(json.dumps({"status": "error", "errorType": "timeout",
                                              "error": "query timed out"}), status=503),
    }  # fmt: skip
    async with http_server(routes) as base, aiohttp.ClientSession() as session:
        plain = PrometheusSource(session, no_sink, url=base)
        with pytest.raises(PrometheusError, match="without a Prometheus API answer"):
            await plain.read()
        failing = PrometheusSource(session, no_sink, url=f"{base}/sub/")
        with pytest.raises(PrometheusError, match=r"could not answer.*timeout") as caught:
            await failing.read()
    assert caught.value.problem is Problem.FAILED
