"""The checkpoint service against a hostile job, on the real NATS and PostgreSQL: a job
that speaks for another job, a manifest nested past the JSON parser, and file claims
that name what is no checkpoint (a device, a FIFO, a file the job may not read)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.local import LocalFileSystem
from tests.service.test_checkpoint_service import (
    WITHIN,
    ask,
    audit_trail,
    checkpoint_requested,
    claimed,
    evict_commands,
    granted,
    outcome,
    publish,
    request_eviction,
    running,
    saga_of,
    stored,
    victim,
    wait_for,
    wait_for_audit,
    with_checkpoint,
)
from tests.support.waiting import eventually, stream_messages

from gpusched.checkpoint.api import latest_checkpoint_subject
from gpusched.checkpoint.storage import FsspecStorage
from gpusched.checkpoint.verification import ClaimCheck
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.manifest import MANIFEST_NAME
from gpusched.contracts.messages import (
    CheckpointConfirmed,
    CheckpointFailed,
    CheckpointKind,
    PriorityClassName,
    StageName,
    T,
)
from gpusched.domain.saga import CheckpointRef, Stage
from gpusched.infra.settings import Settings

# --- a job speaks only for itself ---------------------------------------------------------


async def test_a_job_cannot_plant_a_checkpoint_or_a_failure_in_another_jobs_record(
    settings: Settings,
) -> None:
    # B's class trusts s3 unverified: a claim for B is catalogued on its word alone, so
    # one that job A could make for B would be what B resumes from.
    trusting = with_checkpoint(
        settings, grace_s=120.0, sweep_interval_s=0.1, trusted_schemes={"p2-offline": ["s3"]}
    )
    async with running(trusting) as rt:
        attacker, target = victim(), victim()
        await granted(rt, target, PriorityClassName.P2_OFFLINE)
        await request_eviction(rt, target, PriorityClassName.P2_OFFLINE)
        await checkpoint_requested(rt, target)

        # Job A publishes where its credentials allow, its own events subject, but
        # names job B as the job the message is about.
        own_subject = rt.subjects.job_events(attacker.job_id)
        planted = CheckpointConfirmed(
            request_id=None, checkpoint_id="evil", step=10**12, stage=StageName.PERSISTED,
            kind=CheckpointKind.FILE, **claimed("s3://attacker-bucket/evil.pt"),
        )  # fmt: skip
        # Under p2-offline a failed checkpoint forces the eviction: B would lose its work.
        failed = CheckpointFailed(request_id=target.request_id, error="disk full")
        spoofs = [
            await publish(
                rt, own_subject, T.CHECKPOINT_CONFIRMED, planted, correlation_id=target.job_id
            ),
            await publish(
                rt, own_subject, T.CHECKPOINT_FAILED, failed, correlation_id=target.job_id
            ),
        ]

        dead = await stream_messages(rt.js, rt.subjects.dead_letter("checkpoint"), 2, WITHIN)
        assert sorted(m.data for m in dead) == sorted(e.to_bytes() for e in spoofs)
        for message in dead:
            headers = message.headers or {}
            assert headers["Gpusched-Reason"] == "malformed"
            assert headers["Gpusched-Original-Subject"] == own_subject

        # B's own claim, on its own subject, is taken as before (the trust is real).
        mine = CheckpointConfirmed(
            request_id=target.request_id, checkpoint_id="ckpt-7", step=7,
            stage=StageName.PERSISTED, **claimed("s3://checkpoints/b/ckpt-7.pt"),
        )  # fmt: skip
        await publish(
            rt,
            rt.subjects.job_events(target.job_id),
            T.CHECKPOINT_CONFIRMED,
            mine,
            correlation_id=target.job_id,
        )
        [announced] = await wait_for(rt, outcome(rt, T.CHECKPOINT_VERIFIED))
        assert announced.data["job_id"] == target.job_id
        assert announced.data["checkpoint"]["checkpoint_id"] == "ckpt-7"
        [evict] = await wait_for(rt, evict_commands(rt))
        assert evict.data["forced"] is False  # B's own checkpoint, not A's failure
        latest = await ask(rt, latest_checkpoint_subject(rt.subjects), {"job_id": target.job_id})
        assert latest["checkpoint"]["uri"] == "s3://checkpoints/b/ckpt-7.pt"
        assert (await saga_of(rt, target.job_id))["checkpoint"]["checkpoint_id"] == "ckpt-7"
        assert len(await stored(rt, outcome(rt, T.CHECKPOINT_VERIFIED))) == 1


# --- a manifest nested past the parser ----------------------------------------------------


async def test_a_manifest_nested_past_the_json_parser_is_a_false_claim_not_a_failure(
    settings: Settings, tmp_path: Path
) -> None:
    async with running(with_checkpoint(settings, grace_s=120.0)) as rt:
        v = victim()
        manifest = tmp_path / "ckpt" / MANIFEST_NAME
        manifest.parent.mkdir()
        body = b'{"format": "gpusched.manifest/1", "files": ' + b"[" * 200_000 + b"]" * 200_000
        manifest.write_bytes(body + b"}")
        payload = CheckpointConfirmed(
            request_id=None, checkpoint_id="ckpt-1", step=1, uri=manifest.as_uri(),
            bytes=len(body) + 1, sha256=hashlib.sha256(body + b"}").hexdigest(),
            stage=StageName.PERSISTED, kind=CheckpointKind.MANIFEST,
        )  # fmt: skip
        envelope = make_envelope(
            T.CHECKPOINT_CONFIRMED, payload, source="test", correlation_id=v.job_id
        ).model_copy(update={"version": payload.version})
        await rt.js.publish(rt.subjects.job_events(v.job_id), envelope.to_bytes())

        refused = await wait_for_audit(rt, v.job_id, "checkpoint.unverified")
        assert refused["details"]["verification"] == "false"
        assert "is no checkpoint manifest" in refused["reason"]
        # Judged, not failed: nothing was retried into the dead letters.
        assert await stored(rt, rt.subjects.dead_letter("checkpoint")) == []


# --- file claims of what is no checkpoint -------------------------------------------------


async def test_a_refused_file_claim_keeps_what_the_file_holds_out_of_the_audit_stream(
    settings: Settings, tmp_path: Path
) -> None:
    secret = tmp_path / "service-secret.key"
    held = b"the service's own key, not the job's to learn"
    secret.write_bytes(held)
    held_sha256 = hashlib.sha256(held).hexdigest()
    async with running(with_checkpoint(settings, grace_s=120.0)) as rt:
        v = victim()
        for step, claim in enumerate(
            [
                {"uri": secret.as_uri(), "bytes": 3, "sha256": "0" * 64},  # size probe
                {"uri": secret.as_uri(), "bytes": len(held), "sha256": "0" * 64},  # digest
                {"uri": "file:///dev/zero", "bytes": 1 << 30, "sha256": "0" * 64},
            ]
        ):
            payload = CheckpointConfirmed(
                request_id=None, checkpoint_id=f"probe-{step}", step=step,
                stage=StageName.PERSISTED, **claim,
            )  # fmt: skip
            await publish(
                rt,
                rt.subjects.job_events(v.job_id),
                T.CHECKPOINT_CONFIRMED,
                payload,
                correlation_id=v.job_id,
            )

        async def three_refusals() -> list[dict[str, Any]]:
            trail = await audit_trail(rt, v.job_id)
            found = [r for r in trail if r["action"] == "checkpoint.unverified"]
            return found if len(found) == 3 else []

        records = await eventually(three_refusals, within=WITHIN)
        reasons = " ".join(r["reason"] for r in records)
        assert "does not hold the 3 bytes the job claimed" in reasons
        assert f"{len(held)} bytes" not in reasons  # the size held: not said
        assert "sha256 does not match" in reasons
        assert held_sha256 not in " ".join(str(r) for r in records)
        assert "/dev/zero is not a regular file (not read)" in reasons


@contextlib.contextmanager
def seen_as_regular(path: Path) -> Iterator[None]:
    """LocalFileSystem.info reports `path` as a regular file: what the service saw when
    the job swapped it for a device or FIFO just after the service looked."""
    original = LocalFileSystem.info

    def info(self: LocalFileSystem, name: str, **kwargs: Any) -> dict[str, Any]:
        found: dict[str, Any] = original(self, name, **kwargs)
        if os.fspath(name) == os.fspath(path):
            return {**found, "type": "file", "size": 0}
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalFileSystem, "info", info)
        yield


def release(fifo: Path) -> None:
    """Open the FIFO's write end once, so a reader blocked on it goes on (and the test
    never leaves a thread waiting)."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # no reader: nothing is waiting
            raise
        return
    os.close(fd)


