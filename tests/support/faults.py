"""Fault injection against a whole stack of processes, for the fault suite and the bench.

What a fault does here is what an operator's bad day does: SIGKILL of one process (a
service, nats-server, the postmaster), or a server frozen with SIGSTOP (unreachable
while its sockets stay open, the way a partition or a stalled disk looks). Recovery is
never helped along: the stack's own supervisor must bring back what died, and the
services must find their servers again. The harness only watches, with a bound on
every wait.

The servers' pids are read from the files each server writes in its data directory
(nats-server's ports file, PostgreSQL's postmaster.pid), so the harness does not depend
on how the stack keeps its server handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
import psutil
from nats.aio.client import Client as NatsClient

from gpusched.cli.stack import Stack
from gpusched.contracts.messages import (
    GetJob,
    GetReply,
    GpuRequest,
    JobView,
    PriorityClassName,
    SubmitJob,
    SubmitReply,
    WorkloadSpec,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.db import asyncpg_dsn
from gpusched.infra.settings import Settings
from tests.support.identity import harness_options

SERVERS = ("nats", "postgres")
REQUEST_TIMEOUT_S = 3.0
# Job states: still to be placed, placed, and the two ends.
WAITING = frozenset({"queued", "held", "preempted"})
FINISHED = frozenset({"completed", "failed"})

# Settings that make a stack react in fractions of a second (the e2e tests' values).
FAST_ENV = {
    "GPUSCHED_INGEST__WINDOW_S": "1.5",
    "GPUSCHED_INGEST__SNAPSHOT_INTERVAL_S": "0.5",
    "GPUSCHED_AGENT__TELEMETRY_INTERVAL_S": "0.5",
    "GPUSCHED_ADMISSION__SCHEDULE_INTERVAL_S": "0.25",
    "GPUSCHED_CHECKPOINT__SWEEP_INTERVAL_S": "0.2",
    "GPUSCHED_OUTBOX__POLL_INTERVAL_S": "0.2",
    "GPUSCHED_LOG_LEVEL": "WARNING",
}


def progress(message: str) -> None:
    """One line per step, timestamped, so a long run shows where it is (pytest -s)."""
    print(f"[faults {time.strftime('%H:%M:%S')}] {message}", flush=True)


async def within(what: str, check: Callable[[], Awaitable[Any]], seconds: float) -> float:
    """Poll `check` until truthy; the seconds it took. Fails naming `what` and its last value."""
    started = time.monotonic()
    last: Any = None
    while True:
        try:
            last = await check()
        except Exception as exc:  # the thing checked may itself be down: keep polling
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last:
                return time.monotonic() - started
        if time.monotonic() - started > seconds:
            raise AssertionError(f"{what}: not within {seconds:.0f}s (last: {last!r})")
        await asyncio.sleep(0.1)


# ======================================================================================
# The stack under test: its own servers, so they can be killed
# ======================================================================================
def own_servers_settings(data_dir: Path, prefix: str = "gpusched") -> Settings:
    """Settings that make a Stack start its own embedded NATS and PostgreSQL in `data_dir`
    (whatever GPUSCHED_NATS_URL / GPUSCHED_DATABASE_URL say): the shared test servers
    must not be the ones killed."""
    return Settings(nats_url=None, database_url=None, subject_prefix=prefix, data_dir=data_dir)


class WatchedStack:
    """A stack whose supervision runs: start() brings it up, stop() reaps everything.

    Both block (the stack starts its servers and runs migrations), so async callers run
    them in a thread.
    """

    def __init__(self, settings: Settings, log_dir: Path, env: dict[str, str]) -> None:
        self.stack = Stack(settings, env={**FAST_ENV, **env}, log_dir=log_dir)
        self._watcher: threading.Thread | None = None
        self._supervisor: Any = None

    @property
    def settings(self) -> Settings:
        return self.stack.settings

    def start(self) -> Stack:
        self.stack.start()
        self._supervisor = self.stack.supervisor
        self._watcher = _supervise(self.stack)
        return self.stack

    def stop(self) -> None:
        self.stack.stop()
        if self._watcher is not None:
            # A wait() that only returns on a signal or a crash is told to end here.
            stop_requested = getattr(self._supervisor, "_stop_requested", None)
            if isinstance(stop_requested, threading.Event):
                stop_requested.set()
            self._watcher.join(timeout=15)
            self._watcher = None


def _supervise(stack: Stack) -> threading.Thread | None:
    """Make sure the stack's supervision runs as it does under `gpusched up`.

    A supervisor that watches its children on a thread of its own (it counts restarts)
    needs nothing. One that reacts to a death only inside its blocking wait() gets that
    call on a daemon thread, which returns when the stack stops.
    """
    supervisor = stack.supervisor
    assert supervisor is not None
    if hasattr(supervisor, "restarts"):
        return None
    thread = threading.Thread(target=supervisor.wait, name="faults-supervision", daemon=True)
    thread.start()
    return thread


def log_tail(stack: Stack, name: str, lines: int = 15) -> str:
    """The end of one process's log, for a failure message."""
    if stack.log_dir is None:
        return ""
    path = stack.log_dir / f"{name}.log"
    if name in SERVERS:
        data = stack.settings.data_dir.resolve()
        path = data / "nats" / "nats.log" if name == "nats" else data / "postgres" / "postgres.log"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path.name})"
    return "\n".join(text.splitlines()[-lines:])


