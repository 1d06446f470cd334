"""The published AsyncAPI document is generated from the schemas the services use."""

from __future__ import annotations

import json
from pathlib import Path

from gpusched.contracts.asyncapi import document
from gpusched.contracts.messages import T

REPO = Path(__file__).resolve().parents[2]


def test_every_public_subject_is_a_channel_of_the_document() -> None:
    addresses = {c["address"] for c in document()["channels"].values()}
    assert {
        "gpusched.jobs.{job_id}.control",
        "gpusched.jobs.{job_id}.events",
        "gpusched.telemetry.gpu.{node}",
        "gpusched.telemetry.inference.{service}",
        "gpusched.audit.{action}",
        "gpusched.api.jobs.submit",
        "gpusched.api.jobs.get",
    } <= addresses


def test_every_public_message_type_is_described_with_its_envelope() -> None:
    schemas = document()["components"]["schemas"]
    public = [
        T.CHECKPOINT_REQUESTED, T.PREEMPTION_CANCELLED, T.RESUME, T.JOB_STARTED,
        T.JOB_PROGRESS, T.CHECKPOINT_CONFIRMED, T.CHECKPOINT_FAILED, T.JOB_COMPLETED,
        T.JOB_FAILED, T.GPU_SAMPLE, T.INFERENCE_STATS, T.AUDIT,
    ]  # fmt: skip
    consts = {
        s["properties"]["type"].get("const")
        for s in schemas.values()
        if "properties" in s and "type" in s["properties"]
    }
    assert set(public) <= consts
    confirmed = schemas["CheckpointConfirmedMessage"]
    assert {"id", "type", "source", "time", "data"} <= set(confirmed["required"])


def test_the_prefix_is_applied_to_every_address() -> None:
    addresses = [c["address"] for c in document("acme")["channels"].values()]
    assert addresses and all(a.startswith("acme.") for a in addresses)


def test_the_committed_document_matches_the_schemas() -> None:
    committed = json.loads((REPO / "docs" / "asyncapi.json").read_text())
    assert committed == document(), (
        "docs/asyncapi.json is stale: regenerate with `gpusched asyncapi > docs/asyncapi.json`"
    )