async def test_a_file_swapped_for_a_fifo_after_it_was_looked_at_is_refused_without_blocking(
    tmp_path: Path,
) -> None:
    fifo = tmp_path / "ckpt.pt"
    os.mkfifo(fifo)
    storage = FsspecStorage()
    try:
        for kind in CheckpointKind:
            claim = CheckpointRef("c1", 1, fifo.as_uri(), 0, "0" * 64, Stage.PERSISTED)
            with seen_as_regular(fifo):
                verdict = await asyncio.wait_for(storage.verify(claim, kind), timeout=10)
            assert verdict is not None and verdict.check is ClaimCheck.FALSE, kind
            assert "is not a regular file (not read)" in verdict.why
    finally:
        release(fifo)


async def test_a_device_that_reports_a_regular_size_is_refused_without_being_read() -> None:
    # /dev/zero never ends: read to its stated size, it would be hashed until the
    # budget ran out (a claim of 1 GiB: 60 s of one core).
    storage = FsspecStorage()
    claim = CheckpointRef("c1", 1, "file:///dev/zero", 0, "0" * 64, Stage.PERSISTED)
    with seen_as_regular(Path("/dev/zero")):
        verdict = await asyncio.wait_for(storage.verify(claim, CheckpointKind.FILE), timeout=10)
    assert verdict is not None and verdict.check is ClaimCheck.FALSE
    assert "is not a regular file (not read)" in verdict.why
