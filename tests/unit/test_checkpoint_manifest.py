"""The manifest of a directory checkpoint and the pure judgement of a manifest claim."""

from __future__ import annotations

import hashlib
import json

import pytest

from gpusched.checkpoint.verification import (
    ClaimCheck,
    ManifestFacts,
    ObjectFacts,
    budget_s,
    judge_manifest,
)
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.manifest import MalformedManifest, Manifest, ManifestFile
from gpusched.contracts.messages import CheckpointConfirmed, CheckpointKind, StageName, T
from gpusched.contracts.validation import read_message
from gpusched.domain.saga import CheckpointRef, Stage


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def entry(path: str, data: bytes) -> ManifestFile:
    return ManifestFile(path=path, bytes=len(data), sha256=sha(data))


SHARDS = {".metadata": b"meta", "__0_0.distcp": b"rank zero", "__1_0.distcp": b"rank one!"}
MANIFEST = Manifest(checkpoint_id="ckpt-7", step=7, files=[entry(p, d) for p, d in SHARDS.items()])
RAW = MANIFEST.to_bytes()
CLAIM = CheckpointRef(
    "ckpt-7", 7, "file:///ckpt/gpusched-manifest.json", len(RAW), sha(RAW), Stage.PERSISTED
)


def facts(stored: dict[str, bytes] | None = None, **changes: object) -> ManifestFacts:
    held = SHARDS if stored is None else stored
    seen = tuple(
        (
            e,
            ObjectFacts(True, len(held[e.path]), sha(held[e.path]))
            if e.path in held
            else ObjectFacts(False),
        )
        for e in MANIFEST.files
    )
    base = {
        "manifest": ObjectFacts(True, len(RAW), sha(RAW)),
        "listed": MANIFEST,
        "files": seen,
        "budget_s": 30.0,
    }
    return ManifestFacts(**{**base, **changes})  # type: ignore[arg-type]


def test_a_manifest_whose_every_file_matches_is_verified() -> None:
    verdict = judge_manifest(CLAIM, facts())
    assert verdict.check is ClaimCheck.VERIFIED, verdict
    assert "3 files" in verdict.why


def test_one_file_with_a_wrong_hash_makes_the_whole_checkpoint_false() -> None:
    verdict = judge_manifest(CLAIM, facts({**SHARDS, "__1_0.distcp": b"rank ONE!"}))
    assert verdict.check is ClaimCheck.FALSE
    assert "__1_0.distcp" in verdict.why and "sha256" in verdict.why


def test_a_missing_shard_makes_the_checkpoint_false() -> None:
    shards = {p: d for p, d in SHARDS.items() if p != "__0_0.distcp"}
    verdict = judge_manifest(CLAIM, facts(shards))
    assert verdict.check is ClaimCheck.FALSE and "missing" in verdict.why


def test_a_manifest_that_is_not_the_claimed_one_is_false_before_any_file_is_read() -> None:
    verdict = judge_manifest(CLAIM, facts(manifest=ObjectFacts(True, len(RAW), "0" * 64)))
    assert verdict.check is ClaimCheck.FALSE and verdict.why.startswith("manifest ")


def test_a_manifest_of_another_checkpoint_is_false() -> None:
    other = Manifest(checkpoint_id="ckpt-1", step=1, files=list(MANIFEST.files))
    verdict = judge_manifest(CLAIM, facts(listed=other))
    assert verdict.check is ClaimCheck.FALSE and "ckpt-1" in verdict.why


def test_files_not_checked_within_the_budget_leave_the_claim_unverified() -> None:
    verdict = judge_manifest(CLAIM, facts(files=facts().files[:1], unfinished=2))
    assert verdict.check is ClaimCheck.INCOMPLETE
    assert not verdict.counts
    assert "2 of 3" in verdict.why


def test_the_budget_grows_with_the_bytes_listed() -> None:
    assert budget_s(0, 30, 20) == 30
    assert budget_s(10 * 10**9, 30, 20) == 230


@pytest.mark.parametrize(
    "path",
    ["../etc/passwd", "/etc/passwd", "a/../../b", "a//b", "./a", "c:/x", "a\\b", "x\ny",
     "gpusched-manifest.json"],
)  # fmt: skip
def test_a_manifest_listing_a_path_outside_its_directory_is_malformed(path: str) -> None:
    body = json.loads(RAW)
    body["files"][0]["path"] = path
    with pytest.raises(MalformedManifest):
        Manifest.parse(json.dumps(body).encode())


@pytest.mark.parametrize(
    "raw",
    [b"not json", b"[]", b'{"format": "other/1"}',
     json.dumps({**json.loads(RAW), "files": []}).encode(),
     json.dumps({**json.loads(RAW), "files": [json.loads(RAW)["files"][0]] * 2}).encode()],
)  # fmt: skip
def test_what_is_no_manifest_is_refused_with_a_reason(raw: bytes) -> None:
    with pytest.raises(MalformedManifest):
        Manifest.parse(raw)


def test_the_same_manifest_is_always_the_same_bytes() -> None:
    shuffled = Manifest(checkpoint_id="ckpt-7", step=7, files=list(reversed(MANIFEST.files)))
    assert shuffled.to_bytes() == RAW
    assert Manifest.parse(RAW) == Manifest.parse(shuffled.to_bytes())


def confirmed(kind: CheckpointKind) -> CheckpointConfirmed:
    return CheckpointConfirmed(
        request_id=None, checkpoint_id="c", step=1, uri="file:///c", bytes=1,
        sha256="0" * 64, stage=StageName.PERSISTED, kind=kind,
    )  # fmt: skip


def test_a_single_file_confirmation_stays_v1_and_a_manifest_one_is_v2() -> None:
    assert confirmed(CheckpointKind.FILE).version == 1
    assert confirmed(CheckpointKind.MANIFEST).version == 2


def test_a_v1_confirmation_without_kind_reads_as_a_single_file() -> None:
    from datetime import UTC, datetime

    data = confirmed(CheckpointKind.FILE).model_dump(mode="json")
    del data["kind"]
    envelope = make_envelope(T.CHECKPOINT_CONFIRMED, confirmed(CheckpointKind.FILE), source="job")
    raw = envelope.model_copy(update={"data": data}).to_bytes()
    read = read_message(raw, "p.jobs.j.events", datetime.now(UTC))
    assert read.payload(CheckpointConfirmed).kind is CheckpointKind.FILE
    v2 = envelope.model_copy(update={"version": 2, "data": {**data, "kind": "manifest"}})
    assert (
        read_message(v2.to_bytes(), "p.jobs.j.events", datetime.now(UTC))
        .payload(CheckpointConfirmed)
        .kind
        is CheckpointKind.MANIFEST
    )
