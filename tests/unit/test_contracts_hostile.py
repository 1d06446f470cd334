"""Hostile inputs at the contract edge and in the SDK's view of them, without I/O: a job
speaking for another job, workloads and node specs sized to stall a service, JSON
nested past the parser, times a receiver cannot compare or wait for, and verdicts that
would tell a claimant what a file it may not read holds."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from gpusched.checkpoint.verification import ClaimCheck, ObjectFacts, judge, judge_file
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.identity import REQUEST_INFO_HEADER, CallerKind, caller_from_headers
from gpusched.contracts.manifest import MalformedManifest, Manifest, ManifestFile
from gpusched.contracts.messages import (
    AddNode,
    AuditRecord,
    CheckpointRequested,
    EvictionRequested,
    SubmitJob,
)
from gpusched.contracts.validation import Invalid, parse_request, read_message
from gpusched.domain.saga import CheckpointRef, Stage
from gpusched.sdk.control import MAX_SECONDS_LEFT, CheckpointRequest, control_message

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)
# Deep enough for any recursive JSON parser; a few hundred kB, well inside the bounds.
DEEP = b"[" * 200_000 + b"]" * 200_000


def raw_envelope(message_type: str, data: dict[str, Any], **fields: Any) -> bytes:
    envelope = {
        "id": "m-1",
        "type": message_type,
        "version": 1,
        "source": "sdk",
        "time": NOW.isoformat(),
        "data": data,
        **fields,
    }
    return json.dumps(envelope).encode()


CONFIRMED = {
    "request_id": None,
    "checkpoint_id": "c1",
    "step": 10,
    "uri": "s3://attacker-bucket/evil.pt",
    "bytes": 1,
    "sha256": "0" * 64,
    "stage": "persisted",
}
FAILED = {"request_id": "req-of-b", "error": "disk full"}


# --- a job speaks only for itself ---------------------------------------------------------


@pytest.mark.parametrize(
    ("message_type", "data"),
    [
        ("checkpoint.confirmed", CONFIRMED),
        ("checkpoint.failed", FAILED),
        ("job.progress", {"step": 3}),
    ],
)
def test_a_job_event_whose_correlation_id_names_another_job_is_malformed(
    message_type: str, data: dict[str, Any]
) -> None:
    # Job A may publish only on its own events subject; the correlation id is what the
    # checkpoint service reads the job from when the payload names none.
    raw = raw_envelope(message_type, data, correlation_id="job-b")
    with pytest.raises(MalformedMessage, match=r"correlation id 'job-b'.*'job-a'"):
        read_message(raw, "gpusched.jobs.job-a.events", NOW)


@pytest.mark.parametrize("message_type", ["checkpoint.confirmed", "checkpoint.failed"])
def test_a_job_event_about_its_own_job_or_naming_none_is_read(message_type: str) -> None:
    data = CONFIRMED if message_type == "checkpoint.confirmed" else FAILED
    raw = raw_envelope(message_type, data, correlation_id="job-a")
    own = read_message(raw, "gpusched.jobs.job-a.events", NOW)
    assert own.correlation_id == "job-a"
    # No correlation id: the service refuses it for want of a job, not the edge.
    read_message(raw_envelope(message_type, data), "gpusched.jobs.job-a.events", NOW)


def test_a_type_the_consumer_handles_itself_is_held_to_the_subjects_job_too() -> None:
    raw = raw_envelope("sim.custom", {"x": 1}, correlation_id="job-b")
    with pytest.raises(MalformedMessage, match="correlation id"):
        read_message(raw, "gpusched.jobs.job-a.events", NOW, also_known={"sim.custom"})


def test_the_correlation_id_of_other_subjects_is_not_a_job() -> None:
    # A command's correlation id is a saga; only job events subjects name a job.
    data = {"request_id": "r1", "reason": "need gone"}
    read_message(
        raw_envelope("eviction.withdrawn", data, correlation_id="saga-1"),
        "gpusched.cmd.checkpoint.eviction.withdrawn",
        NOW,
    )


# --- simulated workloads that would never end, or never advance ---------------------------


def submit(workload: dict[str, Any]) -> SubmitJob | Invalid:
    body = {"name": "j", "team": "t", "gpus": {"count": 1}, "workload": workload}
    return parse_request(SubmitJob, json.dumps(body).encode())


@pytest.mark.parametrize("step_seconds", [1e-300, 5e-324, 0.0009])
def test_a_simulated_step_shorter_than_a_millisecond_is_invalid(step_seconds: float) -> None:
    invalid = submit({"kind": "sim", "steps": 10**12, "step_seconds": step_seconds})
    assert isinstance(invalid, Invalid)
    assert invalid.field == "workload.step_seconds"
    assert "0.001" in invalid.message


def test_a_workload_longer_than_about_31_years_is_invalid_and_says_why() -> None:
    invalid = submit({"steps": 10**12, "step_seconds": 1.0})
    assert isinstance(invalid, Invalid)
    assert invalid.field == "workload"
    assert "steps x step_seconds" in invalid.message and "1e+09" in invalid.message


def test_the_shortest_step_and_the_longest_workload_are_accepted() -> None:
    assert isinstance(submit({"steps": 10**12, "step_seconds": 0.001}), SubmitJob)
    assert isinstance(submit({"steps": 10**9, "step_seconds": 1}), SubmitJob)


# --- node specs: count x gpus -------------------------------------------------------------


def add_node(**spec: Any) -> AddNode | Invalid:
    base = {"pool": "shared", "gpu_model": "A100-80GB", "cpu_milli": 1000, "memory_mib": 1000}
    body = {"spec": {**base, **spec}, "operator": "op"}
    return parse_request(AddNode, json.dumps(body).encode())


def test_nodes_whose_gpus_add_up_past_the_limit_are_refused_before_parsing() -> None:
    invalid = add_node(name_prefix="x", count=10_000, gpus=1024)
    assert isinstance(invalid, Invalid)
    assert invalid.field == "spec"
    assert "count x gpus: at most 100,000 GPUs" in invalid.message
    assert "10,240,000" in invalid.message


def test_ten_thousand_nodes_of_eight_gpus_and_one_node_of_1024_are_accepted() -> None:
    assert isinstance(add_node(name_prefix="x", count=10_000, gpus=8), AddNode)
    assert isinstance(add_node(name="big", gpus=1024), AddNode)


# --- JSON nested past the parser ----------------------------------------------------------


def test_a_manifest_nested_past_the_parser_is_malformed_not_a_crash() -> None:
    with pytest.raises(MalformedManifest):
        Manifest.parse(DEEP)
    with pytest.raises(MalformedManifest):
        Manifest.parse(b'{"format": "gpusched.manifest/1", "x": ' + DEEP + b"}")


def test_request_info_nested_past_the_parser_is_an_unreadable_caller() -> None:
    caller = caller_from_headers({REQUEST_INFO_HEADER: DEEP.decode()}, None)
    assert caller.kind is CallerKind.UNKNOWN


# --- times a receiver compares with its own aware clock -----------------------------------


def requested(deadline: str) -> bytes:
    data = {
        "request_id": "r",
        "job_id": "j",
        "reason": "surge",
        "deadline": deadline,
        "stage_required": "persisted",
    }
    return raw_envelope("checkpoint.requested", data)


@pytest.mark.parametrize("deadline", ["2030-01-01T00:00:00", "9999-12-31T23:59:59-12:00"])
def test_a_deadline_without_a_time_zone_or_outside_utc_is_a_malformed_request(
    deadline: str,
) -> None:
    with pytest.raises(MalformedMessage, match="deadline"):
        control_message(Envelope.from_bytes(requested(deadline)))


@pytest.mark.parametrize(
    ("deadline", "left"),
    [
        ("0001-01-01T00:00:00Z", -MAX_SECONDS_LEFT),
        ("9999-12-31T23:59:59Z", MAX_SECONDS_LEFT),
        ("9999-12-31T23:59:59+14:00", MAX_SECONDS_LEFT),
    ],
)
def test_seconds_left_of_a_far_deadline_is_a_number_the_standard_waits_accept(
    deadline: str, left: float
) -> None:
    request = control_message(Envelope.from_bytes(requested(deadline)))
    assert isinstance(request, CheckpointRequest)
    assert request.seconds_left() == left
    assert left <= 1e9  # threading.TIMEOUT_MAX and time.sleep allow ~9.2e9 s


def test_seconds_left_of_a_near_deadline_is_exact() -> None:
    request = control_message(Envelope.from_bytes(requested("2026-12-02T12:05:00Z")))
    assert isinstance(request, CheckpointRequest)
    assert request.seconds_left(NOW) == 300.0
    assert request.seconds_left(NOW + timedelta(minutes=10)) == -300.0


def test_public_messages_refuse_naive_times() -> None:
    with pytest.raises(ValidationError, match="timezone"):
        CheckpointRequested.model_validate(
            {
                "request_id": "r",
                "job_id": "j",
                "reason": "x",
                "deadline": "2030-01-01T00:00:00",
                "stage_required": "persisted",
            }
        )
    with pytest.raises(ValidationError, match="timezone"):
        AuditRecord.model_validate(
            {"action": "a", "actor": "b", "entity": "c", "reason": "", "time": "2030-01-01T00:00"}
        )


# --- a refused claim does not tell what storage holds -------------------------------------

HELD_SHA256 = "f" * 64
CLAIM = CheckpointRef("c1", 1, "file:///etc/passwd", 5, "0" * 64, Stage.PERSISTED)


def test_a_refused_claim_says_what_does_not_match_never_the_size_or_digest_held() -> None:
    wrong_size = judge(CLAIM, ObjectFacts(True, 1274))
    assert wrong_size.check is ClaimCheck.FALSE
    assert "1274" not in wrong_size.why and "5 bytes" in wrong_size.why
    wrong_digest = judge(CLAIM, ObjectFacts(True, 5, HELD_SHA256))
    assert wrong_digest.check is ClaimCheck.FALSE
    assert HELD_SHA256 not in wrong_digest.why and "sha256 does not match" in wrong_digest.why


def test_a_listed_file_that_does_not_match_is_named_without_what_it_holds() -> None:
    entry = ManifestFile(path="__0_0.distcp", bytes=5, sha256="0" * 64)
    size = judge_file(entry, ObjectFacts(True, 1274))
    digest = judge_file(entry, ObjectFacts(True, 5, HELD_SHA256))
    assert size is not None and "1274" not in size
    assert digest is not None and HELD_SHA256 not in digest


_EVICTION = {
    "request_id": "r", "decision_id": "d", "allocation_id": "a", "job_id": "j", "team": "t",
    "priority_class": "p2-offline", "gpus": 1, "started_at": "2026-12-05T00:00:00Z",
    "reason": "surge",
}  # fmt: skip


@pytest.mark.parametrize("share", [True, "500", 2.5, 0, -1, 1001, 10**12, None])
def test_an_eviction_request_refuses_a_share_that_is_not_1_to_1000_milli(share: Any) -> None:
    with pytest.raises(ValidationError, match="share_milli"):
        EvictionRequested.model_validate_json(json.dumps({**_EVICTION, "share_milli": share}))
    # Absent, it is a whole GPU (senders before shares were kept).
    assert EvictionRequested.model_validate_json(json.dumps(_EVICTION)).share_milli == 1000
