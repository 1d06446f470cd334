"""The replay makes the services' decisions: one scenario through admission, preemption and
checkpoint on the real NATS and PostgreSQL, and through the replay engine, gives the same
placements, the same victims in the same order and the same saga outcomes.

The scenario, on one inference node (4 GPUs) and three shared nodes (4 GPUs each):
1. `offline` (p2-offline, 4 GPUs), `normal` (p1-normal, 4), `urgent-1` (p0-urgent, 1),
   `urgent-2` (p0-urgent, 2), and `frac-a` and `frac-b` (p2-offline, half a GPU each, on
   the last idle GPU) are submitted one after the other (one pass each);
2. inference demand fills its 4 GPUs (utilization 1.0): the controller asks for 2 more,
   none idle: the two fractions' GPU (one unit, its tenants together, least lost work),
   then the 4-GPU p2 job (p0 is never a victim). Each confirms a snapshot checkpoint,
   the sagas evict them (completed) and they are requeued;
3. demand grows to 8 GPUs' worth: more GPUs are asked; the only candidate left is the p1
   job, which never confirms a persisted checkpoint: its class aborts at the deadline,
   and no other victim is left (a shortfall).
The test plays the roles outside the three services: the job that checkpoints, the
cluster agent that stops an evicted workload, and ingest (pool snapshots computed from
admission's ledger with the simulated cluster's utilization rule).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections.abc import Callable
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from nats.aio.msg import Msg
from tests.support.admission import Admission, Client, with_inventory
from tests.support.services import running

from gpusched.checkpoint import app as checkpoint_app
from gpusched.checkpoint.policy import EvictionPolicies
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    CheckpointConfirmed,
    PoolSnapshot,
    PoolState,
    StageName,
    StopReason,
    T,
    WorkloadStopped,
)
from gpusched.domain.inventory import Pool, parse_inventory
from gpusched.domain.ledger import GpuStatus, Ledger, PriorityClass
from gpusched.domain.pricing import PriceBook
from gpusched.infra.settings import CheckpointSettings, PreemptionSettings, Settings
from gpusched.preemption import app as preemption_app
from gpusched.replay.demand import DemandCurve
from gpusched.replay.engine import EngineParams, replay
from gpusched.replay.policies import Kind, Policy, default_limits
from gpusched.replay.workload import TrainingJob, Workload
from gpusched.simcluster.load import TRAINING_UTIL, serving_util

INVENTORY = """
nodes:
  - name: inf-00
    pool: inference
    gpu_model: A100-80GB
    gpus: 4
    cpu_milli: 64000
    memory_mib: 524288
  - name_prefix: shared
    count: 3
    pool: shared
    gpu_model: A100-80GB
    gpus: 4
    cpu_milli: 64000
    memory_mib: 524288
