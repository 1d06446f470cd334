"""The edge rules of contracts/validation.py, without I/O: what a message or a request
must be to get in, and what the receiver is told when it is not."""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.contracts import validation
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import (
    ApproveJob,
    GetJob,
    GpuSample,
    InferenceStats,
    JobProgress,
    JobStarted,
    SubmitJob,
)
from gpusched.contracts.validation import (
    ARGV_MAX_BYTES,
    Invalid,
    check_document,
    check_text,
    parse_request,
    printable,
    read_message,
    stream_max_age,
)

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
SUBMIT: dict[str, Any] = {"name": "resnet", "team": "vision", "gpus": {"count": 2}}


def raw_envelope(message_type: str, data: dict[str, Any], **fields: Any) -> bytes:
    envelope = {
        "id": "m-1",
        "type": message_type,
        "version": 1,
        "source": "test",
        "time": NOW.isoformat(),
        "data": data,
    }
    envelope.update(fields)
    return json.dumps(envelope).encode()


def sample(node: str = "n1", **reading: Any) -> dict[str, Any]:
    gpu = {"index": 0, "util": 0.5, "mem_used_mib": 10, "mem_total_mib": 100, **reading}
    return {"node": node, "time": NOW.isoformat(), "gpus": [gpu]}


def refused(body: dict[str, Any]) -> Invalid:
    result = parse_request(SubmitJob, json.dumps(body).encode())
    assert isinstance(result, Invalid), result
    return result


# --- requests ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gpus": {"count": True}}, "gpus.count"),
        ({"gpus": {"count": "8"}}, "gpus.count"),
        ({"gpus": {"count": 10**9}}, "gpus.count"),
        ({"workload": {"steps": 10**18}}, "workload.steps"),
        ({"workload": {"step_seconds": -1}}, "workload.step_seconds"),
        ({"name": "a\u202eb"}, "name"),
        ({"name": "a\x00b"}, "name"),
        ({"name": "x" * 1_000_000}, "name"),
        ({"gang": "yes"}, "gang"),
        ({"workload": {"argv": ["x"] * 257}}, "workload.argv"),
        ({"workload": {"argv": ["x" * 4000] * 20}}, "workload.argv"),
    ],
    ids=[
        "bool-count",
        "string-count",
        "huge-count",
        "huge-steps",
        "negative-seconds",
        "bidi-name",
        "nul-name",
        "1mb-name",
        "string-bool",
        "too-many-args",
        "argv-too-big",
    ],
)
def test_a_bad_request_field_is_invalid_and_named(change: dict[str, Any], field: str) -> None:
    invalid = refused({**SUBMIT, **change})
    assert invalid.field == field
    error = invalid.error()
    assert error.code == "invalid"
    assert error.field == field
    assert error.message.startswith(field)


@pytest.mark.parametrize("literal", [b"Infinity", b"-Infinity", b"NaN"])
def test_a_non_finite_number_in_a_request_is_invalid(literal: bytes) -> None:
    body = b'{"name": "a", "team": "t", "gpus": {"count": 1}, "workload": {"step_seconds": %s}}'
    invalid = parse_request(SubmitJob, body % literal)
    assert isinstance(invalid, Invalid)
    assert invalid.field == "workload.step_seconds"


@pytest.mark.parametrize("raw", [b"", b"not json", b"\xff\xfe", b"[1, 2]", b"null"])
def test_a_body_that_is_not_an_object_is_invalid_without_a_field(raw: bytes) -> None:
    invalid = parse_request(GetJob, raw)
    assert isinstance(invalid, Invalid)
    assert invalid.field is None


def test_a_request_with_an_unknown_field_from_a_newer_client_is_read() -> None:
    job = parse_request(SubmitJob, json.dumps({**SUBMIT, "new_option": {"x": 1}}).encode())
    assert isinstance(job, SubmitJob)
    assert job.gpus.count == 2


