"""Advance notice a framework can use: the request's deadline and stage, a non-blocking
poll, a callback, and a recent periodic checkpoint confirmed for a pending request when
it is fresh enough. Against the real NATS; the test plays the control plane."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from tests.conftest import Servers
from tests.service import test_sdk
from tests.service.test_sdk import ControlPlane, creds
from tests.support.waiting import eventually

from gpusched.contracts.messages import StageName, T
from gpusched.sdk import (
    CheckpointRequest,
    Freshness,
    JobClient,
    SavedCheckpoint,
    save_file_checkpoint,
)

control = test_sdk.control  # the same fixture: the test plays the control plane


def save(path: Path, step: int) -> SavedCheckpoint:
    return save_file_checkpoint(path, lambda f: f.write(b"state %d" % step), step=step)


async def test_a_loop_sees_deadline_and_stage_by_poll_and_callback_and_may_answer_with_a_fresh_one(
    servers: Servers,
    prefix: str,
    control: ControlPlane,
    tmp_path: Path,
) -> None:
    job_id = "job-notice"
    client_creds = creds(servers, prefix, job_id, tmp_path)
    client = JobClient.from_env(
        {
            "GPUSCHED_NATS_URL": servers.nats_url,
            "GPUSCHED_SUBJECT_PREFIX": prefix,
            "GPUSCHED_JOB_ID": job_id,
            "GPUSCHED_NATS_CREDENTIALS": "" if client_creds is None else str(client_creds),
        }
    )
    with client:
        notified = threading.Event()
        seen: list[CheckpointRequest] = []

        def on_request(request: CheckpointRequest) -> None:
            seen.append(request)
            notified.set()

        client.on_checkpoint_requested(on_request)
        assert client.checkpoint_requested is None  # the poll never blocks
        periodic = save(tmp_path / "periodic.bin", 40)
        client.checkpoint(None, lambda: periodic)  # a periodic checkpoint, confirmed
        assert client.recent_checkpoint is not None
        assert client.recent_checkpoint.saved == periodic
        assert client.recent_checkpoint.stage is StageName.PERSISTED

        await control.request_checkpoint(job_id, "req-1", StageName.SNAPSHOTTED)
        request = await eventually(lambda: _pending(client))
        assert notified.wait(10) and seen == [request]
        assert request.stage_required is StageName.SNAPSHOTTED
        assert 200 < request.seconds_left() <= 300

        # Ten steps on and a moment later: too old for a policy of five steps...
        assert client.answer_with_recent(request, Freshness(600, max_steps=5), step=50) is None
        assert client.checkpoint_requested == request
        # ...fresh enough for one of twenty: confirmed for the request, nothing saved.
        answered = client.answer_with_recent(request, Freshness(600, max_steps=20), step=50)
        assert answered == periodic
        assert client.checkpoint_requested is None

    events = await control.events(job_id, 3)
    confirmations = [e.data for e in events if e.type == T.CHECKPOINT_CONFIRMED]
    assert [(c["request_id"], c["checkpoint_id"]) for c in confirmations] == [
        (None, periodic.checkpoint_id),
        (None, periodic.checkpoint_id),
        ("req-1", periodic.checkpoint_id),
    ]
    assert confirmations[-1]["stage"] == "persisted"


def test_freshness_refuses_what_it_cannot_judge() -> None:
    with pytest.raises(ValueError):
        Freshness(float("nan"))
    with pytest.raises(ValueError):
        Freshness(float("inf"))
    with pytest.raises(ValueError):
        Freshness(10, max_steps=-1)


async def _pending(client: JobClient) -> CheckpointRequest | None:
    return client.checkpoint_requested
