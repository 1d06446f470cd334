"""The published AsyncAPI document: built from the models the services validate with, in a
shape a code generator can use, and accepted by the real AsyncAPI parser."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpusched.contracts.asyncapi import document
from gpusched.contracts.messages import T

REPO = Path(__file__).resolve().parents[2]
PARSER = REPO / "tests" / "tools" / "asyncapi"


def _resolve(doc: dict[str, Any], ref: str) -> Any:
    """What a `$ref` points at, following references to references."""
    node: Any = doc
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return _resolve(doc, node["$ref"]) if isinstance(node, dict) and "$ref" in node else node


def test_every_public_subject_and_endpoint_is_a_channel_of_the_document() -> None:
    addresses = {c["address"] for c in document()["channels"].values()}
    assert {
        "gpusched.jobs.{job_id}.control",
        "gpusched.jobs.{job_id}.events",
        "gpusched.telemetry.gpu.{node}",
        "gpusched.telemetry.inference.{service}",
        "gpusched.audit.{action}",
        "gpusched.api.jobs.submit",
        "gpusched.api.jobs.get",
        "gpusched.api.jobs.why",
        "gpusched.api.jobs.list",
        "gpusched.api.jobs.approve",
        "gpusched.api.jobs.cancel",
        "gpusched.api.jobs.scale",
        "gpusched.api.nodes.add",
        "gpusched.api.nodes.drain",
        "gpusched.api.nodes.list",
        "gpusched.api.checkpoints.history",
        "gpusched.api.checkpoints.latest",
        "gpusched.api.sagas.get",
        "gpusched.api.billing.statement",
        "gpusched.api.billing.job",
    } <= addresses


def test_every_endpoint_the_services_serve_is_in_the_document() -> None:
    # What the service grants say each service answers, against the document's channels.
    from gpusched.contracts.permissions import grants

    addresses = {c["address"] for c in document()["channels"].values() if c["address"]}
    served = {s for grant in grants().values() for s in grant.serves}
    for pattern in served:
        root = "gpusched." + pattern.removesuffix(".>")
        assert any(a.startswith(root + ".") for a in addresses), pattern


def test_messages_have_names_and_each_stream_message_its_envelope() -> None:
    doc = document()
    messages = doc["components"]["messages"]
    assert "Message" not in messages and "SubscribeMessage" not in messages
    public = [
        T.CHECKPOINT_REQUESTED, T.PREEMPTION_CANCELLED, T.RESUME, T.JOB_STARTED,
        T.JOB_PROGRESS, T.CHECKPOINT_CONFIRMED, T.CHECKPOINT_FAILED, T.JOB_COMPLETED,
        T.JOB_FAILED, T.GPU_SAMPLE, T.INFERENCE_STATS, T.AUDIT,
    ]  # fmt: skip
    names = {message["name"] for message in messages.values()}
    assert set(public) <= names
    confirmed = messages["CheckpointConfirmed"]
    payload = _resolve(doc, confirmed["payload"]["$ref"])
    assert {"id", "type", "source", "time", "data"} <= set(payload["required"])
    assert payload["properties"]["type"]["const"] == "checkpoint.confirmed"


def test_request_reply_is_one_operation_with_a_reply_object_and_no_invented_channel() -> None:
    doc = document()
    submit = doc["operations"]["submitJob"]
    assert submit["action"] == "receive"
    request_channel = _resolve(doc, submit["channel"]["$ref"])
    assert request_channel["address"] == "gpusched.api.jobs.submit"
    reply_channel = _resolve(doc, submit["reply"]["channel"]["$ref"])
    # The reply goes to the requester's inbox: no fixed address, no `*.reply` subject.
    assert reply_channel["address"] is None
    [reply_message] = submit["reply"]["messages"]
    assert _resolve(doc, reply_message["$ref"])["name"] == "SubmitReply"
    assert not [c for c in doc["channels"].values() if (c["address"] or "").endswith(".reply")]


def test_the_correlation_id_points_at_the_envelope_field_in_the_payload() -> None:
    doc = document()
    [correlation] = doc["components"]["correlationIds"].values()
    assert correlation["location"] == "$message.payload#/correlation_id"
    payload = _resolve(doc, doc["components"]["messages"]["JobStarted"]["payload"]["$ref"])
    assert "correlation_id" in payload["properties"]


def test_the_prefix_is_applied_to_every_address() -> None:
    addresses = [c["address"] for c in document("acme")["channels"].values() if c["address"]]
    assert addresses and all(a.startswith("acme.") for a in addresses)


def test_the_committed_document_matches_the_schemas() -> None:
    committed = json.loads((REPO / "docs" / "asyncapi.json").read_text())
    assert committed == document(), (
        "docs/asyncapi.json is stale: regenerate with `gpusched asyncapi > docs/asyncapi.json`"
    )


def test_the_real_asyncapi_parser_accepts_the_document_without_an_error_or_warning(
    tmp_path: Path,
) -> None:
    node = shutil.which("node")
    if node is None or not (PARSER / "node_modules" / "@asyncapi" / "parser").is_dir():
        pytest.skip("the npm @asyncapi/parser is not installed (`make test-tools` installs it)")
    spec = tmp_path / "asyncapi.json"
    spec.write_text(json.dumps(document()))
    result = subprocess.run(
        [node, str(PARSER / "validate.mjs"), str(spec)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    diagnostics = [json.loads(line) for line in result.stdout.splitlines() if line.strip()]
    # Severity 0 is an error, 1 a warning; 2-3 are hints (e.g. "3.1.0 exists").
    serious = [d for d in diagnostics if d["severity"] <= 1]
    assert result.returncode == 0 and not serious, (result.stderr, serious)


def test_the_parser_test_would_catch_a_broken_document(tmp_path: Path) -> None:
    node = shutil.which("node")
    if node is None or not (PARSER / "node_modules" / "@asyncapi" / "parser").is_dir():
        pytest.skip("the npm @asyncapi/parser is not installed (`make test-tools` installs it)")
    broken = document()
    broken["operations"]["submitJob"]["reply"]["channel"] = {"$ref": "#/channels/nowhere"}
    spec = tmp_path / "asyncapi.json"
    spec.write_text(json.dumps(broken))
    result = subprocess.run(
        [node, str(PARSER / "validate.mjs"), str(spec)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode != 0 or '"severity":0' in result.stdout