def test_argv_at_its_limits_is_accepted() -> None:
    argv = ["x" * (ARGV_MAX_BYTES // 256)] * 256
    job = parse_request(SubmitJob, json.dumps({**SUBMIT, "workload": {"argv": argv}}).encode())
    assert isinstance(job, SubmitJob)


@settings(max_examples=60, derandomize=True)
@given(st.text(max_size=50))
def test_text_is_accepted_exactly_when_it_has_no_control_or_bidi_character(text: str) -> None:
    bad = any(
        ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 or 0x202A <= ord(c) <= 0x202E
        or 0x2066 <= ord(c) <= 0x2069
        for c in text
    )  # fmt: skip
    try:
        check_text(text, max_length=100)
        accepted = True
    except ValueError:
        accepted = False
    assert accepted is not bad


def _check_text_char_by_char(text: str, multiline: bool) -> str | None:
    """The rule as the spec states it, one character at a time: the error, or None."""
    for c in text:
        if 0x202A <= ord(c) <= 0x202E or 0x2066 <= ord(c) <= 0x2069:
            return f"bidi control character U+{ord(c):04X} is not allowed"
        if (ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0) and not (multiline and c in "\t\n\r"):
            return f"control character U+{ord(c):04X} is not allowed"
    return None


_HOSTILE_TEXT = st.text(
    alphabet=st.one_of(
        st.characters(),
        st.sampled_from("\x00\t\n\r\x1b\x7f\x85\x9f\xa0\u202a\u202e\u2066\u2069\u2070é"),
    ),
    max_size=40,
)


@settings(max_examples=200, derandomize=True)
@given(_HOSTILE_TEXT, st.booleans())
def test_text_is_refused_for_its_first_bad_character_as_a_character_by_character_check_would(
    text: str, multiline: bool
) -> None:
    try:
        check_text(text, max_length=100, multiline=multiline)
        error = None
    except ValueError as exc:
        error = str(exc)
    assert error == _check_text_char_by_char(text, multiline)


def _deep(levels: int) -> Any:
    doc: Any = 1
    for _ in range(levels):
        doc = {"x": doc}
    return doc


_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(),  # NaN and the infinities included
    _HOSTILE_TEXT,
    st.sampled_from(["x" * (64 * 1024 + 1), "y" * (64 * 1024)]),
)
_DOCUMENTS = st.recursive(
    _SCALARS,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=3).map(tuple),
        st.dictionaries(
            st.one_of(_HOSTILE_TEXT, st.integers(), st.just("k" * 201)), children, max_size=4
        ),
        st.sampled_from(
            [_deep(15), _deep(16), _deep(17), [0] * 10_001, dict.fromkeys(range(10_001), 0)]
        ),
    ),
    max_leaves=12,
)


@settings(max_examples=300, derandomize=True)
@given(_DOCUMENTS)
def test_a_document_gets_the_verdict_and_the_error_of_the_walk_that_checks_every_value(
    document: Any,
) -> None:
    def verdict(check: Any) -> str | None:
        try:
            check(document)
        except ValueError as exc:
            return str(exc)
        return None

    assert verdict(check_document) == verdict(validation._check_document)


# --- stream messages --------------------------------------------------------------------
def test_a_valid_message_keeps_its_validated_payload_for_the_handler() -> None:
    envelope = read_message(raw_envelope("gpu.sample", sample()), "p.telemetry.gpu.n1", NOW)
    first = envelope.payload(GpuSample)
    assert envelope.payload(GpuSample) is first
    assert first.gpus[0].util == 0.5


