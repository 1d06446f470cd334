"""The checkpoint service verifies directory checkpoints: the manifest, then every file.

The job the test plays writes real files (and real S3 objects, in moto's server) with
the SDK's manifest writer, then confirms them with checkpoint.confirmed v2.
"""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.service.test_checkpoint_service import (
    Victim,
    ask,
    checkpoint_requested,
    evict_commands,
    outcome,
    request_eviction,
    running,
    stored,
    victim,
    wait_for,
    wait_for_audit,
    with_checkpoint,
)

from gpusched.checkpoint.api import latest_checkpoint_subject
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.messages import CheckpointConfirmed, StageName, T
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings
from gpusched.sdk import SavedCheckpoint, write_manifest
from gpusched.sdk.storage import Location


def write_shards(
    where: str, step: int, sizes: tuple[int, ...] = (1000, 3000, 70)
) -> SavedCheckpoint:
    """A directory checkpoint as torch.distributed.checkpoint lays it out, and its manifest."""
    directory = Location.of(where)
    directory.makedirs()
    for rank, size in enumerate(sizes[:-1]):
        directory.child(f"__{rank}_0.distcp").write_bytes(bytes([rank + step]) * size)
    directory.child(".metadata").write_bytes(b"m" * sizes[-1])
    return write_manifest(directory, checkpoint_id=f"ckpt-{step}", step=step)


async def confirm_manifest(
    rt: ServiceRuntime, v: Victim, saved: SavedCheckpoint, request_id: str | None = None
) -> None:
    payload = CheckpointConfirmed(
        request_id=request_id,
        checkpoint_id=saved.checkpoint_id,
        step=saved.step,
        uri=saved.uri,
        bytes=saved.bytes,
        sha256=saved.sha256,
        stage=StageName.PERSISTED,
        kind=saved.kind,
    )
    envelope = make_envelope(
        T.CHECKPOINT_CONFIRMED, payload, source="test", correlation_id=v.job_id
    ).model_copy(update={"version": payload.version})
    await rt.js.publish(rt.subjects.job_events(v.job_id), envelope.to_bytes())


async def test_a_directory_checkpoint_is_verified_file_by_file_and_evicted_on(
    settings: Settings, tmp_path: Path
) -> None:
    async with running(with_checkpoint(settings, grace_s=120.0)) as rt:
        v = victim()
        await request_eviction(rt, v)
        await checkpoint_requested(rt, v)
        saved = write_shards(str(tmp_path / "step-9"), 9)
        await confirm_manifest(rt, v, saved, v.request_id)

        [evict] = await wait_for(rt, evict_commands(rt))
        assert evict.data["job_id"] == v.job_id
        [announced] = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED))
        assert announced.data["checkpoint"]["uri"] == saved.uri
        assert announced.data["checkpoint"]["sha256"] == saved.sha256
        latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": v.job_id})
        assert latest["checkpoint"]["uri"].endswith("gpusched-manifest.json")


async def test_a_manifest_with_one_wrong_file_hash_is_refused_as_unverified(
    settings: Settings, tmp_path: Path
) -> None:
    async with running(with_checkpoint(settings, grace_s=120.0)) as rt:
        v = victim()
        await request_eviction(rt, v)
        saga_id = (await checkpoint_requested(rt, v)).correlation_id
        assert saga_id is not None
        saved = write_shards(str(tmp_path / "step-9"), 9)
        # One shard changes after the manifest described it: same size, other bytes.
        shard = tmp_path / "step-9" / "__1_0.distcp"
        shard.write_bytes(b"\xff" * shard.stat().st_size)
        await confirm_manifest(rt, v, saved, v.request_id)

        refused = await wait_for_audit(rt, saga_id, "checkpoint.unverified")
        assert refused["details"]["verification"] == "false"
        assert refused["details"]["kind"] == "manifest"
        assert "1 of 3 listed files do not match: __1_0.distcp" in refused["reason"]
        assert await stored(rt, evict_commands(rt)) == []
        assert await stored(rt, outcome(rt, T.CHECKPOINT_VERIFIED)) == []
        latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": v.job_id})
        assert latest["checkpoint"] is None


async def test_a_checkpoint_not_verified_within_its_time_budget_is_refused(
    settings: Settings, tmp_path: Path
) -> None:
    hurried = with_checkpoint(settings, verify_budget_s=1e-6, verify_budget_s_per_gb=0.0)
    async with running(hurried) as rt:
        v = victim()
        saved = write_shards(str(tmp_path / "step-3"), 3, sizes=(4 << 20, 4 << 20, 10))
        await confirm_manifest(rt, v, saved)

        refused = await wait_for_audit(rt, v.job_id, "checkpoint.unverified")
        assert refused["details"]["verification"] == "incomplete"
        assert "within the budget" in refused["reason"]


async def test_checkpoints_in_s3_are_verified_there_and_a_tampered_object_is_refused(
    settings: Settings, s3: dict[str, str]
) -> None:
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    Location.of(f"s3://{bucket}").fs.mkdir(bucket)
    reading_s3 = with_checkpoint(settings, verify_schemes=["file", "s3"])
    async with running(reading_s3) as rt:
        good, bad = victim(), victim()
        saved = write_shards(f"s3://{bucket}/{good.job_id}/step-5", 5)
        assert saved.uri == f"s3://{bucket}/{good.job_id}/step-5/gpusched-manifest.json"
        await confirm_manifest(rt, good, saved)
        [announced] = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED))
        assert announced.data["checkpoint"]["uri"] == saved.uri

        forged = write_shards(f"s3://{bucket}/{bad.job_id}/step-5", 5)
        shard = Location.of(f"s3://{bucket}/{bad.job_id}/step-5/__0_0.distcp")
        shard.fs.pipe_file(shard.path, b"\x00" * 1000)  # same size, other bytes
        await confirm_manifest(rt, bad, forged)
        refused = await wait_for_audit(rt, bad.job_id, "checkpoint.unverified")
        assert refused["details"]["verification"] == "false"
        assert refused["details"]["scheme"] == "s3"
        assert "__0_0.distcp" in refused["reason"]
        assert len(await stored(rt, outcome(rt, T.CHECKPOINT_VERIFIED))) == 1
