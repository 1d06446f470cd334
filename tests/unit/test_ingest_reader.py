"""ingest.reader.SampleReader, the fast gpu.sample edge: for any message, the verdict
and the values of the general edge (contracts.validation), hostile input included."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import GpuSample, T
from gpusched.contracts.validation import TypedReader
from gpusched.ingest.reader import SampleReader, SampleView

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
SUBJECT = "p.telemetry.gpu.3.node-1"
GENERAL = TypedReader(T.GPU_SAMPLE, GpuSample)
FAST = SampleReader()


def sample(**data: Any) -> dict[str, Any]:
    reading = {"index": 0, "util": 0.5, "mem_used_mib": 100, "mem_total_mib": 81920}
    return {
        "id": "m-1",
        "type": T.GPU_SAMPLE,
        "version": 1,
        "source": "agent",
        "time": "2026-12-02T11:59:58.5Z",
        "data": {"node": "node-1", "time": "2026-12-02T11:59:58Z", "gpus": [reading], **data},
    }


def verdicts(raw: bytes, subject: str = SUBJECT) -> tuple[object, object]:
    """(fast, general): each the SampleView read, None, or the error's text."""

    def general() -> object:
        try:
            read = GENERAL.read(raw, subject, NOW)
        except MalformedMessage as exc:
            return f"refused: {exc}"
        return None if read is None else SampleView.of(read)

    def fast() -> object:
        try:
            return FAST.read(raw, subject, NOW)
        except MalformedMessage as exc:
            return f"refused: {exc}"

    return fast(), general()


def test_a_valid_sample_is_read_without_the_general_edge() -> None:
    raw = json.dumps(sample()).encode()
    reader = SampleReader()
    view = reader.read(raw, SUBJECT, NOW)
    at = datetime(2026, 12, 2, 11, 59, 58, tzinfo=UTC)
    assert view == SampleView("node-1", at, ((0, 0.5),), ((0, 100, 81920),))


@pytest.mark.parametrize(
    "raw",
    [
        # A second key wins, in both (the first, invalid, is overwritten).
        b'{"id":"m","type":"gpu.sample","source":"a","time":"2026-12-02T11:59:58Z","data":'
        b'{"node":"node-1","time":"2026-12-02T11:59:58Z","gpus":[{"index":0,"util":2.5,'
        b'"util":0.5,"mem_used_mib":1,"mem_total_mib":2}]}}',
        b'{"id":"m","type":"gpu.sample","source":"a","time":"2026-12-02T11:59:58Z","data":'
        b'{"node":"node-1","time":"2026-12-02T11:59:58Z","gpus":[{"index":0,"util":0.5,'
        b'"util":2.5,"mem_used_mib":1,"mem_total_mib":2}]}}',
        b'{"id":"m","type":"gpu.sample","source":"a","time":"2026-12-02T11:59:58Z","data":'
        b'{"node":"node-1","time":"2026-12-02T11:59:58Z","gpus":[{"index":0,"util":NaN,'
        b'"mem_used_mib":1,"mem_total_mib":2}]}}',
        b'{"id":"m","type":"gpu.sample","source":"a","time":"2026-12-02T11:59:58Z","data":'
        b'{"node":"node-1","time":"2026-12-02T11:59:58","gpus":[]}}',
        "\ufeff".encode() + json.dumps(sample()).encode(),
        json.dumps(sample()).encode("utf-16"),
        b"[]",
        b"",
    ],
)
def test_odd_json_gets_the_general_verdict(raw: bytes) -> None:
    fast, general = verdicts(raw)
    assert fast == general