@pytest.mark.parametrize(
    ("data", "subject", "says"),
    [
        (sample(util=math.nan), "p.telemetry.gpu.n1", "gpus.0.util"),
        (sample(temp_c=math.inf), "p.telemetry.gpu.n1", "gpus.0.temp_c"),
        (sample(mem_used_mib=101), "p.telemetry.gpu.n1", "exceeds mem_total_mib"),
        (sample(index=10**9), "p.telemetry.gpu.n1", "gpus.0.index"),
        (sample(index=True), "p.telemetry.gpu.n1", "gpus.0.index"),
        ({**sample(), "gpus": sample()["gpus"] * 2}, "p.telemetry.gpu.n1", "appears twice"),
        (sample(node="n2"), "p.telemetry.gpu.n1", "does not match the subject"),
        (sample(node="ip-1.ec2.internal"), "p.telemetry.gpu.ip-2~ec2~internal", "does not"),
        (sample(node="ip-1_ec2_internal"), "p.telemetry.gpu.ip-1~ec2~internal", "does not"),
        (sample(node="ip-1.ec2.internal"), "p.telemetry.gpu.ip-1_ec2_internal", "does not"),
        (sample(node="n1..x"), "p.telemetry.gpu.n1~~x", "cannot be used in a subject"),
        ({**sample(), "time": "9999-12-31T00:00:00Z"}, "p.telemetry.gpu.n1", "ahead"),
        ({**sample(), "time": "2000-01-01T00:00:00Z"}, "p.telemetry.gpu.n1", "old"),
        ({**sample(), "time": "2026-12-02T12:00:00"}, "p.telemetry.gpu.n1", "time zone"),
    ],
    ids=[
        "nan-util",
        "inf-temp",
        "used-above-total",
        "huge-index",
        "bool-index",
        "duplicate-index",
        "other-node",
        "other-dotted-node",
        "underscores-for-dots",
        "dots-for-underscores",
        "empty-label",
        "far-future",
        "far-past",
        "naive-time",
    ],
)
def test_a_bad_gpu_sample_is_malformed(data: dict[str, Any], subject: str, says: str) -> None:
    with pytest.raises(MalformedMessage, match=says):
        read_message(raw_envelope("gpu.sample", data), subject, NOW)


def test_a_node_named_with_dots_speaks_on_its_subject_with_tildes() -> None:
    # Kubernetes names nodes as DNS names (EKS: ip-10-0-1-23.ec2.internal).
    data = sample(node="ip-10-0-1-23.ec2.internal")
    for subject in ("p.telemetry.gpu.ip-10-0-1-23~ec2~internal",
                    "p.telemetry.gpu.7.ip-10-0-1-23~ec2~internal"):  # fmt: skip
        envelope = read_message(raw_envelope("gpu.sample", data), subject, NOW)
        assert envelope.payload(GpuSample).node == "ip-10-0-1-23.ec2.internal"


def test_inference_stats_name_the_service_of_their_subject() -> None:
    stats = {
        "service": "chat",
        "time": NOW.isoformat(),
        "window_s": 10,
        "requests": 5,
        "queue_depth": 0,
        "p50_ms": 1,
        "p99_ms": 2,
    }
    read_message(raw_envelope("inference.stats", stats), "p.telemetry.inference.chat", NOW)
    with pytest.raises(MalformedMessage, match="does not match"):
        read_message(raw_envelope("inference.stats", stats), "p.telemetry.inference.search", NOW)
    with pytest.raises(MalformedMessage, match="p99_ms"):
        read_message(
            raw_envelope("inference.stats", {**stats, "p99_ms": math.inf}),
            "p.telemetry.inference.chat",
            NOW,
        )
    assert isinstance(
        read_message(
            raw_envelope("inference.stats", stats), "p.telemetry.inference.chat", NOW
        ).payload(InferenceStats),
        InferenceStats,
    )


def test_a_job_event_names_the_job_of_its_subject() -> None:
    started = {"job_id": "j1", "attempt": 1}
    read_message(raw_envelope("job.started", started), "p.jobs.j1.events", NOW)
    with pytest.raises(MalformedMessage, match="does not match"):
        read_message(raw_envelope("job.started", started), "p.jobs.j2.events", NOW)


def test_a_newer_producers_extra_fields_are_ignored() -> None:
    data = {"job_id": "j1", "attempt": 2, "host": "gpu-node-7"}
    envelope = read_message(raw_envelope("job.started", data), "p.jobs.j1.events", NOW)
    assert envelope.payload(JobStarted).attempt == 2


