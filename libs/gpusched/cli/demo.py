"""`gpusched demo`: the main flow of DESIGN §3 played on the embedded servers.

Training jobs fill the shared pool; inference load surges; the controller borrows
GPUs, the checkpoint saga waits for the job's confirmed checkpoint before the
eviction; the surge ends; the GPUs go back; the job resumes from its checkpoint; the
bill is printed. Every line of the timeline is printed from a real message on the
bus. Each phase has a deadline: if the system does not get there, the demo says
which phase failed and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from gpusched.cli.client import ApiClient, ApiError, stack_identity
from gpusched.cli.stack import Stack
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    GpuRequest,
    JobView,
    PriorityClassName,
    SubmitJob,
    T,
    WorkloadSpec,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.settings import Settings
from gpusched.infra.tls import nats_context, server_name
from gpusched.simcluster.demand import SIM_DEMAND, InferenceDemand

# Fast clocks so the story fits in a minute; every one of these is an ordinary setting.
DEMO_ENV = {
    "GPUSCHED_INGEST__WINDOW_S": "2",
    "GPUSCHED_INGEST__SNAPSHOT_INTERVAL_S": "0.5",
    "GPUSCHED_AGENT__TELEMETRY_INTERVAL_S": "0.25",
    "GPUSCHED_ADMISSION__SCHEDULE_INTERVAL_S": "0.25",
    "GPUSCHED_PREEMPTION__COOLDOWN_S": "4",
    # Short windows (defaults: 30 s to expand, 10 min to shrink, lend at least 15 min)
    # and no minimum runtime (default 30 min), so the story fits in a minute.
    "GPUSCHED_PREEMPTION__EXPAND_HOLD_S": "1",
    "GPUSCHED_PREEMPTION__SHRINK_HOLD_S": "2",
    "GPUSCHED_PREEMPTION__MIN_LEND_S": "3",
    "GPUSCHED_PREEMPTION__MIN_RUNTIME_S": "0",
    # The demo's training keeps the shared pool at 95%; with the default gate (shared
    # below 0.60) the lent GPUs would go back only once training quietens down.
    "GPUSCHED_PREEMPTION__SHARED_BELOW": "1.0",
    "GPUSCHED_CHECKPOINT__GRACE_S": "30",
    "GPUSCHED_CHECKPOINT__SWEEP_INTERVAL_S": "0.25",
    "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
    "GPUSCHED_LOG_LEVEL": "WARNING",
}

JOBS = (
    # name, team, priority, gpus
    ("sweep-lr", "research", PriorityClassName.P2_OFFLINE, 8),
    ("llm-pretrain", "foundation", PriorityClassName.P1_NORMAL, 16),
    ("vision-ft", "vision", PriorityClassName.P1_NORMAL, 8),
    ("hotfix-eval", "foundation", PriorityClassName.P0_URGENT, 8),
)


class DemoFailed(RuntimeError):
    pass


@dataclass
class Timeline:
    """Prints one readable line per interesting message, and remembers what it saw."""

    started: float = field(default_factory=time.monotonic)
    names: dict[str, str] = field(default_factory=dict)  # job id -> job name
    seen: list[tuple[float, str, dict[str, Any]]] = field(default_factory=list)
    _last_pools: str = ""
    _last_pool_print: float = 0.0

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {text}", flush=True)

    def heading(self, text: str) -> None:
        print(f"\n== {text}", flush=True)

    def job(self, job_id: str) -> str:
        return self.names.get(job_id, job_id)

    def count(self, message_type: str, **match: Any) -> int:
        return sum(
            1
            for _, t, d in self.seen
            if t == message_type and all(d.get(k) == v for k, v in match.items())
        )

    def first(self, message_type: str, **match: Any) -> float | None:
        for at, t, d in self.seen:
            if t == message_type and all(d.get(k) == v for k, v in match.items()):
                return at
        return None

    async def on_message(self, msg: Msg) -> None:
        try:
            env = Envelope.from_bytes(msg.data)
        except Exception:
            return
        data = dict(env.data)
        if env.type in (T.JOB_STARTED, T.CHECKPOINT_CONFIRMED, T.JOB_COMPLETED):
            data.setdefault("job_id", env.correlation_id)
        self.seen.append((time.monotonic(), env.type, data))
        line = self.describe(env.type, data, msg.subject)
        if line:
            self.say(line)

    def describe(self, message_type: str, d: dict[str, Any], subject: str) -> str | None:
        job = self.job(str(d.get("job_id", "")))
        if message_type == T.ALLOCATION_GRANTED:
            nodes = sorted({g["node"] for g in d["gpus"]})
            resume = d.get("resume_from")
            tail = f", resuming from checkpoint {resume['checkpoint_id']}" if resume else ""
            return (
                f"admission  placed {job} ({d['priority_class']}) on {len(d['gpus'])} "
                f"GPUs of {', '.join(nodes)}, attempt {d['attempt']}{tail}"
            )
        if message_type == T.POOL_SNAPSHOT:
            pools = {p["pool"]: p for p in d["pools"]}
            text = "  ".join(
                f"{name} {p['gpus']} GPUs at {p['util']:.0%}" for name, p in sorted(pools.items())
            )
            now = time.monotonic()
            if text != self._last_pools and now - self._last_pool_print > 2.0:
                self._last_pools, self._last_pool_print = text, now
                return f"ingest     pools: {text}"
            return None
        if message_type == T.AUDIT and str(d.get("action", "")).startswith("preempt."):
            return f"preemption {d['action']}: {d['reason']}"
        if message_type == T.GPUS_RESERVED:
            pending = len(d.get("pending", []))
            return (
                f"admission  {len(d['gpus'])} shared GPUs reserved for inference "
                f"({pending} still held by training until evicted)"
            )
        if message_type == T.CHECKPOINT_REQUESTED:
            return (
                f"checkpoint asked {job} for a checkpoint ({d['stage_required']} required, "
                f"deadline {d['deadline'][11:19]})"
            )
        if message_type == T.CHECKPOINT_CONFIRMED:
            return (
                f"job        {job} confirmed checkpoint {d['checkpoint_id']} at step "
                f"{d['step']} ({d['stage']}, {d['bytes']} bytes)"
            )
        if message_type == T.EVICT_WORKLOAD:
            forced = " (FORCED, no confirmed checkpoint)" if d.get("forced") else ""
            return f"checkpoint evict {job}{forced}"
        if message_type == T.WORKLOAD_STOPPED:
            return f"agent      {job} stopped ({d['reason']})"
        if message_type == T.EVICTION_COMPLETED:
            return f"checkpoint eviction of {job} completed; it will resume from its checkpoint"
        if message_type in (T.EVICTION_ABORTED, T.EVICTION_FORCED, T.EVICTION_CANCELLED):
            return f"checkpoint {message_type} for {job}: {d.get('reason', '')}"
        if message_type == T.GPUS_RETURNED:
            return f"admission  {len(d['gpus'])} GPUs returned to the shared pool"
        if message_type == T.JOB_STARTED:
            resumed = d.get("resumed_from")
            how = f"resumed from {resumed}" if resumed else "from scratch"
            return f"job        {job} started, attempt {d['attempt']}, {how}"
        return None


# While the demo waits on the system, it says so this often: never a silent minute.
PROGRESS_EVERY_S = 5.0


async def _until(
    what: str,
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    within: float,
    tl: Timeline | None = None,
) -> None:
    started = time.monotonic()
    deadline = started + within
    next_word = started + PROGRESS_EVERY_S
    while time.monotonic() < deadline:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if tl is not None and time.monotonic() >= next_word:
            tl.say(f"demo       still waiting for {what} ({time.monotonic() - started:.0f}s)")
            next_word += PROGRESS_EVERY_S
        await asyncio.sleep(0.2)
    raise DemoFailed(f"timed out after {within:.0f}s waiting for: {what}")


async def _set_demand(nc: NatsClient, subjects: Subjects, gpus: float) -> None:
    env = make_envelope(SIM_DEMAND, InferenceDemand(gpus=gpus), source="demo")
    await nc.jetstream().publish(
        subjects.command("agent", SIM_DEMAND), env.to_bytes(), headers={"Nats-Msg-Id": env.id}
    )


async def scenario(settings: Settings, timeline: Timeline) -> None:
    assert settings.nats_url
    subjects = Subjects(settings.subject_prefix)
    nats_tls = nats_context(settings)
    nc = await nats.connect(
        settings.nats_url,
        name="gpusched-demo",
        tls=nats_tls,
        tls_hostname=server_name(nats_tls),
        **natsauth.connect_options(stack_identity(settings, natsauth.SIMULATOR)),
    )
    p = subjects.prefix
    for subject in (f"{p}.evt.>", f"{p}.cmd.>", f"{p}.jobs.>", f"{p}.audit.preempt.>"):
        await nc.subscribe(subject, cb=timeline.on_message)
    try:
        async with ApiClient(
            settings.nats_url,
            settings.subject_prefix,
            credentials=settings.nats_credentials,
            tls=nats_tls,
        ) as api:
            timeline.say("demo       waiting for the services to answer (migrations, consumers)")
            await _until("admission to answer", lambda: _serving(api), 90, timeline)
            timeline.say("demo       the services answer")
            await _play(api, nc, subjects, timeline)
    finally:
        await nc.close()


async def _serving(api: ApiClient) -> bool:
    try:
        await api.get("job-000000000000")
    except ApiError:
        return False
    return True


async def _play(api: ApiClient, nc: NatsClient, subjects: Subjects, tl: Timeline) -> None:
    async def view(job_id: str) -> JobView:
        reply = await api.get(job_id)
        if not reply.ok or reply.job is None:
            raise DemoFailed(f"cannot read job {job_id}: {reply.error}")
        return reply.job

    tl.heading("1. Training fills the shared pool (40 GPUs)")
    ids: dict[str, str] = {}
    for name, team, priority, gpus in JOBS:
        reply = await api.submit(
            SubmitJob(
                name=name,
                team=team,
                priority_class=priority,
                gpus=GpuRequest(count=gpus),
                workload=WorkloadSpec(kind="sim", steps=1_000_000, step_seconds=0.1),
            )
        )
        if not reply.ok or reply.job_id is None:
            raise DemoFailed(f"submit {name} refused: {reply.error}")
        ids[name] = reply.job_id
        tl.names[reply.job_id] = name
        tl.say(f"client     submitted {name} ({priority}, {gpus} GPUs) as {reply.job_id}")

    async def all_running() -> bool:
        return all([(await view(j)).state == "running" for j in ids.values()])

    await _until("every training job to run", all_running, 30, tl)

    tl.heading("2. Steady inference load: 12 GPUs of demand on the 24-GPU inference pool")
    await _set_demand(nc, subjects, 12.0)
    await asyncio.sleep(3)

    tl.heading("3. Inference surge: 22 GPUs of demand on 24 inference GPUs (92%)")
    await _set_demand(nc, subjects, 22.0)
    victim = ids["sweep-lr"]
    await _until(
        "the surge to be absorbed (eviction completed)",
        lambda: tl.count(T.EVICTION_COMPLETED, job_id=victim) > 0,
        60,
        tl,
    )
    [request] = [d for _, t, d in tl.seen if t == T.CHECKPOINT_REQUESTED and d["job_id"] == victim]
    stage = request["stage_required"]
    confirmed_at = min(
        (
            at
            for at, t, d in tl.seen
            if t == T.CHECKPOINT_CONFIRMED
            and d.get("job_id") == victim
            and d.get("request_id") == request["request_id"]
            and (d.get("stage") == "persisted" or stage == "snapshotted")
        ),
        default=None,
    )
    evicted_at = tl.first(T.EVICT_WORKLOAD, job_id=victim)
    if confirmed_at is None or evicted_at is None or evicted_at < confirmed_at:
        raise DemoFailed("the evict command was not preceded by a confirmed checkpoint")
    tl.say(
        f"demo       evict sent {1000 * (evicted_at - confirmed_at):.0f} ms after the job "
        f"confirmed its checkpoint ({stage}, what its class p2-offline requires): "
        "no training work was thrown away"
    )
    await asyncio.sleep(3)

    tl.heading("4. The surge ends: demand falls to 4 GPUs")
    await _set_demand(nc, subjects, 4.0)
    await _until("GPUs returned to the shared pool", lambda: tl.count(T.GPUS_RETURNED) > 0, 60, tl)

    async def resumed() -> bool:
        job = await view(victim)
        return job.state == "running" and job.attempt >= 2 and job.resume_from is not None

    await _until("sweep-lr to resume from its checkpoint", resumed, 30, tl)
    await _until(
        "sweep-lr to announce the resume",
        lambda: any(
            t == T.JOB_STARTED and d.get("job_id") == victim and d.get("resumed_from")
            for _, t, d in tl.seen
        ),
        30,
        tl,
    )
    job = await view(victim)
    assert job.resume_from is not None
    tl.say(
        f"demo       {job.name} is running again (attempt {job.attempt}) "
        f"from checkpoint {job.resume_from.checkpoint_id} at step {job.resume_from.step}"
    )

    tl.heading("5. The bill")
    bill = await api.call("api.billing.statement", {})
    if not bill.get("ok"):
        raise DemoFailed(f"billing statement failed: {json.dumps(bill)}")
    print(bill.get("text", ""), flush=True)


def run_demo(*, keep_data: bool = False) -> int:
    data_dir = Path(tempfile.mkdtemp(prefix="gpusched-demo-"))
    base = Settings()
    settings = base.model_copy(update={"data_dir": data_dir})
    if base.nats_url or base.database_url:
        # External servers: isolate this run's subjects so it never touches real traffic.
        settings = settings.model_copy(update={"subject_prefix": f"demo{os.getpid()}"})
    timeline = Timeline()
    print("gpusched demo: starting embedded NATS + PostgreSQL and six services ...", flush=True)
    stack = Stack(settings, env=DEMO_ENV, log_dir=data_dir / "logs")
    code = 0
    try:
        resolved = stack.start()
        timeline.say(f"stack up (NATS {resolved.nats_url}); service logs in {data_dir / 'logs'}")
        asyncio.run(scenario(resolved, timeline))
        print(f"\nDemo finished in {time.monotonic() - timeline.started:.0f}s.", flush=True)
    except DemoFailed as exc:
        print(f"\nDEMO FAILED: {exc}\nService logs: {data_dir / 'logs'}", file=sys.stderr)
        keep_data = True
        code = 1
    finally:
        stack.stop()
        if not keep_data:
            with contextlib.suppress(OSError):
                shutil.rmtree(data_dir)
    return code
