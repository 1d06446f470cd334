"""The pure parts of ingest's pull sources: scrape targets (file, inventory template),
Prometheus queries and answers, and the settings that configure them."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from pydantic import ValidationError

from gpusched.infra.settings import IngestSettings, Settings
from gpusched.ingest.polling import StateLog
from gpusched.ingest.promql import Problem, PrometheusError, build_query, series_from_response
from gpusched.ingest.scrape import (
    Target,
    TargetsError,
    configured_targets,
    load_targets_file,
    parse_targets,
    targets_from_inventory,
)


def test_a_targets_file_lists_urls_or_url_and_node_in_yaml_or_json(tmp_path: Path) -> None:
    yaml_file = tmp_path / "targets.yaml"
    yaml_file.write_text(
        "- http://10.0.0.5:9400/metrics\n- url: http://10.0.0.6:9400/metrics\n  node: gpu-6\n"
    )
    json_file = tmp_path / "targets.json"
    json_file.write_text(json.dumps(["http://a:9400/metrics", {"url": "https://b/metrics"}]))

    assert load_targets_file(yaml_file) == [
        Target("http://10.0.0.5:9400/metrics"),
        Target("http://10.0.0.6:9400/metrics", "gpu-6"),
    ]
    assert [t.key for t in load_targets_file(json_file)] == [
        "http://a:9400/metrics",
        "https://b/metrics",
    ]


@pytest.mark.parametrize(
    ("data", "complaint"),
    [
        ({"targets": []}, "expected a list"),
        ([{"node": "n"}], "target 1 needs a url"),
        (["ftp://x/metrics"], "is not an http"),
        ([{"url": "http://x", "nodes": "n"}], "unknown field"),
        ([{"url": "http://x", "node": 7}], "node must be a string"),
        (["http://x/m", {"url": "http://x/m"}], "listed more than once: http://x/m"),
    ],
)
def test_a_targets_file_that_cannot_be_used_says_what_is_wrong(
    data: object, complaint: str
) -> None:
    with pytest.raises(TargetsError, match=complaint) as caught:
        parse_targets(data, "targets.yaml")
    assert str(caught.value).startswith("targets.yaml: ")


def test_an_unreadable_targets_file_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text("- [unclosed\n")
    with pytest.raises(TargetsError, match="cannot read scrape targets") as caught:
        load_targets_file(bad)
    assert "\n" not in str(caught.value)


def test_inventory_targets_name_their_node_once_each() -> None:
    assert targets_from_inventory(["b", "a", "b"], "http://{node}:9400/metrics") == [
        Target("http://a:9400/metrics", "a"),
        Target("http://b:9400/metrics", "b"),
    ]
    with pytest.raises(TargetsError, match="must contain"):
        targets_from_inventory(["a"], "http://exporter:9400/metrics")


async def test_configured_targets_come_from_the_file_or_the_inventory_as_it_is_now(
    tmp_path: Path,
) -> None:
    listed = tmp_path / "targets.yaml"
    listed.write_text("- {url: 'http://10.0.0.5:9400/metrics', node: gpu-5}\n")
    nodes = ["a"]

    async def inventory() -> list[str]:
        return list(nodes)

    from_file = configured_targets(IngestSettings(scrape_targets_file=listed), inventory)
    from_inventory = configured_targets(
        IngestSettings(scrape_url_template="http://{node}:9400/metrics"), inventory
    )
    assert from_file is not None and from_inventory is not None
    assert [t.key for t in await from_file()] == ["gpu-5"]
    nodes.append("b")
    assert [t.url for t in await from_inventory()] == [
        "http://a:9400/metrics",
        "http://b:9400/metrics",
    ]
    assert configured_targets(IngestSettings(), inventory) is None
    with pytest.raises(TargetsError, match="cannot read scrape targets"):
        configured_targets(IngestSettings(scrape_targets_file=tmp_path / "none"), inventory)


def test_the_query_keeps_gpu_and_mig_labels_and_drops_silent_series() -> None:
    query = build_query("DCGM_FI_DEV_GPU_UTIL", 'cluster="prod"', "Hostname", 30)
    assert query == (
        "avg by (Hostname, gpu, GPU_I_ID, GPU_I_PROFILE) "
        '(last_over_time(DCGM_FI_DEV_GPU_UTIL{cluster="prod"}[30s]))'
    )


def test_a_vector_answer_becomes_series_and_a_malformed_element_is_dropped() -> None:
    body = json.dumps(
        {
            "status": "success",
            "data": {
                "resultType": "vector",
                "result": [
                    {"metric": {"Hostname": "n", "gpu": "0"}, "value": [1.0, "87"]},
                    {"metric": {"Hostname": "n", "gpu": "1"}, "value": [1.0, "NaN"]},
                    {"metric": {"Hostname": "n"}},
                ],
            },
        }
    ).encode()
    series = series_from_response("DCGM_FI_DEV_GPU_UTIL", 200, body)
    assert [(s.labels["gpu"], s.value) for s in series[:1]] == [("0", 87.0)]
    assert len(series) == 2 and math.isnan(series[1].value)


@pytest.mark.parametrize(
    ("status", "body", "problem", "says"),
    [
        (400, {"status": "error", "errorType": "bad_data", "error": "parse error\nat 1"},
         Problem.BAD_QUERY, "check prometheus_selector"),
        (422, {"status": "error", "errorType": "execution", "error": "too many samples"},
         Problem.FAILED, "execution: too many samples"),
        (200, {"status": "success", "data": {"resultType": "matrix", "result": []}},
         Problem.FAILED, "did not return a vector"),
        (404, "404 page not found", Problem.FAILED, "prometheus_url is the server's base URL"),
    ],
)  # fmt: skip
def test_a_non_success_answer_is_one_line_saying_what_to_check(
    status: int, body: object, problem: Problem, says: str
) -> None:
    raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    with pytest.raises(PrometheusError) as caught:
        series_from_response("DCGM_FI_DEV_GPU_UTIL", status, raw)
    assert caught.value.problem is problem
    assert says in str(caught.value)
    assert "\n" not in str(caught.value)


def test_state_log_speaks_on_change_only(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.statelog")
    states = StateLog(log, "target")
    caplog.set_level(logging.INFO, logger="test.statelog")
    for state in ["ok", "ok", "timeout", "timeout", "http_error", "ok", "ok"]:
        states.note("a", state, f"it is {state}")
        states.flush()
    states.forget_others(set())
    states.note("a", "timeout", "gone")
    states.flush()

    assert [r.getMessage() for r in caplog.records] == [
        "target a: timeout: it is timeout",
        "target a: http_error: it is http_error",
        "target a: ok again (was http_error)",
        "target a: timeout: gone",
    ]


def test_many_targets_changing_alike_share_one_line(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.statelog")
    states = StateLog(log, "target")
    caplog.set_level(logging.INFO, logger="test.statelog")
    keys = [f"n{i}" for i in range(40)]
    for state in ["timeout", "timeout", "ok"]:
        for key in keys:
            states.note(key, state, f"{key} is slow")
        states.note("lone", "http_error" if state == "timeout" else "ok", "HTTP 500")
        states.flush()

    assert [r.getMessage() for r in caplog.records] == [
        "40 targets timeout: n0, n1, n2, n3, n4 and 35 more (n0: n0 is slow)",
        "target lone: http_error: HTTP 500",
        "41 targets ok again: n0, n1, n2, n3, n4 and 36 more",
    ]


@pytest.mark.parametrize(
    ("fields", "complaint"),
    [
        ({"scrape_url_template": "http://exporter:9400/metrics"}, "must contain {node}"),
        ({"prometheus_selector": '{cluster="prod"}'}, "without braces"),
        ({"scrape_interval_s": 2.0, "scrape_timeout_s": 2.0}, "shorter than scrape_interval_s"),
        ({"prometheus_interval_s": 1, "prometheus_timeout_s": 3}, "shorter than prometheus"),
        ({"scrape_targets_file": "t.yaml", "scrape_url_template": "http://{node}/m"}, "not both"),
    ],
)
def test_pull_source_settings_refuse_what_cannot_work(
    fields: dict[str, object], complaint: str
) -> None:
    with pytest.raises(ValidationError, match=complaint):
        IngestSettings.model_validate(fields)


def test_pull_source_settings_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GPUSCHED_INGEST__SCRAPE_URL_TEMPLATE", "http://{node}:9400/metrics")
    monkeypatch.setenv("GPUSCHED_INGEST__PROMETHEUS_SELECTOR", 'cluster="prod"')
    ingest = Settings().ingest
    assert (ingest.scrape_url_template, ingest.prometheus_selector, ingest.scrape_interval_s) == (
        "http://{node}:9400/metrics",
        'cluster="prod"',
        5.0,
    )
