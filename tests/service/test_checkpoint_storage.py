"""The checkpoint service's storage adapter on real files: what a claim may make it read."""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpusched.checkpoint.storage import Budget, FsspecStorage
from gpusched.checkpoint.verification import ClaimCheck
from gpusched.contracts.manifest import ManifestFile
from gpusched.contracts.messages import CheckpointKind
from gpusched.domain.saga import CheckpointRef, Stage
from gpusched.sdk import SavedCheckpoint, write_manifest
from gpusched.sdk.storage import Location


def shards(directory: Path) -> SavedCheckpoint:
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"a" * 100)
    (directory / ".metadata").write_bytes(b"m" * 10)
    return write_manifest(Location.of(directory), checkpoint_id="c-1", step=1)


def claim(saved: SavedCheckpoint) -> CheckpointRef:
    return CheckpointRef(saved.checkpoint_id, saved.step, saved.uri, saved.bytes, saved.sha256,
                         Stage.PERSISTED)  # fmt: skip


async def test_a_true_manifest_is_verified_and_a_changed_shard_is_not(tmp_path: Path) -> None:
    saved = shards(tmp_path / "c")
    storage = FsspecStorage()
    verdict = await storage.verify(claim(saved), CheckpointKind.MANIFEST)
    assert verdict is not None and verdict.check is ClaimCheck.VERIFIED
    (tmp_path / "c" / ".metadata").write_bytes(b"M" * 10)
    verdict = await storage.verify(claim(saved), CheckpointKind.MANIFEST)
    assert verdict is not None and verdict.check is ClaimCheck.FALSE
    assert ".metadata" in verdict.why


async def test_a_listed_file_that_is_a_link_elsewhere_is_never_read(tmp_path: Path) -> None:
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"s" * 100)
    directory = tmp_path / "c"
    saved = shards(directory)
    # The job swaps a shard for a link to a file it may not read, of the same bytes.
    (directory / "__0_0.distcp").unlink()
    os.symlink(secret, directory / "__0_0.distcp")
    secret.write_bytes(b"a" * 100)
    verdict = await FsspecStorage().verify(claim(saved), CheckpointKind.MANIFEST)
    assert verdict is not None and verdict.check is ClaimCheck.FALSE
    assert "symbolic link" in verdict.why


def file_claim(path: Path, uri: str | None = None) -> CheckpointRef:
    """A true claim of one file, named by `uri` (default: the file's own)."""
    from gpusched.sdk.checkpoints import file_digest

    size, digest = file_digest(path)
    return CheckpointRef("c-1", 1, uri or path.as_uri(), size, digest, Stage.PERSISTED)


async def test_claims_outside_the_file_roots_are_refused_unread(tmp_path: Path) -> None:
    root, elsewhere = tmp_path / "jobs", tmp_path / "elsewhere"
    inside = shards(root / "job-1" / "c")
    outside = shards(elsewhere / "c")
    secret = elsewhere / "secret.key"
    secret.write_bytes(b"s" * 100)
    (root / "job-2").symlink_to(elsewhere, target_is_directory=True)
    storage = FsspecStorage(file_roots=[root])

    verdict = await storage.verify(claim(inside), CheckpointKind.MANIFEST)
    assert verdict is not None and verdict.check is ClaimCheck.VERIFIED
    for refused, kind in (
        (claim(outside), CheckpointKind.MANIFEST),
        (file_claim(secret), CheckpointKind.FILE),
        # Under the root by its text only: `..` climbs out, or a directory link leads out.
        (file_claim(secret, f"{(root / 'job-1').as_uri()}/../../elsewhere/secret.key"),
         CheckpointKind.FILE),
        (file_claim(secret, f"{(root / 'job-2').as_uri()}/secret.key"), CheckpointKind.FILE),
        # A wrong size would be told apart from a missing file: refused before a stat.
        (replace(file_claim(secret), bytes=99), CheckpointKind.FILE),
    ):  # fmt: skip
        verdict = await storage.verify(refused, kind)
        assert verdict is not None and verdict.check is ClaimCheck.FALSE, refused.uri
        assert "outside the checkpoint directories" in verdict.why, verdict.why
        assert "100 bytes" not in verdict.why  # nothing of the file is told
    # Without roots, the service reads any file it can (the setting's default).
    verdict = await FsspecStorage().verify(claim(outside), CheckpointKind.MANIFEST)
    assert verdict is not None and verdict.check is ClaimCheck.VERIFIED


async def test_a_manifest_listing_a_file_under_a_directory_link_out_of_the_roots_is_false(
    tmp_path: Path,
) -> None:
    root, elsewhere = tmp_path / "jobs", tmp_path / "elsewhere"
    directory = root / "job-1" / "c"
    directory.mkdir(parents=True)
    (elsewhere / "shards").mkdir(parents=True)
    (elsewhere / "shards" / "__0_0.distcp").write_bytes(b"a" * 100)
    (directory / "shards").symlink_to(elsewhere / "shards", target_is_directory=True)
    listed = ManifestFile(path="shards/__0_0.distcp", bytes=100,
                          sha256=hashlib.sha256(b"a" * 100).hexdigest())  # fmt: skip
    saved = write_manifest(Location.of(directory), checkpoint_id="c-1", step=1, files=[listed])

    verdict = await FsspecStorage(file_roots=[root]).verify(claim(saved), CheckpointKind.MANIFEST)

    assert verdict is not None and verdict.check is ClaimCheck.FALSE
    assert "outside the checkpoint directories" in verdict.why, verdict.why


async def test_a_scheme_it_is_not_told_to_read_is_left_to_the_trust_policy(
    tmp_path: Path,
) -> None:
    saved = shards(tmp_path / "c")
    s3_claim = CheckpointRef("c-1", 1, "s3://bucket/c/gpusched-manifest.json", saved.bytes,
                             saved.sha256, Stage.PERSISTED)  # fmt: skip
    assert await FsspecStorage().verify(s3_claim, CheckpointKind.MANIFEST) is None


def test_a_scheme_whose_backend_is_missing_stops_the_service_at_start_naming_it() -> None:
    with pytest.raises(ValueError, match="verify_schemes names 'nosuchstore'"):
        FsspecStorage(["file", "nosuchstore"])


async def test_a_single_file_larger_than_its_budget_allows_is_incomplete(tmp_path: Path) -> None:
    path = tmp_path / "big.pt"
    path.write_bytes(b"x" * (8 << 20))
    size, sha256 = Location.of(path).digest()
    ref = CheckpointRef("c-2", 2, path.as_uri(), size, sha256, Stage.PERSISTED)
    hurried = FsspecStorage(budget=Budget(base_s=1e-9, per_gb_s=0.0))
    verdict = await hurried.verify(ref, CheckpointKind.FILE)
    assert verdict is not None and verdict.check is ClaimCheck.INCOMPLETE
    relaxed = await FsspecStorage().verify(ref, CheckpointKind.FILE)
    assert relaxed is not None and relaxed.check is ClaimCheck.VERIFIED