# ======================================================================================
# Processes: find, kill, freeze, and see them back
# ======================================================================================
def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


def server_pid(stack: Stack, server: str) -> int | None:
    """The live pid of the stack's nats-server or postmaster, from its data directory."""
    data = stack.settings.data_dir.resolve()
    if server == "nats":
        pids = []
        for ports_file in (data / "nats").glob("*_*.ports"):
            with contextlib.suppress(ValueError):
                pids.append(int(ports_file.stem.rsplit("_", 1)[1]))
        live = [pid for pid in pids if _alive(pid)]
        return live[0] if live else None
    try:
        first = (data / "postgres" / "pgdata" / "postmaster.pid").read_text().split("\n", 1)[0]
        pid = int(first)
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) else None


def service_pid(stack: Stack, service: str) -> int | None:
    """The live pid of one service process (None while it is down or being restarted)."""
    if stack.supervisor is None:
        return None
    try:
        pid = stack.supervisor.pid(service)
    except KeyError:
        return None
    return pid if _alive(pid) else None


def pid_of(stack: Stack, target: str) -> int | None:
    return server_pid(stack, target) if target in SERVERS else service_pid(stack, target)


@dataclass(frozen=True)
class Fault:
    target: str  # a service name, "nats" or "postgres"
    kind: str  # "kill" (SIGKILL) or "pause" (SIGSTOP for `seconds`, then SIGCONT)
    seconds: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.target}"


def kill(stack: Stack, target: str) -> int:
    """SIGKILL the target now; the pid killed."""
    pid = pid_of(stack, target)
    assert pid is not None, f"{target} is not running, nothing to kill"
    os.kill(pid, signal.SIGKILL)
    return pid


