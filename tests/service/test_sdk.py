"""The job SDK against the real NATS: the test plays the control plane."""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import BinaryIO

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from pydantic import BaseModel
from tests.conftest import Servers
from tests.support.identity import job_credentials_file
from tests.support.waiting import eventually, stream_messages

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointRequested,
    PreemptionCancelled,
    StageName,
    T,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.sdk import (
    AsyncJobClient,
    CheckpointError,
    CheckpointRequest,
    JobClient,
    JobClientError,
    SavedCheckpoint,
    checkpoint_path,
    save_file_checkpoint,
)
from gpusched.sdk import PreemptionCancelled as CancelNotice


class ControlPlane:
    """The test's stand-in for the checkpoint service: sends control, reads events."""

    def __init__(self, nc: NatsClient, subjects: Subjects) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.s = subjects

    async def request_checkpoint(
        self, job_id: str, request_id: str, stage: StageName = StageName.PERSISTED
    ) -> Envelope:
        payload = CheckpointRequested(
            request_id=request_id,
            job_id=job_id,
            reason="inference surge",
            deadline=datetime.now(UTC) + timedelta(minutes=5),
            stage_required=stage,
        )
        return await self._send(job_id, T.CHECKPOINT_REQUESTED, payload)

    async def cancel(self, job_id: str, request_id: str) -> Envelope:
        return await self._send(
            job_id, T.PREEMPTION_CANCELLED, PreemptionCancelled(request_id=request_id)
        )

    async def _send(self, job_id: str, message_type: str, payload: BaseModel) -> Envelope:
        envelope = make_envelope(message_type, payload, source="checkpoint")
        await self.js.publish(
            self.s.job_control(job_id), envelope.to_bytes(), headers={"Nats-Msg-Id": envelope.id}
        )
        return envelope

    async def events(self, job_id: str, count: int) -> list[Envelope]:
        msgs = await stream_messages(self.js, self.s.job_events(job_id), count, within=20)
        for msg in msgs:
            assert msg.headers is not None
            assert msg.headers["Nats-Msg-Id"] == Envelope.from_bytes(msg.data).id
        return [Envelope.from_bytes(m.data) for m in msgs]


def creds(servers: Servers, prefix: str, job_id: str, into: Path) -> Path | None:
    """The job's own credentials, as admission would issue them (its subjects only)."""
    return job_credentials_file(servers.auth, prefix, job_id, into)


@pytest.fixture
async def control(servers: Servers, prefix: str) -> AsyncIterator[ControlPlane]:
    nc = await nats.connect(servers.nats_url, **servers.nats_options)
    subjects = Subjects(prefix)
    await bus.ensure_streams(nc.jetstream(), subjects.streams())
    yield ControlPlane(nc, subjects)
    await nc.drain()


def _write_to(content: bytes, f: BinaryIO) -> None:
    f.write(content)


def _write_state(step: int) -> bytes:
    return json.dumps({"step": step, "weights": [0.5] * 64}).encode()


