"""A real torchrun gang (2 ranks, gloo on CPU) against the real checkpoint service.

The service runs in-process on the real NATS and PostgreSQL; the test plays preemption
(eviction requests); the job is examples/torchrun_train.py under torchrun, connected
with its own job credentials. What is checked is what the service and the gang publish.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import Servers
from tests.service.test_checkpoint_service import (
    Victim,
    evict_commands,
    outcome,
    request_eviction,
    running,
    stored,
    victim,
    wait_for,
    with_checkpoint,
)
from tests.support.gang import FAULTY, finished, launched, tail, torchrun
from tests.support.identity import job_credentials_file
from tests.support.waiting import eventually

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import PriorityClassName, T
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

pytest.importorskip("torch", reason="PyTorch is not installed (`make test` installs it)")

GANG_WITHIN = 180.0


def job_env(settings: Settings, servers: Servers, v: Victim, tmp_path: Path) -> dict[str, str]:
    creds = job_credentials_file(servers.auth, settings.subject_prefix, v.job_id, tmp_path)
    assert settings.nats_url
    return {
        "GPUSCHED_NATS_URL": settings.nats_url,
        "GPUSCHED_SUBJECT_PREFIX": settings.subject_prefix,
        "GPUSCHED_JOB_ID": v.job_id,
        "GPUSCHED_ATTEMPT": "1",
        "GPUSCHED_CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "GPUSCHED_NATS_CREDENTIALS": "" if creds is None else str(creds),
    }


async def job_events(rt: ServiceRuntime, v: Victim, message_type: T) -> list[Envelope]:
    return [e for e in await stored(rt, rt.subjects.job_events(v.job_id)) if e.type == message_type]


async def until_event(
    rt: ServiceRuntime, v: Victim, message_type: T, log: Path, within: float = GANG_WITHIN
) -> list[Envelope]:
    async def seen() -> list[Envelope]:
        return await job_events(rt, v, message_type)

    try:
        return await eventually(seen, within=within)
    except AssertionError:
        raise AssertionError(f"no {message_type} from the gang:\n{tail(log)}") from None


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "priority_class", [PriorityClassName.P1_NORMAL, PriorityClassName.P2_OFFLINE]
)
async def test_a_rank_killed_mid_save_fails_the_checkpoint_and_the_class_policy_decides(
    settings: Settings, servers: Servers, tmp_path: Path, priority_class: PriorityClassName
) -> None:
    patient = with_checkpoint(settings, grace_s=120.0, sweep_interval_s=0.1)
    log = tmp_path / "gang.log"
    async with running(patient) as rt:
        v = victim()
        argv = torchrun(FAULTY, "--steps", "100000", "--step-seconds", "0.02")
        async with launched(argv, job_env(settings, servers, v, tmp_path), log) as gang:
            await until_event(rt, v, T.JOB_STARTED, log)
            await request_eviction(rt, v, priority_class)

            [failed] = await until_event(rt, v, T.CHECKPOINT_FAILED, log)
            assert failed.data["request_id"] == v.request_id
            assert "rank" in failed.data["error"], failed.data
            # A rank died: the gang cannot go on, and says so by its exit status.
            assert await finished(gang, log, GANG_WITHIN) != 0

        assert await job_events(rt, v, T.CHECKPOINT_CONFIRMED) == []
        if priority_class is PriorityClassName.P1_NORMAL:
            [aborted] = await wait_for(rt, outcome(rt, T.EVICTION_ABORTED))
            assert aborted.data["reason"] == "checkpoint_failed_aborted"
            assert await stored(rt, evict_commands(rt)) == []
        else:
            [forced] = await wait_for(rt, outcome(rt, T.EVICTION_FORCED))
            assert forced.data["lost_gpu_seconds"] > 0
            assert forced.data["checkpoint"] is None
            [evict] = await wait_for(rt, evict_commands(rt))
            assert evict.data["forced"] is True