async def pause(stack: Stack, target: str, seconds: float) -> int:
    """Freeze the target's whole process group (PostgreSQL's backends too) for `seconds`."""
    pid = pid_of(stack, target)
    assert pid is not None, f"{target} is not running, nothing to pause"
    group = os.getpgid(pid)
    os.killpg(group, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(group, signal.SIGCONT)
    return pid


async def back(stack: Stack, target: str, old_pid: int, seconds: float) -> float:
    """Wait until a new process of the target runs (and, for a server, answers)."""

    async def replaced() -> bool:
        pid = pid_of(stack, target)
        if pid is None or pid == old_pid:
            return False
        if target == "nats":
            return await nats_answers(stack.settings)
        if target == "postgres":
            return await postgres_answers(stack.settings)
        return True

    try:
        return await within(f"{target} restarted", replaced, seconds)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n--- {target} log ---\n{log_tail(stack, target)}") from None


async def nats_answers(settings: Settings) -> bool:
    assert settings.nats_url
    nc = await nats.connect(
        settings.nats_url,
        connect_timeout=1,
        max_reconnect_attempts=0,
        allow_reconnect=False,
        **harness_options(settings),
    )
    try:
        await asyncio.wait_for(nc.jetstream().account_info(), 2)
        return True
    finally:
        await nc.close()


async def postgres_answers(settings: Settings) -> bool:
    assert settings.database_url
    conn = await asyncpg.connect(asyncpg_dsn(settings.database_url), timeout=2)
    try:
        return bool(await conn.fetchval("SELECT 1", timeout=2))
    finally:
        await conn.close()


# ======================================================================================
# The load: jobs submitted continuously, every acknowledgement recorded
# ======================================================================================
@dataclass
class Acked:
    key: str
    job_id: str
    long: bool


@dataclass
class Load:
    """A client that submits jobs through the public API as fast as `rate` allows.

    Each job has its own idempotency key. A submit that gets no answer (a timeout while
    a server or admission is away) is sent again later with the same key, as a careful
    client would; an answer `ok: true` is an acknowledgement, recorded with its job id.
    If the same key is ever answered with two job ids, that is a duplicate.
    """

    nats_url: str
    prefix: str
    team: str = "faults"
    rate: float = 2.0
    long_every: int = 4  # every Nth job trains long enough to be running when a fault hits
    short_steps: int = 40
    long_steps: int = 300
    step_seconds: float = 0.05
    # How long a request waits for its answer; shorter measures a recovery more finely.
    timeout_s: float = REQUEST_TIMEOUT_S
    # The client's identity (an operator's, which may submit for the team); None: none.
    credentials: Path | None = None
    acked: dict[str, Acked] = field(default_factory=dict)
    duplicates: list[tuple[str, str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    _unanswered: list[tuple[str, bool]] = field(default_factory=list)
    _nc: NatsClient | None = None
    _seq: Iterator[int] = field(default_factory=itertools.count)

    async def __aenter__(self) -> Load:
        # Its own connection that never gives up: the client outlives the NATS restarts.
        self._nc = await nats.connect(
            self.nats_url,
            name="faults-load",
            connect_timeout=2,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            **natsauth.connect_options(self.credentials),
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            await self._nc.close()

    @property
    def subjects(self) -> Subjects:
        return Subjects(self.prefix)

    def job(self, key: str, *, long: bool = False, steps: int | None = None) -> SubmitJob:
        return SubmitJob(
            name=f"load-{key[-8:]}",
            team=self.team,
            priority_class=PriorityClassName.P1_NORMAL,
            gpus=GpuRequest(count=1),
            checkpointable=True,
            idempotency_key=key,
            workload=WorkloadSpec(
                kind="sim",
                steps=steps or (self.long_steps if long else self.short_steps),
                step_seconds=self.step_seconds,
                checkpoint_seconds=0.1,
                # Long jobs save as real training does, so an interrupted one resumes
                # from its newest checkpoint instead of from step 0.
                checkpoint_every_steps=20 if long else None,
            ),
        )

    async def request(self, subject: str, body: bytes) -> bytes | None:
        """The reply, or None when there was none in time (the server or service is away)."""
        assert self._nc is not None
        try:
            msg = await self._nc.request(subject, body, timeout=self.timeout_s)
        except (TimeoutError, nats.errors.Error, OSError) as exc:
            self.outcomes[f"no answer ({type(exc).__name__})"] += 1
            return None
        return bytes(msg.data)

    async def submit(self, key: str, *, long: bool = False, steps: int | None = None) -> str | None:
        """Send one submit; the job id if it was acknowledged."""
        body = self.job(key, long=long, steps=steps).model_dump_json().encode()
        raw = await self.request(self.subjects.api_jobs_submit, body)
        if raw is None:
            return None
        reply = SubmitReply.model_validate_json(raw)
        if not reply.ok or reply.job_id is None:
            code = reply.error.code if reply.error else "?"
            self.outcomes[f"error {code}"] += 1
            if code == "invalid":
                self.refused.append((key, str(reply.error)))
            return None
        self.outcomes["ok"] += 1
        known = self.acked.get(key)
        if known is not None and known.job_id != reply.job_id:
            self.duplicates.append((key, known.job_id, reply.job_id))
        elif known is None:
            self.acked[key] = Acked(key, reply.job_id, long)
        return reply.job_id

    async def submit_until_acked(
        self, key: str, seconds: float, *, long: bool = False, steps: int | None = None
    ) -> str:
        """Submit (the same key) until acknowledged; the job id."""
        deadline = time.monotonic() + seconds
        while True:
            job_id = await self.submit(key, long=long, steps=steps)
            if job_id is not None:
                return job_id
            if time.monotonic() > deadline:
                raise AssertionError(f"submit {key}: not acknowledged within {seconds:.0f}s")
            await asyncio.sleep(0.2)

    async def get(self, job_id: str) -> JobView | None:
        raw = await self.request(
            self.subjects.api_jobs_get, GetJob(job_id=job_id).model_dump_json().encode()
        )
        if raw is None:
            return None
        reply = GetReply.model_validate_json(raw)
        return reply.job if reply.ok else None

    async def run(self, stop: asyncio.Event) -> None:
        """Submit new jobs (and retry unanswered keys) until `stop` is set."""
        interval = 1.0 / self.rate
        while not stop.is_set():
            if self._unanswered:
                key, long = self._unanswered.pop(0)
            else:
                n = next(self._seq)
                key, long = f"faults-{uuid.uuid4().hex[:12]}", n % self.long_every == 0
            answered = await self.submit(key, long=long) is not None
            refused = any(k == key for k, _ in self.refused)
            if not answered and not refused and key not in self.acked:
                self._unanswered.append((key, long))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)

    async def flush(self, seconds: float) -> None:
        """Retry every unanswered key until it is answered (the stack is back by now)."""
        for key, long in self._unanswered:
            if key not in self.acked:
                await self.submit_until_acked(key, seconds, long=long)
        self._unanswered.clear()

    async def resubmit_all(self) -> None:
        """Send every acknowledged key again: each must answer the job id it got first."""
        for acked in list(self.acked.values()):
            await self.submit_until_acked(acked.key, 30, long=acked.long)

    def summary(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.outcomes.items()))


async def placed(load: Load, job_id: str) -> bool:
    view = await load.get(job_id)
    return view is not None and (view.state not in WAITING)


async def finished(load: Load, job_id: str) -> JobView | None:
    view = await load.get(job_id)
    return view if view is not None and view.state in FINISHED else None


# ======================================================================================
# Admission's records, read straight from its schema
# ======================================================================================
@dataclass(frozen=True)
class JobRow:
    job_id: str
    key: str | None
    state: str
    attempt: int
    resume_from: dict[str, Any] | None


async def _connect(settings: Settings) -> asyncpg.Connection:
    assert settings.database_url
    return await asyncpg.connect(asyncpg_dsn(settings.database_url), timeout=5)


async def job_rows(settings: Settings, team: str) -> list[JobRow]:
    conn = await _connect(settings)
    try:
        rows = await conn.fetch(
            "SELECT job_id, idempotency_key, state, attempt, resume_from "
            "FROM admission.jobs WHERE team = $1",
            team,
            timeout=10,
        )
    finally:
        await conn.close()
    return [
        JobRow(
            r["job_id"],
            r["idempotency_key"],
            r["state"],
            r["attempt"],
            json.loads(r["resume_from"]) if r["resume_from"] else None,
        )
        for r in rows
    ]


async def gpus_in_two_live_allocations(settings: Settings) -> dict[str, list[str]]:
    """Every whole GPU held by more than one live allocation: `node/index` -> allocation ids.

    Shares (a fraction or a MIG slice of one GPU) may stack on one GPU by design; the
    fault suite's jobs ask whole GPUs, and a whole GPU under a share is counted too.
    """
    conn = await _connect(settings)
    try:
        rows = await conn.fetch(
            "SELECT allocation_id, gpus, share IS NOT NULL AS shared "
            "FROM admission.allocations WHERE released_at IS NULL",
            timeout=10,
        )
    finally:
        await conn.close()
    whole: dict[str, list[str]] = {}
    shared: dict[str, list[str]] = {}
    for row in rows:
        for gpu in json.loads(row["gpus"]):
            ref = f"{gpu['node']}/{gpu['index']}"
            (shared if row["shared"] else whole).setdefault(ref, []).append(row["allocation_id"])
    return {
        ref: ids + shared.get(ref, [])
        for ref, ids in whole.items()
        if len(ids) + len(shared.get(ref, [])) > 1
    }


def check_acknowledged(load: Load, rows: Sequence[JobRow]) -> list[str]:
    """What is wrong with the acknowledged jobs: lost, duplicated, or under another key."""
    problems = [f"key {k} answered with two job ids: {a} and {b}" for k, a, b in load.duplicates]
    by_id = {row.job_id: row for row in rows}
    by_key: dict[str, list[str]] = {}
    for row in rows:
        if row.key is not None:
            by_key.setdefault(row.key, []).append(row.job_id)
    for acked in load.acked.values():
        stored = by_id.get(acked.job_id)
        if stored is None:
            problems.append(f"acknowledged job {acked.job_id} (key {acked.key}) is lost")
        elif stored.key != acked.key:
            problems.append(f"job {acked.job_id} is stored under key {stored.key}, not {acked.key}")
        if len(by_key.get(acked.key, [])) > 1:
            problems.append(f"key {acked.key} has several jobs: {by_key[acked.key]}")
    return problems