"""
# Both sides: one reading acts (no windows, cooldown, min lend or min runtime), and a
# checkpoint is waited for 3 s (p2: snapshotted, forced; p1: persisted, aborted).
CONTROLLER = {"cooldown_s": 0.0, "expand_hold_s": 0.0, "shrink_hold_s": 0.0,
              "min_lend_s": 0.0, "min_runtime_s": 0.0, "decide_interval_s": 0.2}  # fmt: skip
GRACE_S = 3.0
JOBS = (  # name, class, GPUs, per GPU in 1/1000
    ("offline", PriorityClass.P2_OFFLINE, 4, 1000),
    ("normal", PriorityClass.P1_NORMAL, 4, 1000),
    ("urgent-1", PriorityClass.P0_URGENT, 1, 1000),
    ("urgent-2", PriorityClass.P0_URGENT, 2, 1000),
    ("frac-a", PriorityClass.P2_OFFLINE, 1, 500),
    ("frac-b", PriorityClass.P2_OFFLINE, 1, 500),
)
PASS_S = 30.0
PHASES = (4.0, 8.0)  # inference demand, in GPUs of work


def decisions_of(log: list[tuple[str, str, str]]) -> dict[str, object]:
    """What both sides are compared on, from (what, job name, detail) in order. The
    tenants of one GPU are victims together, in the order of their allocation ids, which
    differ between the two sides: within a unit (one placement) they are compared by
    name."""
    placed = {job: detail for what, job, detail in log if what == "placed"}
    victims = [job for what, job, _ in log if what == "victim"]
    units = itertools.groupby(victims, key=lambda job: placed.get(job, job))
    return {
        "placed": placed,
        "victims": [job for _, unit in units for job in sorted(unit)],
        "sagas": {job: detail for what, job, detail in log if what == "saga"},
    }


# --- the replay -----------------------------------------------------------------------------


def replayed() -> dict[str, object]:
    inventory = parse_inventory(yaml.safe_load(INVENTORY))
    # One pass per submission, as the service test waits for each job to run.
    jobs = tuple(
        TrainingJob(
            f"job-{name}", name, "lab", priority, arrival_s=i * PASS_S, work_s=86_400.0, gpus=gpus,
            milli=milli, snapshot_s=1.0,
            # The p1 job needs far longer than the grace to persist: its eviction aborts.
            persist_s=2.0 if priority is PriorityClass.P2_OFFLINE else 600.0, source="csv",
        )
        for i, (name, priority, gpus, milli) in enumerate(JOBS)
    )  # fmt: skip
    # Nothing while the jobs are placed (3 minutes), then each phase for 3 minutes.
    demand = DemandCurve.of([0.0] * 3 + [p for p in PHASES for _ in range(3)], step_s=60.0)
    policy = Policy(
        "gpusched", Kind.GPUSCHED, inventory.gpus_in(Pool.INFERENCE),
        limits=default_limits(**{k: v for k, v in CONTROLLER.items() if k != "decide_interval_s"}),
        evictions=EvictionPolicies.from_settings(CheckpointSettings(grace_s=GRACE_S)),
    )  # fmt: skip
    # Just past the first abort of the second phase (at 360 s + the 3 s grace): the
    # service side stops there too.
    result = replay(
        policy, inventory, Workload(jobs, ()), demand,
        EngineParams(horizon_s=380.0, decide_every_s=30.0, pass_every_s=PASS_S),
        periodic_s=1800.0, book=PriceBook({"A100-80GB": Decimal(1)}),
    )  # fmt: skip
    return decisions_of(
        [(what, job.removeprefix("job-"), d) for _, what, job, d in result.decisions]
    )


def test_the_replay_alone_makes_the_scenario_s_decisions() -> None:
    """The expectation both sides must meet, stated once."""
    got = replayed()

    assert got["victims"] == ["frac-a", "frac-b", "offline", "normal"]
    assert got["sagas"] == {
        "frac-a": "evicted", "frac-b": "evicted", "offline": "evicted",
        "normal": "deadline_aborted",
    }  # fmt: skip
    placed = got["placed"]
    assert isinstance(placed, dict) and set(placed) == {job[0] for job in JOBS}
    assert placed["frac-a"] == placed["frac-b"]  # one GPU, shared


# --- the services ---------------------------------------------------------------------------


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    tuned = with_inventory(settings, tmp_path, INVENTORY)
    return tuned.model_copy(
        update={
            "preemption": PreemptionSettings(**CONTROLLER),
            "checkpoint": CheckpointSettings(grace_s=GRACE_S, sweep_interval_s=0.1),
        }
    )


def snapshot(ledger: Ledger, demand: float) -> PoolSnapshot:
    """What ingest would report: the inference pool with the lent GPUs training has left,
    and the shared GPUs not lent (the simulated cluster's rule, as the replay's)."""
    lent_idle = sum(1 for s in ledger.gpus if s.status is GpuStatus.RESERVED_INFERENCE)
    serving = sum(1 for s in ledger.gpus if s.pool is Pool.INFERENCE) + lent_idle
    shared = [s for s in ledger.gpus if s.pool is Pool.SHARED and s.reserved_for is None]
    busy = sum(s.status in (GpuStatus.ALLOCATED, GpuStatus.SHARED) for s in shared)
    return PoolSnapshot(
        time=datetime.now(UTC),
        window_s=1.0,
        pools=[
            PoolState(pool="inference", gpus=serving, util=serving_util(demand, serving),
                      reporting_gpus=serving),
            PoolState(pool="shared", gpus=len(shared),
                      util=TRAINING_UTIL * busy / len(shared) if shared else 0.0,
                      reporting_gpus=len(shared)),
        ],
    )  # fmt: skip


async def test_the_services_and_the_replay_make_the_same_decisions(
    admission: Admission, client: Client, admission_settings: Settings, tmp_path: Path
) -> None:
    log: list[tuple[str, str, str]] = []
    names: dict[str, str] = {}  # job id -> scenario name
    s = client.s

    async def on(subject: str, handle: Callable[[Envelope], Any]) -> None:
        async def callback(msg: Msg) -> None:
            await handle(Envelope.from_bytes(msg.data))

        await client.nc.subscribe(subject, cb=callback)

    async def granted(e: Envelope) -> None:
        gpus = ",".join(f"{g['node']}/{g['index']}" for g in e.data["gpus"])
        if e.data["attempt"] == 1:
            log.append(("placed", names[e.data["job_id"]], gpus))

    async def requested(e: Envelope) -> None:
        log.append(("victim", names[e.data["job_id"]], e.data["priority_class"]))

    async def ended(outcome: str, e: Envelope) -> None:
        log.append(("saga", names[e.data["job_id"]], outcome))

    async def evict(e: Envelope) -> None:
        # The cluster agent: the workload stops, saying which saga evicted it.
        await client.publish(
            s.event("agent", T.WORKLOAD_STOPPED), T.WORKLOAD_STOPPED,
            WorkloadStopped(allocation_id=e.data["allocation_id"], job_id=e.data["job_id"],
                            reason=StopReason.EVICTED, stopped_at=datetime.now(UTC),
                            exit_code=0, saga_id=e.correlation_id),
            source="agent",
        )  # fmt: skip

    async def asked(e: Envelope) -> None:
        # The jobs: the p2 ones write and confirm a snapshot; the p1 one never persists.
        if e.type != T.CHECKPOINT_REQUESTED or names.get(e.data["job_id"]) == "normal":
            return
        job_id = e.data["job_id"]
        path = tmp_path / f"{job_id}.ckpt"
        path.write_bytes(b"offline at step 100")
        data = path.read_bytes()
        confirmed = CheckpointConfirmed(
            request_id=e.data["request_id"], checkpoint_id="ckpt-100", step=100,
            uri=path.as_uri(), bytes=len(data), sha256=hashlib.sha256(data).hexdigest(),
            stage=StageName.SNAPSHOTTED,
        )  # fmt: skip
        # The SDK names the job by the correlation id.
        envelope = make_envelope(T.CHECKPOINT_CONFIRMED, confirmed, source="job",
                                 correlation_id=job_id)  # fmt: skip
        await client.js.publish(s.job_events(job_id), envelope.to_bytes())

    await on(s.event("admission", T.ALLOCATION_GRANTED), granted)
    await on(s.command("checkpoint", T.EVICTION_REQUESTED), requested)
    await on(s.event("checkpoint", T.EVICTION_COMPLETED), lambda e: ended("evicted", e))
    await on(s.event("checkpoint", T.EVICTION_FORCED), lambda e: ended("deadline_forced", e))
    await on(s.event("checkpoint", T.EVICTION_ABORTED), lambda e: ended(e.data["reason"], e))
    await on(s.command("agent", T.EVICT_WORKLOAD), evict)
    await on(f"{s.prefix}.jobs.*.control", asked)

    async with (
        running(admission_settings, preemption_app),
        running(admission_settings, checkpoint_app),
    ):
        for name, priority, gpus, milli in JOBS:
            ask: dict[str, int] = {"count": gpus} | ({"milli": milli} if milli < 1000 else {})
            job_id = await client.submitted(
                name=name, team="lab", priority_class=priority.value, gpus=ask
            )
            names[job_id] = name
            await client.job_in(job_id, "running")

        async def play(demand: float, done: Callable[[], bool]) -> None:
            # Ingest: a snapshot of the ledger as it is now, twice a second, until done.
            while not done():
                ledger = await admission.ledger()
                await client.publish(
                    s.event("ingest", T.POOL_SNAPSHOT), T.POOL_SNAPSHOT,
                    snapshot(ledger, demand), source="ingest",
                )  # fmt: skip
                await asyncio.sleep(0.5)

        def saga_of(name: str) -> Callable[[], bool]:
            return lambda: any(what == "saga" and job == name for what, job, _ in log)

        await asyncio.wait_for(play(PHASES[0], saga_of("offline")), 60)
        await asyncio.wait_for(play(PHASES[1], saga_of("normal")), 60)

    services = decisions_of(log)
    # With no cooldown the controller asks for the p1 job again after each abort, as long
    # as the snapshots come; the replay's horizon ends after the first: compare up to it.
    assert isinstance(services["victims"], list)
    services["victims"] = services["victims"][:4]
    assert services == replayed(), json.dumps(log)