_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["node-1", "node-2", "n" * 129, "node 1", "nöde", "x\u202e", "\x00", ""]),
)
_TIME = st.one_of(
    st.datetimes(
        min_value=datetime(2026, 12, 2, 10),
        max_value=datetime(2026, 12, 2, 13),
        timezones=st.just(UTC),
    ).map(lambda t: t.isoformat()),
    st.datetimes(min_value=datetime(2026, 12, 2, 10), max_value=datetime(2026, 12, 2, 13)).map(
        lambda t: t.isoformat()
    ),
    st.sampled_from(
        [
            "2026-12-02T11:59:58Z",
            "2026-12-02T11:59:58.1234567Z",
            "2026-12-02t11:59:58z",
            "2026-12-02 11:59:58Z",
            "2026-12-02T11:59:58+23:59",
            "2026-12-02T11:59:58+24:00",
            "2026-12-02T24:00:00Z",
            "2026-12-02T11:59:60Z",
            "2026-02-30T11:59:58Z",
            "2026-12-02T11:59:58.5-00:00",
            "2026-12-02T12:04:59Z",
            "2026-12-02T12:05:01Z",
            "2026-12-02T10:59:59Z",
            "0001-01-01T00:00:00Z",
            "9999-12-31T23:59:59-23:59",
            "1764676798",
        ]
    ),
)
_NUMBER = st.one_of(
    st.integers(min_value=-3, max_value=2**31),
    st.sampled_from([0, 1, 1023, 1024, 2**30, 2**30 + 1, 2**64, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, 0.5, 1.0, 1.0000001, -0.0, 1e-400, 1e400, 999.9, 1000.1, -273.0, -273.1]),
    st.booleans(),
    st.none(),
    st.just("0.5"),
)
_VALID_READING = st.fixed_dictionaries(
    {
        "util": st.one_of(st.floats(0, 1), st.sampled_from([0, 1])),
        "mem_used_mib": st.integers(0, 1000),
        "mem_total_mib": st.integers(1000, 81920),
    },
    optional={
        "temp_c": st.one_of(st.none(), st.floats(-273, 1000), st.integers(-273, 1000)),
        "power_w": st.one_of(st.none(), st.floats(0, 10**6)),
        "extra": st.text(max_size=3),
    },
)
_ENVELOPE_KEYS = ("id", "type", "version", "source", "time", "correlation_id", "causation_id", "x")
_DATA_KEYS = ("node", "time", "gpus", "x")
_READING_KEYS = ("index", "util", "mem_used_mib", "mem_total_mib", "temp_c", "power_w")
_HOSTILE = st.one_of(
    _TEXT,
    _TIME,
    _NUMBER,
    st.sampled_from([T.GPU_SAMPLE, T.INFERENCE_STATS, [], {}]),
)


@st.composite
def messages(draw: st.DrawFn) -> tuple[bytes, str]:
    """A valid sample with up to two of its values made hostile (or removed)."""
    message = sample()
    data = message["data"]
    readings = draw(st.lists(_VALID_READING, min_size=1, max_size=8))
    for index, reading in enumerate(readings):
        reading["index"] = index
    data["gpus"] = readings
    for _ in range(draw(st.integers(0, 2))):
        where = draw(st.sampled_from(["envelope", "data", "reading"]))
        target, keys = {
            "envelope": (message, _ENVELOPE_KEYS),
            "data": (data, _DATA_KEYS),
            "reading": (draw(st.sampled_from(readings)), _READING_KEYS),
        }[where]
        key = draw(st.sampled_from(keys))
        if draw(st.integers(0, 4)) == 0:
            target.pop(key, None)
        else:
            target[key] = draw(_HOSTILE)
    node = data.get("node") if isinstance(data.get("node"), str) else "x"
    subject = draw(
        st.sampled_from(
            [f"p.telemetry.gpu.3.{node}"] * 4
            + ["p.telemetry.gpu.3.other", f"p.telemetry.gpu.{node}"]
        )
    )
    return json.dumps(message, allow_nan=True).encode(), subject


@settings(
    max_examples=300, derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
@given(messages())
def test_any_message_gets_the_verdict_and_values_of_the_general_edge(
    message: tuple[bytes, str],
) -> None:
    raw, subject = message
    fast, general = verdicts(raw, subject)
    assert fast == general


def test_the_property_test_reaches_both_verdicts() -> None:
    # Guard against a generator that only makes refusals (or only valid samples).
    valid = json.dumps(sample()).encode()
    late = json.dumps(sample(time=(NOW - timedelta(hours=2)).isoformat())).encode()
    assert isinstance(verdicts(valid)[0], SampleView)
    assert str(verdicts(late)[0]).startswith("refused")