def test_progress_metrics_must_be_finite() -> None:
    ok = read_message(
        raw_envelope("job.progress", {"step": 3, "loss": 0.25}), "p.jobs.j1.events", NOW
    )
    assert ok.payload(JobProgress).step == 3
    with pytest.raises(MalformedMessage, match="finite"):
        read_message(
            raw_envelope("job.progress", {"step": 3, "loss": math.nan}), "p.jobs.j1.events", NOW
        )


def test_an_unknown_type_or_a_newer_version_is_malformed_unless_the_consumer_knows_it() -> None:
    with pytest.raises(MalformedMessage, match="unknown message type"):
        read_message(raw_envelope("job.teleported", {}), "p.jobs.j1.events", NOW)
    with pytest.raises(MalformedMessage, match="reads up to v1"):
        read_message(raw_envelope("gpu.sample", sample(), version=2), "p.telemetry.gpu.n1", NOW)
    demand = raw_envelope("sim.demand", {"gpus": 3})
    own = read_message(demand, "p.cmd.agent.sim.demand", NOW, also_known={"sim.demand"})
    assert isinstance(own, Envelope)


def test_an_envelope_stamped_beyond_the_skew_window_is_malformed() -> None:
    ahead = (NOW + timedelta(seconds=301)).isoformat()
    with pytest.raises(MalformedMessage, match="ahead"):
        read_message(raw_envelope("gpu.sample", sample(), time=ahead), "p.telemetry.gpu.n1", NOW)
    within = (NOW + timedelta(seconds=299)).isoformat()
    read_message(raw_envelope("gpu.sample", sample(), time=within), "p.telemetry.gpu.n1", NOW)
    wider = read_message(
        raw_envelope("gpu.sample", sample(), time=ahead),
        "p.telemetry.gpu.n1",
        NOW,
        max_clock_skew_s=600,
    )
    assert wider.type == "gpu.sample"


def test_the_past_is_bounded_by_the_max_age_of_the_stream() -> None:
    assert stream_max_age("p.telemetry.gpu.n1") == 3600.0
    assert stream_max_age("p.jobs.j1.events") == 30 * 24 * 3600.0
    assert stream_max_age("not a subject") is None


@pytest.mark.parametrize(
    "raw",
    [b"", b"garbage", b'{"id": "x"}', raw_envelope("gpu.sample", sample(), id="a\x00b")],
    ids=["empty", "garbage", "no-fields", "nul-id"],
)
def test_bytes_that_are_no_envelope_are_malformed(raw: bytes) -> None:
    with pytest.raises(MalformedMessage):
        read_message(raw, "p.telemetry.gpu.n1", NOW)


def test_text_that_failed_validation_is_reported_escaped_and_bounded() -> None:
    assert printable("p.telemetry.gpu.n1", 200) == "p.telemetry.gpu.n1"
    shown = printable("a\u202eb\x00c", 200)
    assert shown == "a\\u202eb\\x00c"
    check_text(shown, max_length=200)
    assert len(printable("x" * 10_000, 200)) == 200


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"workload": {"steps": 0}}, "workload.steps"),
        ({"team": "t" * 65}, "team"),
        ({"name": ""}, "name"),
    ],
    ids=["zero-steps", "long-team", "empty-name"],
)
def test_a_field_bound_tighter_than_its_type_still_holds(
    change: dict[str, Any], field: str
) -> None:
    assert refused({**SUBMIT, **change}).field == field


def test_an_operator_reason_and_an_envelope_id_keep_their_own_limits() -> None:
    body = {"job_id": "j1", "operator": "ops", "reason": "r" * 1001}
    assert isinstance(parse_request(ApproveJob, json.dumps(body).encode()), Invalid)
    with pytest.raises(MalformedMessage, match="id"):
        read_message(raw_envelope("gpu.sample", sample(), id="i" * 129), "p.telemetry.gpu.n1", NOW)