async def test_a_requested_checkpoint_is_saved_then_confirmed_snapshotted_and_persisted(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    async with AsyncJobClient(
        servers.nats_url,
        "job-a",
        2,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-a", tmp_path),
    ) as job:
        await job.started(resumed_from="ckpt-0")
        seen: list[CheckpointRequest] = []
        job.on_checkpoint_requested(seen.append)
        request_envelope = await control.request_checkpoint("job-a", "req-1")

        request = await eventually(lambda: _pending(job))
        assert request is not None
        assert seen == [request]
        assert (request.request_id, request.stage_required) == ("req-1", StageName.PERSISTED)
        assert 200 < request.seconds_left() <= 300
        saved = await job.handle_checkpoint(
            request,
            lambda: save_file_checkpoint(
                tmp_path / "ckpt-7.bin", lambda f: f.write(_write_state(7)), step=7
            ),
        )
        assert job.checkpoint_requested is None

    started, snapshotted, persisted = await control.events("job-a", 3)
    assert started.type == T.JOB_STARTED
    assert started.data == {"job_id": "job-a", "attempt": 2, "resumed_from": "ckpt-0"}
    assert {started.correlation_id, started.source} == {"job-a", "job"}
    assert [snapshotted.type, persisted.type] == [T.CHECKPOINT_CONFIRMED] * 2
    assert [snapshotted.data["stage"], persisted.data["stage"]] == ["snapshotted", "persisted"]
    data = persisted.data
    content = checkpoint_path(data["uri"]).read_bytes()
    assert data["sha256"] == hashlib.sha256(content).hexdigest() == saved.sha256
    assert data["bytes"] == len(content)
    assert (data["request_id"], data["step"]) == ("req-1", 7)
    assert persisted.causation_id == request_envelope.id


async def test_a_persist_step_confirms_the_durable_copy_after_the_snapshot(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    local = tmp_path / "local" / "ckpt.bin"
    remote = tmp_path / "remote" / "ckpt.bin"

    async def upload(snapshot: SavedCheckpoint) -> SavedCheckpoint:
        await asyncio.sleep(0.05)
        return save_file_checkpoint(
            remote,
            lambda f: f.write(checkpoint_path(snapshot.uri).read_bytes()),
            step=snapshot.step,
            checkpoint_id=snapshot.checkpoint_id,
        )

    async with AsyncJobClient(
        servers.nats_url,
        "job-p",
        1,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-p", tmp_path),
    ) as job:
        await control.request_checkpoint("job-p", "req-9", StageName.SNAPSHOTTED)
        request = await job.next_control(timeout=20)
        assert isinstance(request, CheckpointRequest)
        await job.handle_checkpoint(
            request,
            lambda: save_file_checkpoint(local, lambda f: f.write(b"state"), step=3),
            persist=upload,
        )

    snapshotted, persisted = await control.events("job-p", 2)
    assert snapshotted.data["uri"] == local.as_uri()
    assert persisted.data["uri"] == remote.as_uri()
    assert persisted.data["checkpoint_id"] == snapshotted.data["checkpoint_id"]


async def test_a_cancelled_request_is_no_longer_pending_and_the_job_is_told(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    async with AsyncJobClient(
        servers.nats_url,
        "job-c",
        1,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-c", tmp_path),
    ) as job:
        await control.request_checkpoint("job-c", "req-1")
        await control.cancel("job-c", "req-1")
        messages = [await job.next_control(timeout=20), await job.next_control(timeout=20)]
        assert isinstance(messages[0], CheckpointRequest)
        assert messages[1] == CancelNotice("req-1")
        assert job.checkpoint_requested is None


async def test_a_request_sent_to_an_earlier_attempt_is_not_replayed_to_the_next(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    await control.request_checkpoint("job-r", "old-request")
    async with AsyncJobClient(
        servers.nats_url,
        "job-r",
        2,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-r", tmp_path),
    ) as job:
        assert await job.next_control(timeout=0.5) is None
        await control.request_checkpoint("job-r", "new-request")
        request = await job.next_control(timeout=20)
        assert isinstance(request, CheckpointRequest)
        assert request.request_id == "new-request"


async def test_a_failing_save_publishes_checkpoint_failed_and_raises(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    def broken_save() -> SavedCheckpoint:
        raise OSError("disk full")

    async with AsyncJobClient(
        servers.nats_url,
        "job-f",
        1,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-f", tmp_path),
    ) as job:
        await control.request_checkpoint("job-f", "req-1")
        request = await job.next_control(timeout=20)
        assert isinstance(request, CheckpointRequest)
        with pytest.raises(CheckpointError, match="disk full"):
            await job.handle_checkpoint(request, broken_save)

    [failed] = await control.events("job-f", 1)
    assert failed.type == T.CHECKPOINT_FAILED
    assert failed.data["request_id"] == "req-1"
    assert "disk full" in failed.data["error"]


async def test_a_malformed_control_message_is_skipped_and_the_next_one_arrives(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    async with AsyncJobClient(
        servers.nats_url,
        "job-m",
        1,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-m", tmp_path),
    ) as job:
        await control.js.publish(control.s.job_control("job-m"), b"not an envelope")
        await control.request_checkpoint("job-m", "req-2")
        request = await job.next_control(timeout=20)
        assert isinstance(request, CheckpointRequest)
        assert request.request_id == "req-2"


async def test_the_sync_client_lets_a_training_thread_checkpoint_at_a_step_boundary(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    environ = {
        "GPUSCHED_NATS_URL": servers.nats_url,
        "GPUSCHED_SUBJECT_PREFIX": prefix,
        "GPUSCHED_JOB_ID": "job-s",
        "GPUSCHED_ATTEMPT": "3",
        "GPUSCHED_CHECKPOINT_DIR": str(tmp_path),
        "GPUSCHED_NATS_CREDENTIALS": str(creds(servers, prefix, "job-s", tmp_path) or ""),
    }
    listening = threading.Event()
    result: dict[str, object] = {}

    def training_loop() -> None:
        with JobClient.from_env(environ) as job:
            assert job.checkpoint_dir == tmp_path and job.resume_uri is None
            job.started()
            listening.set()
            for step in range(1, 100_000):
                if step % 50 == 0:
                    job.progress(step, loss=1.0 / step)
                if (request := job.checkpoint_requested) is not None:
                    path = tmp_path / f"ckpt-{step}.bin"
                    write = partial(_write_to, _write_state(step))
                    save = partial(save_file_checkpoint, path, write, step=step)
                    result["saved"] = job.checkpoint(request, save)
                    result["control"] = job.poll_control()
                    job.completed(step)
                    return
                threading.Event().wait(0.01)

    trainer = asyncio.create_task(asyncio.to_thread(training_loop))
    await asyncio.to_thread(listening.wait, 20)
    await control.request_checkpoint("job-s", "req-s")
    await asyncio.wait_for(trainer, 30)

    saved = result["saved"]
    assert isinstance(saved, SavedCheckpoint)
    assert isinstance(result["control"], CheckpointRequest)
    events = await control.events("job-s", 2)
    assert events[0].data["attempt"] == 3
    done = await _events_until(control, "job-s", T.JOB_COMPLETED)
    confirmed = [e for e in done if e.type == T.CHECKPOINT_CONFIRMED]
    assert [e.data["stage"] for e in confirmed] == ["snapshotted", "persisted"]
    content = checkpoint_path(confirmed[-1].data["uri"]).read_bytes()
    assert confirmed[-1].data["sha256"] == hashlib.sha256(content).hexdigest()
    assert confirmed[-1].data["step"] == saved.step == done[-1].data["step"]


async def test_a_client_fails_with_a_clear_error_when_there_is_no_control_plane(
    servers: Servers, tmp_path: Path
) -> None:
    with pytest.raises(JobClientError, match="control plane"):
        async with AsyncJobClient(
            servers.nats_url,
            "job-x",
            1,
            prefix="nostreamshere",
            credentials=creds(servers, "nostreamshere", "job-x", tmp_path),
        ):
            pass


def test_a_checkpoint_writer_that_fails_leaves_no_file_behind(tmp_path: Path) -> None:
    def explode(f: object) -> None:
        raise RuntimeError("serialization failed")

    with pytest.raises(RuntimeError):
        save_file_checkpoint(tmp_path / "ckpt.bin", explode, step=1)
    assert list(tmp_path.iterdir()) == []


async def _events_until(control: ControlPlane, job_id: str, last_type: str) -> list[Envelope]:
    count = 1
    while True:
        events = await control.events(job_id, count)
        if events[-1].type == last_type:
            return events
        count += 1


async def _pending(job: AsyncJobClient) -> CheckpointRequest | None:
    return job.checkpoint_requested


# --- the PyTorch helpers (pure: no bus) -----------------------------------------------------


def test_a_torch_checkpoint_restores_model_optimizer_and_rng_so_training_continues_exactly(
    tmp_path: Path,
) -> None:
    torch = pytest.importorskip("torch", reason="the PyTorch helpers need torch (extra `torch`)")
    import random

    from gpusched.sdk.torch import TorchCheckpointer

    def build() -> tuple[object, object]:
        torch.manual_seed(7)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2))
        return model, torch.optim.Adam(model.parameters(), lr=0.01)

    def run(model: object, optimizer: object, steps: int) -> None:
        for _ in range(steps):
            noise = random.random()  # Python's RNG is part of the state too
            loss = (model(torch.randn(16, 4)) ** 2).mean() + noise  # type: ignore[operator]
            optimizer.zero_grad()  # type: ignore[attr-defined]
            loss.backward()
            optimizer.step()  # type: ignore[attr-defined]

    random.seed(3)
    straight, straight_opt = build()
    run(straight, straight_opt, 30)

    random.seed(3)
    first, first_opt = build()
    run(first, first_opt, 12)
    saved = TorchCheckpointer(first, first_opt, tmp_path).save(12)  # type: ignore[arg-type]
    assert saved.step == 12 and saved.uri.startswith("file://") and saved.bytes > 0

    random.seed(99)  # a new process: other seeds, a fresh model
    torch.manual_seed(99)
    resumed, resumed_opt = build()
    step = TorchCheckpointer(resumed, resumed_opt).restore(saved.uri)  # type: ignore[arg-type]
    run(resumed, resumed_opt, 30 - step)

    expected = straight.state_dict()  # type: ignore[attr-defined]
    got = resumed.state_dict()  # type: ignore[attr-defined]
    assert step == 12
    assert all(torch.equal(expected[k], got[k]) for k in expected)


async def test_a_nan_metric_or_a_coloured_traceback_never_stops_the_loop_nor_its_report(
    servers: Servers, prefix: str, control: ControlPlane, tmp_path: Path
) -> None:
    async with AsyncJobClient(
        servers.nats_url,
        "job-hostile",
        1,
        prefix=prefix,
        credentials=creds(servers, prefix, "job-hostile", tmp_path),
    ) as job:
        await job.progress(3, loss=float("nan"), lr=0.1, grad_norm=float("inf"))
        await job.failed("Traceback\x1b[31m boom\x00 \u202eevil")

    progress, failed = await control.events("job-hostile", 2)
    assert progress.type == T.JOB_PROGRESS
    assert progress.data == {"step": 3, "lr": 0.1}
    assert failed.type == T.JOB_FAILED
    error = failed.data["error"]
    assert error.startswith("Traceback") and "boom" in error
    assert not any(ch in error for ch in "\x1b\x00\u202e")
