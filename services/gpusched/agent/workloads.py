"""The workloads the simulated cluster runs: a virtual training loop or a real process.

Both behave like a job on a real cluster: they speak to the control plane only through
the SDK (over NATS), never through the agent. A process runs as the workload user
(gpusched.agent.identity), in its job directory, with an environment of its own: the
job's variables and the few the agent passes on, never the agent's settings or secrets.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Final, Protocol

from nats.aio.client import Client as NatsClient

from gpusched.agent.identity import WorkloadUser, prepare_job_dir
from gpusched.contracts.messages import GpuShare, StartWorkload, StopReason
from gpusched.infra.errors import Unavailable, is_outage
from gpusched.infra.settings import TlsSettings
from gpusched.infra.supervisor import spawn_bound_child, terminate
from gpusched.infra.tasks import cancel_and_wait
from gpusched.sdk import (
    AsyncJobClient,
    CheckpointError,
    CheckpointRequest,
    JobClientError,
    JobEnvironment,
    PreemptionCancelled,
    ResumeRequest,
    SavedCheckpoint,
    checkpoint_path,
    file_digest,
    save_file_checkpoint,
)
from gpusched.sdk.environment import without_credentials as without_credentials  # re-exported
from gpusched.simcluster.training import CheckpointContentError, VirtualLoop, checkpoint_document
from gpusched.simcluster.training import checkpoint_step as read_checkpoint_step

log = logging.getLogger(__name__)

_POLL_S = 0.1
# How long a finished sim job waits for its last events (completion) to be delivered
# when the control plane is away; the agent reports the workload stopped after that.
_RESULT_FLUSH_S = 300.0
# Interpreter names in argv that mean "the Python this agent runs on", which has the SDK.
_PYTHON_NAMES = frozenset({"python", "python3"})
# What a process inherits from the agent's environment: where programs are and the
# locale. Everything else (GPUSCHED_* settings, NATS credentials, the database URL,
# cloud keys) stays with the agent; agent.workload_env names more to pass on.
_INHERITED: Final = frozenset({"PATH", "LANG", "LANGUAGE", "TZ"})
_INHERITED_PREFIXES: Final = ("LC_",)
_DEFAULT_PATH: Final = "/usr/local/bin:/usr/bin:/bin"


class WorkloadLaunchError(Exception):
    """The workload could not be started at all (bad command, unreadable checkpoint)."""


@dataclass(frozen=True, slots=True)
class WorkloadExit:
    reason: StopReason
    exit_code: int | None = None
    error: str | None = None


class Workload(Protocol):
    async def launch(self) -> None:
        """Start it; raises WorkloadLaunchError if it cannot run at all, and
        gpusched.infra.errors.Unavailable if a server it needs cannot be reached now
        (nothing of it is left running: the start is applied again once it is back)."""

    async def wait(self) -> WorkloadExit:
        """Until it ends by itself."""

    async def stop(self, grace_s: float, *, checkpoint: bool = False) -> int | None:
        """End it now (exit code, if it has one). With `checkpoint` (the agent shuts
        down), it first saves a checkpoint if it can do so within `grace_s`."""


def job_dir(workdir: Path, job_id: str) -> Path:
    return workdir / job_id


CREDENTIALS_FILE = "nats.creds"


def write_credentials(directory: Path, creds: str, user: WorkloadUser | None) -> Path:
    """The job's credentials file, replaced whole (nats-py reads it at every
    reconnect, so a renewal takes effect the next time the job connects); readable by
    the workload's user only."""
    path = directory / CREDENTIALS_FILE
    tmp = directory / f".{CREDENTIALS_FILE}.tmp"
    tmp.unlink(missing_ok=True)  # the directory is the workload's: never write through a link
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(creds)
    if user is not None:
        os.chown(tmp, user.uid, user.gid)
    os.replace(tmp, path)
    return path


