"""The Lightning and Hugging Face hooks, in their examples, against the real NATS.

The test plays the control plane: it asks the running example for a checkpoint, checks
the confirmation the way the checkpoint service does (FsspecStorage, same code), stops
the process as the agent would, and starts a new one resumed from that checkpoint. The
result must equal a run that was never interrupted.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from tests.conftest import Servers
from tests.support.gang import tail
from tests.support.identity import job_credentials_file
from tests.support.waiting import eventually, stream_messages_after

from gpusched.checkpoint.storage import FsspecStorage
from gpusched.checkpoint.verification import ClaimCheck
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import CheckpointKind, CheckpointRequested, StageName, T
from gpusched.contracts.subjects import Subjects
from gpusched.domain.saga import CheckpointRef, Stage
from gpusched.infra.settings import Settings

torch = pytest.importorskip("torch", reason="PyTorch is not installed (`make test` does)")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
WITHIN = 180.0


@pytest.fixture
async def nc(servers: Servers) -> AsyncIterator[NatsClient]:
    client = await nats.connect(servers.nats_url, **servers.nats_options)
    yield client
    await client.close()


class Example:
    """One example script run as a gpusched job, attempt after attempt."""

    def __init__(self, script: str, args: list[str], settings: Settings, servers: Servers,
                 nc: NatsClient, tmp_path: Path) -> None:  # fmt: skip
        self.script, self.args, self.nc, self.tmp = EXAMPLES / script, args, nc, tmp_path
        self.job_id = f"job-{uuid.uuid4().hex[:12]}"
        self.subjects = Subjects(settings.subject_prefix)
        creds = job_credentials_file(servers.auth, settings.subject_prefix, self.job_id, tmp_path)
        assert settings.nats_url
        self.env = {
            "GPUSCHED_NATS_URL": settings.nats_url,
            "GPUSCHED_SUBJECT_PREFIX": settings.subject_prefix,
            "GPUSCHED_JOB_ID": self.job_id,
            "GPUSCHED_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
            "GPUSCHED_NATS_CREDENTIALS": "" if creds is None else str(creds),
        }

    async def start(self, attempt: int, *extra: str, **env: str) -> asyncio.subprocess.Process:
        log = self.tmp / f"attempt-{attempt}.log"
        with log.open("ab") as out:
            return await asyncio.create_subprocess_exec(
                sys.executable, str(self.script), *self.args, *extra,
                env={**os.environ, **self.env, "GPUSCHED_ATTEMPT": str(attempt), **env},
                stdout=out, stderr=asyncio.subprocess.STDOUT, cwd=self.tmp,
            )  # fmt: skip

    async def events(self, message_type: T) -> list[dict[str, Any]]:
        msgs = await stream_messages_after(
            self.nc.jetstream(), self.subjects.job_events(self.job_id)
        )
        envelopes = [Envelope.from_bytes(m.data) for m in msgs]
        return [e.data for e in envelopes if e.type == message_type]

    async def until(self, message_type: T, run: int, **match: Any) -> dict[str, Any]:
        async def seen() -> dict[str, Any] | None:
            found = [d for d in await self.events(message_type) if match.items() <= d.items()]
            return found[-1] if found else None

        try:
            result = await eventually(seen, within=WITHIN)
        except AssertionError:
            log = tail(self.tmp / f"attempt-{run}.log")
            raise AssertionError(f"no {message_type} {match}:\n{log}") from None
        assert result is not None
        return result

    async def request_checkpoint(self) -> str:
        request_id = f"req-{uuid.uuid4().hex[:8]}"
        payload = CheckpointRequested(
            request_id=request_id,
            job_id=self.job_id,
            reason="inference surge",
            deadline=datetime.now(UTC) + timedelta(minutes=5),
            stage_required=StageName.PERSISTED,
        )
        envelope = make_envelope(T.CHECKPOINT_REQUESTED, payload, source="checkpoint")
        await self.nc.jetstream().publish(
            self.subjects.job_control(self.job_id),
            envelope.to_bytes(),
            headers={"Nats-Msg-Id": envelope.id},
        )
        return request_id


async def evicted_and_resumed(example: Example, result: Path, reference: Path) -> dict[str, Any]:
    baseline = await example.start(0, "--standalone", "--result", str(reference))
    first = await example.start(1, "--result", str(result))
    try:
        await example.until(T.JOB_STARTED, 1, attempt=1)
        request_id = await example.request_checkpoint()
        confirmed = await example.until(
            T.CHECKPOINT_CONFIRMED, 1, request_id=request_id, stage="persisted"
        )
        # What the checkpoint service would conclude about this claim.
        claim = CheckpointRef(confirmed["checkpoint_id"], confirmed["step"], confirmed["uri"],
                              confirmed["bytes"], confirmed["sha256"], Stage.PERSISTED)  # fmt: skip
        verdict = await FsspecStorage().verify(claim, CheckpointKind(confirmed["kind"]))
        assert verdict is not None and verdict.check is ClaimCheck.VERIFIED, verdict
        first.send_signal(signal.SIGTERM)  # the agent's eviction
        await asyncio.wait_for(first.wait(), WITHIN)
        assert not await asyncio.to_thread(result.exists), "attempt 1 finished before eviction"

        resumed = await example.start(
            2, "--result", str(result),
            GPUSCHED_RESUME_URI=confirmed["uri"],
            GPUSCHED_RESUME_CHECKPOINT_ID=confirmed["checkpoint_id"],
        )  # fmt: skip
        assert await asyncio.wait_for(resumed.wait(), WITHIN) == 0, tail(
            example.tmp / "attempt-2.log"
        )
        started = await example.until(T.JOB_STARTED, 2, attempt=2)
        assert started["resumed_from"] == confirmed["checkpoint_id"]
        assert await asyncio.wait_for(baseline.wait(), WITHIN) == 0, tail(
            example.tmp / "attempt-0.log"
        )
    finally:
        for process in (baseline, first):
            if process.returncode is None:
                process.kill()
                await process.wait()

    expected = torch.load(reference, weights_only=True)
    got = torch.load(result, weights_only=True)
    assert got["steps"] == expected["steps"]
    assert expected["params"].keys() == got["params"].keys()
    for name, value in expected["params"].items():
        assert torch.equal(got["params"][name], value), name
    return confirmed


@pytest.mark.timeout(300)
async def test_a_lightning_run_answers_a_checkpoint_request_and_resumes_exactly(
    settings: Settings, servers: Servers, nc: NatsClient, tmp_path: Path
) -> None:
    pytest.importorskip("pytorch_lightning", reason="pip install -e '.[lightning]'")
    args = ["--steps", "150", "--step-seconds", "0.03"]
    example = Example("lightning_train.py", args, settings, servers, nc, tmp_path)
    confirmed = await evicted_and_resumed(example, tmp_path / "resumed.pt", tmp_path / "ref.pt")
    assert confirmed["kind"] == "file" and confirmed["uri"].endswith(".ckpt")
    assert 0 < confirmed["step"] < 150


@pytest.mark.timeout(300)
async def test_a_hugging_face_trainer_answers_a_checkpoint_request_and_resumes_exactly(
    settings: Settings, servers: Servers, nc: NatsClient, tmp_path: Path
) -> None:
    pytest.importorskip("transformers", reason="pip install -e '.[huggingface]'")
    args = ["--steps", "60", "--step-seconds", "0.05"]
    example = Example("hf_train.py", args, settings, servers, nc, tmp_path)
    confirmed = await evicted_and_resumed(example, tmp_path / "resumed.pt", tmp_path / "ref.pt")
    assert confirmed["kind"] == "manifest"
    assert "/checkpoint-" in confirmed["uri"]
    assert 0 < confirmed["step"] < 60