def workload_environment(
    agent_env: Mapping[str, str],
    job_env: Mapping[str, str],
    *,
    home: Path,
    user: WorkloadUser | None,
    pass_on: Sequence[str] = (),
) -> dict[str, str]:
    """A process workload's whole environment: the job's own variables over the few
    the agent passes on (locale, PATH, and the names in `pass_on`)."""
    env = {
        name: value
        for name, value in agent_env.items()
        if (name in _INHERITED or name.startswith(_INHERITED_PREFIXES) or name in pass_on)
        and not name.startswith("GPUSCHED_")
    }
    env.setdefault("PATH", _DEFAULT_PATH)
    env["HOME"] = str(home)
    if user is not None:
        env["USER"] = env["LOGNAME"] = user.name
    env.update(job_env)
    return env


def mps_environment(share: GpuShare | None) -> dict[str, str]:
    """A fractional tenant's limits, the way NVIDIA MPS takes them: its compute share as
    the active thread percentage (rounded up, so a small share still runs) and its memory
    cap pinned on device 0, the one GPU it sees. A MIG slice is isolated by the hardware."""
    if share is None or share.mig_profile is not None:
        return {}
    return {
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(-(-share.milli // 10)),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": f"0={share.memory_mib}M",
    }


# ======================================================================================
# A virtual training loop, driven through the real SDK
# ======================================================================================
class SimWorkload:
    def __init__(
        self,
        start: StartWorkload,
        *,
        connection: NatsClient,
        prefix: str,
        workdir: Path,
        time_scale: float,
    ) -> None:
        spec = start.workload
        self._start = start
        self._loop = VirtualLoop(spec.steps, spec.step_seconds, spec.checkpoint_seconds, time_scale)
        self._dir = job_dir(workdir, start.job_id)
        self._job = AsyncJobClient(
            "", start.job_id, start.attempt, prefix=prefix, connection=connection
        )
        self._task: asyncio.Task[WorkloadExit] | None = None
        self._step: int | None = None  # the step reached, once training has begun
        self._first_step = 0

    async def launch(self) -> None:
        # Listening before the agent reports the workload started: a control message
        # sent right after that report is not lost.
        try:
            await self._job.connect()
        except JobClientError as exc:
            # A failed connect has closed the client (no consumer, no buffer left).
            if is_outage(exc):
                # NATS away, JetStream not answering in time or unavailable: not the
                # job's fault. The start command stays unsettled and is applied again
                # (with a new client) once the server answers.
                raise Unavailable(f"cannot start job {self._start.job_id} yet: {exc}") from exc
            raise WorkloadLaunchError(str(exc)) from exc
        self._task = asyncio.create_task(self._run(), name=f"sim-{self._start.allocation_id}")

    async def wait(self) -> WorkloadExit:
        assert self._task is not None
        return await asyncio.shield(self._task)

    async def stop(self, grace_s: float, *, checkpoint: bool = False) -> int | None:
        if self._task is not None:
            # Not one cancel and an unbounded await: on Python 3.11 a cancel can be lost
            # (infra.tasks), and the agent's command consumer would wait here for good.
            await cancel_and_wait(self._task)
        step = self._step
        if (
            checkpoint
            and step is not None
            and step > self._first_step
            and self._loop.checkpoint_interval_s < grace_s
        ):
            # The agent is going away: save the work done since the last checkpoint, so
            # the job resumes from here rather than from further back.
            try:
                await asyncio.wait_for(self._checkpoint(None, step), grace_s)
            except (TimeoutError, JobClientError) as exc:
                log.warning("sim job %s: no checkpoint at stop: %r", self._start.job_id, exc)
        await self._job.close(timeout=grace_s)
        return None

    async def _run(self) -> WorkloadExit:
        job = self._job
        try:
            result = await self._train()
        except JobClientError as exc:
            log.warning("sim job %s lost the control plane: %s", job.job_id, exc)
            result = WorkloadExit(StopReason.FAILED, error=str(exc))
        self._step = None  # training is over: nothing left to checkpoint at a stop
        # Not in a `finally`: a stopped job is closed by `stop`, after its checkpoint.
        await job.close(timeout=_RESULT_FLUSH_S)
        return result

    async def _train(self) -> WorkloadExit:
        job, loop = self._job, self._loop
        try:
            step = self._resume_step()
        except (OSError, ValueError) as exc:
            await job.failed(f"cannot resume: {exc}")
            return WorkloadExit(StopReason.FAILED, error=str(exc))
        self._first_step = step
        resumed = self._start.resume_from
        await job.started(resumed_from=resumed.checkpoint_id if resumed else None)
        self._step = step
        clock = asyncio.get_running_loop()
        next_step_at = clock.time() + loop.step_interval_s
        reported = last_saved = step
        while not loop.is_done(step):
            # A pass through the loop always gives way: with steps due at once (a short
            # step, a late wake-up) the wait below returns without one.
            await asyncio.sleep(0)
            message = await job.next_control(max(0.0, next_step_at - clock.time()))
            if isinstance(message, CheckpointRequest):
                await self._checkpoint(message, step)
                # Training stood still while it checkpointed.
                next_step_at = clock.time() + loop.step_interval_s
            elif isinstance(message, ResumeRequest):
                try:
                    step = reported = self._checkpoint_step(message.uri, None)
                except (OSError, ValueError) as exc:
                    log.warning("job %s cannot resume from %s: %s", job.job_id, message, exc)
            elif isinstance(message, PreemptionCancelled):
                log.info("job %s keeps training: %s cancelled", job.job_id, message.request_id)
            # Every step due by now, counted rather than taken one by one: a step too
            # short to move the clock must not hold the agent's event loop.
            if due := loop.steps_due(step, clock.time() - next_step_at):
                step += due
                next_step_at += due * loop.step_interval_s
            self._step = step
            periodic = self._start.workload.checkpoint_every_steps
            if periodic and step // periodic > last_saved // periodic and not loop.is_done(step):
                last_saved = step
                await self._checkpoint(None, step)
                next_step_at = clock.time() + loop.step_interval_s
            every = loop.progress_every
            if step != reported and (step // every > reported // every or loop.is_done(step)):
                reported = step
                await job.progress(step, loss=loop.loss(step))
        await job.completed(step)
        return WorkloadExit(StopReason.COMPLETED, exit_code=0)

    def _resume_step(self) -> int:
        resume = self._start.resume_from
        if resume is None:
            return 0
        return self._checkpoint_step(resume.uri, resume.sha256)

    def _checkpoint_step(self, uri: str, sha256: str | None) -> int:
        path = checkpoint_path(uri)
        _, digest = file_digest(path)
        if sha256 is not None and digest != sha256:
            raise CheckpointContentError(f"{uri} does not match its sha256 {sha256}")
        return read_checkpoint_step(path.read_bytes(), self._start.job_id)

    async def _checkpoint(self, request: CheckpointRequest | None, step: int) -> None:
        job_id = self._start.job_id
        document = checkpoint_document(job_id, step)
        path = self._dir / f"ckpt-{step}.json"

        async def save() -> SavedCheckpoint:
            return await asyncio.to_thread(
                save_file_checkpoint,
                path,
                lambda f: f.write(document),
                step=step,
                checkpoint_id=f"{job_id}-step-{step}",
            )

        async def persist(saved: SavedCheckpoint) -> SavedCheckpoint:
            # Copying to durable storage takes the job's configured checkpoint time.
            await asyncio.sleep(self._loop.checkpoint_interval_s)
            return saved

        try:
            await self._job.handle_checkpoint(request, save, persist=persist)
        except CheckpointError as exc:
            log.warning("sim job %s could not checkpoint: %s", job_id, exc)


# ======================================================================================
# A real process (e.g. a PyTorch script using the sync SDK)
# ======================================================================================
class ProcessWorkload:
    def __init__(
        self,
        start: StartWorkload,
        *,
        nats_url: str,
        prefix: str,
        workdir: Path,
        base_env: Mapping[str, str] | None = None,
        user: WorkloadUser | None = None,
        pass_env: Sequence[str] = (),
        nats_ca: Path | None = None,
    ) -> None:
        self._start = start
        self._dir = job_dir(workdir, start.job_id)
        self._user = user
        self._pass_env = tuple(pass_env)
        resume = start.resume_from
        self._env = JobEnvironment(
            nats_url=without_credentials(nats_url),
            job_id=start.job_id,
            attempt=start.attempt,
            prefix=prefix,
            resume_uri=resume.uri if resume else None,
            resume_checkpoint_id=resume.checkpoint_id if resume else None,
            checkpoint_dir=self._dir,
            credentials=self._dir / CREDENTIALS_FILE if start.credentials else None,
            nats_tls=None if nats_ca is None else TlsSettings(ca_file=nats_ca),
        )
        self._base_env = dict(os.environ if base_env is None else base_env)
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def _argv(self) -> list[str]:
        argv = list(self._start.workload.argv)
        if not argv:
            raise WorkloadLaunchError("a process workload needs argv")
        if argv[0] in _PYTHON_NAMES:
            argv[0] = sys.executable
        return argv

    def _child_env(self) -> dict[str, str]:
        job_env = {**self._env.to_environ(), **mps_environment(self._start.share)}
        return workload_environment(
            self._base_env, job_env, home=self._dir, user=self._user, pass_on=self._pass_env
        )

    def renew_credentials(self, creds: str) -> None:
        write_credentials(self._dir, creds, self._user)

    async def launch(self) -> None:
        argv = self._argv()
        try:
            prepare_job_dir(self._dir, self._user)
            if self._start.credentials:
                write_credentials(self._dir, self._start.credentials, self._user)
            out = _open_log(self._dir / f"attempt-{self._start.attempt}.log")
        except OSError as exc:
            raise WorkloadLaunchError(f"cannot prepare {self._dir}: {exc}") from exc
        user = self._user
        try:
            with out:
                self._process = await asyncio.to_thread(
                    spawn_bound_child,
                    argv,
                    env=self._child_env(),
                    cwd=self._dir,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    user=None if user is None else user.uid,
                    group=None if user is None else user.gid,
                )
        except OSError as exc:
            who = "" if user is None else f" as {user.name}"
            raise WorkloadLaunchError(f"cannot run {argv[0]!r}{who}: {exc}") from exc

    async def wait(self) -> WorkloadExit:
        process = self._process
        assert process is not None
        # Popen offers no awaitable exit, and a thread blocked in wait() per job would
        # exhaust the default executor; a poll every 0.1 s is cheap next to a step.
        while (code := process.poll()) is None:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        if code == 0:
            return WorkloadExit(StopReason.COMPLETED, exit_code=0)
        return WorkloadExit(StopReason.FAILED, exit_code=code, error=f"exit code {code}")

    async def stop(self, grace_s: float, *, checkpoint: bool = False) -> int | None:
        # `checkpoint` changes nothing here: SIGTERM is the process's cue to stop, and
        # a job may save on it within the grace; its client delivers buffered events.
        process = self._process
        if process is None:
            return None
        # SIGTERM lets the job finish its step and close its client; SIGKILL (to the
        # whole process group) after the grace leaves nothing behind.
        await asyncio.to_thread(terminate, process, signal.SIGTERM, grace_s)
        return process.returncode


def _open_log(path: Path) -> IO[bytes]:
    """The attempt's log, for appending. The job directory belongs to the workload's
    user, so what is at `path` may have been put there by an earlier attempt: a link
    is not followed and anything but a plain file (a FIFO would block) is refused."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a plain file")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab")
    except BaseException:
        os.close(fd)
        raise
