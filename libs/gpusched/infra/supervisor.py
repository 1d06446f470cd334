"""Runs a set of long-lived child processes as one unit (`gpusched up` runs each service so).

Two promises hold for every child started here, including the embedded servers:

- It never outlives us. On Linux each child asks the kernel, between fork and exec, for a
  signal when its parent dies (prctl PR_SET_PDEATHSIG), so even a SIGKILLed or crashed
  parent leaves no orphan behind. The kernel sends that signal when the *thread* that
  forked the child exits, not the process; so every fork happens on one daemon thread
  that lives exactly as long as the process (a child started from a short-lived worker
  thread, e.g. via asyncio.to_thread, would otherwise be killed when that thread ends).
- It sits in its own process group, so the terminal's Ctrl-C reaches the supervisor only,
  and the supervisor decides the shutdown order. For the same reason a child's stdin is
  /dev/null: a background process group reading the terminal would be stopped (SIGTTIN).

A child that dies is restarted, after a backoff that doubles with each exit in a row and
starts over once the child has run stably (RestartPolicy). A child that keeps dying (a
crash loop) is given up on loudly: one error naming it and its log, then every child is
stopped and wait() returns non-zero. Only a clean stop (SIGINT/SIGTERM to us, or stop())
stops them otherwise.

The module knows nothing of gpusched services: it runs argv lists.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, TextIO

__all__ = [
    "Backoff",
    "ProcessSpec",
    "RestartPolicy",
    "Supervisor",
    "describe_exit",
    "exit_status",
    "spawn_bound_child",
    "terminate",
]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05

_FileTarget = int | IO[bytes] | None


def _death_signal_hook(death_signal: int) -> Callable[[], None] | None:
    """The preexec hook that binds a child to this process, or None where prctl is missing.

    It runs in the child after fork and after any user/group switch (a credential change
    clears the death signal, so the order matters; subprocess switches before the hook).
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.restype = ctypes.c_int
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def bind_to_parent() -> None:
        if prctl(_PR_SET_PDEATHSIG, death_signal, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
        # The parent may have died between fork and prctl; nobody would signal us then.
        if os.getppid() != parent:
            os._exit(1)

    return bind_to_parent


class _ForkThread:
    """The one long-lived thread every child is forked from (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], subprocess.Popen[bytes]], Future[subprocess.Popen[bytes]]]
        ] = queue.SimpleQueue()

    def run(self, fork: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        with self._lock:
            # After os.fork() the thread object survives but the thread does not.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._serve, name="gpusched-child-spawner", daemon=True
                )
                self._thread.start()
        result: Future[subprocess.Popen[bytes]] = Future()
        self._jobs.put((fork, result))
        return result.result()

    def _serve(self) -> None:
        while True:
            fork, result = self._jobs.get()
            try:
                result.set_result(fork())
            except BaseException as error:
                result.set_exception(error)


_fork_thread = _ForkThread()


def spawn_bound_child(
    argv: Sequence[str],
    *,
    death_signal: int = signal.SIGTERM,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    stdout: _FileTarget = None,
    stderr: _FileTarget = None,
    user: int | None = None,
    group: int | None = None,
) -> subprocess.Popen[bytes]:
    """Start `argv` in its own process group, signalled with `death_signal` if we die.

    With `user`/`group` (root only) the child also drops every supplementary group.
    """
    hook = _death_signal_hook(death_signal)

    def fork() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            env=None if env is None else dict(env),
            cwd=cwd,
            preexec_fn=hook,
            process_group=0,
            user=user,
            group=group,
            extra_groups=[] if user is not None else None,
        )

    return _fork_thread.run(fork)


def terminate(process: subprocess.Popen[bytes], stop_signal: int, timeout: float) -> None:
    """Send `stop_signal`, wait up to `timeout`, then SIGKILL the child's process group.

    Returns once the child is reaped. Popen.send_signal checks for a reaped child first,
    so a recycled pid is never signalled.
    """
    process.send_signal(stop_signal)
    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        _kill_group(process)
        process.wait()


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    # Unreaped, so the pid (and the group it leads) cannot have been recycled.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def exit_status(returncode: int) -> int:
    """A shell-style status: 128+N for a child killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def describe_exit(returncode: int) -> str:
    """`code 3` or `signal SIGKILL`, for one-line log messages."""
    if returncode >= 0:
        return f"code {returncode}"
    try:
        return f"signal {signal.Signals(-returncode).name}"
    except ValueError:
        return f"signal {-returncode}"


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead child comes back, and when it is given up on.

    The first restart waits `first_backoff_s`, each further one twice as long, up to
    `max_backoff_s`; a child that ran `stable_after_s` before dying starts over at the
    first backoff. More than `crash_loop_exits` exits within `crash_loop_window_s` is a
    crash loop: restarting it again would only hide the fault.
    """

    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    crash_loop_exits: int = 5
    crash_loop_window_s: float = 60.0


@dataclass
class Backoff:
    """The restart schedule of one child under a RestartPolicy; time is passed in."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    _next_s: float | None = field(default=None, init=False)
    _exits: deque[float] = field(default_factory=deque, init=False)

    def on_exit(self, now: float, started_at: float) -> float | None:
        """The delay before restarting a child that started at `started_at` and died at
        `now`, or None when it is crash-looping."""
        policy = self.policy
        if self._next_s is None or now - started_at >= policy.stable_after_s:
            self._next_s = policy.first_backoff_s
        self._exits.append(now)
        while self._exits and self._exits[0] < now - policy.crash_loop_window_s:
            self._exits.popleft()
        if len(self._exits) > policy.crash_loop_exits:
            return None
        delay = self._next_s
        self._next_s = min(delay * 2, policy.max_backoff_s)
        return delay

    @property
    def recent_exits(self) -> int:
        return len(self._exits)


@dataclass(frozen=True)
class ProcessSpec:
    """One child. `restart=False`: its exit ends the whole unit (wait() returns its status)."""

    name: str
    argv: Sequence[str]
    restart: bool = True
    # Laid over the supervisor's env for this child only (e.g. its own credentials).
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen[bytes]
    log_file: IO[bytes] | None
    pump: threading.Thread | None
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Starts every spec as a child process and keeps them up as one unit.

    `env` is laid over this process's environment (PYTHONUNBUFFERED=1 is added unless set,
    so prefixed output arrives line by line). Output goes to `<log_dir>/<name>.log`, or,
    without a log_dir, to `output` (default: sys.stdout) with a "[name] " prefix per line.

    From start() until stop(), a watcher thread restarts children that die (see the module
    docstring), whether or not anyone is in wait().
    """

    def __init__(
        self,
        specs: Sequence[ProcessSpec],
        env: Mapping[str, str],
        log_dir: Path | None = None,
        *,
        output: TextIO | None = None,
        policy: RestartPolicy | None = None,
    ) -> None:
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"process names must be unique: {names}")
        self._specs = {spec.name: spec for spec in specs}
        self._env = {**os.environ, **env}
        self._env.setdefault("PYTHONUNBUFFERED", "1")
        self._log_dir = log_dir
        self._output = output if output is not None else sys.stdout
        self._output_lock = threading.Lock()
        self.policy = policy if policy is not None else RestartPolicy()
        self._lock = threading.RLock()
        self._children: dict[str, _Child] = {}
        # Names being restarted by restart(): their exit is expected, the watcher skips them.
        self._restarting: set[str] = set()
        # Names whose next exit was caused by kill(): restarted, but not a crash.
        self._killed: set[str] = set()
        # Dead children waiting out their backoff: name -> monotonic time of the restart.
        self._due: dict[str, float] = {}
        self._backoff: dict[str, Backoff] = {}
        self._restarts: dict[str, int] = dict.fromkeys(names, 0)
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._stop_requested = threading.Event()
        self._force = threading.Event()
        # Set once the unit is over without a stop request: (wait()'s status, why).
        self._outcome: tuple[int, str] | None = None

    # -- queries -------------------------------------------------------------------

    @property
    def pids(self) -> dict[str, int]:
        """The current (or, while it waits to be restarted, the last) pid of each child."""
        with self._lock:
            return {name: child.process.pid for name, child in self._children.items()}

    def pid(self, name: str) -> int:
        return self._child(name).process.pid

    def returncode(self, name: str) -> int | None:
        """None while the child runs."""
        return self._child(name).process.poll()

    def restarts(self, name: str) -> int:
        """How many times the watcher restarted `name` after it died (restart() not counted)."""
        with self._lock:
            if name not in self._restarts:
                raise KeyError(f"no process named {name!r}")
            return self._restarts[name]

    def log_of(self, name: str) -> str:
        """Where `name`'s output goes, in words fit for an error message."""
        if self._log_dir is not None:
            return str(self._log_dir / f"{name}.log")
        return f"the output above, prefixed [{name}]"

    @property
    def failure(self) -> str | None:
        """Why the unit ended by itself (a crash loop, a one-shot child's exit), if it did."""
        outcome = self._outcome
        return None if outcome is None else outcome[1]

    # -- control -------------------------------------------------------------------

    def start(self) -> None:
        """Start every child that is not running yet; on a failure, stop those started."""
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        try:
            for spec in self._specs.values():
                with self._lock:
                    if spec.name not in self._children:
                        self._children[spec.name] = self._launch(spec)
        except BaseException:
            self.stop()
            raise
        with self._lock:
            if self._watcher is None:
                self._closing.clear()
                self._watcher = threading.Thread(
                    target=self._watch, name="supervisor-watcher", daemon=True
                )
                self._watcher.start()

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM, or until the unit ends by itself; then stop all.

        Returns 0 after a signal; 1 after giving up on a crash loop; the status of a
        `restart=False` child that exited (128+N if it was killed by signal N). A second
        signal while stopping SIGKILLs the stragglers. Handlers are installed only when
        called from the main thread.
        """
        if not self._children and self._outcome is None:
            raise RuntimeError("Supervisor.wait() before start()")
        self._stop_requested.clear()
        with self._signal_handlers():
            while not self._stop_requested.wait(_POLL_S):
                if self._outcome is not None:
                    break
            outcome = self._outcome
            if outcome is None:
                logger.info("stop requested; stopping %d processes", len(self._children))
            self.stop()
            return 0 if outcome is None else outcome[0]

    def abort(self, reason: str, status: int = 1) -> None:
        """End the unit from outside (e.g. a server it depends on is crash-looping): stop
        every child; wait() returns `status`."""
        logger.error("%s; stopping everything", reason)
        self._end(status, reason)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child, SIGKILL those still alive after `timeout`. Idempotent."""
        self._closing.set()
        with self._lock:
            watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
        self._stop_children(timeout)

    def restart(self, name: str, timeout: float = 10.0) -> int:
        """Stop one child (SIGTERM, SIGKILL after `timeout`) and start it again; the new pid."""
        with self._lock:
            old = self._child(name)
            self._restarting.add(name)
        try:
            terminate(old.process, signal.SIGTERM, timeout)
            self._release(old)
            with self._lock:
                if name not in self._children:
                    raise RuntimeError(f"supervisor stopped while restarting {name!r}")
                new = self._launch(old.spec)
                self._children[name] = new
                self._due.pop(name, None)
                self._killed.discard(name)
            return new.process.pid
        finally:
            with self._lock:
                self._restarting.discard(name)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one child (fault injection); if it dies, the watcher restarts it
        after the first backoff. An exit we caused is no crash: it never counts toward a
        crash loop, so tests may kill a child as often as they like."""
        with self._lock:
            child = self._child(name)
            self._killed.add(name)
            child.process.send_signal(sig)

    # -- internals -----------------------------------------------------------------

    def _child(self, name: str) -> _Child:
        with self._lock:
            try:
                return self._children[name]
            except KeyError:
                raise KeyError(f"no running process named {name!r}") from None

    def _stop_children(self, timeout: float) -> None:
        with self._lock:
            children = list(self._children.values())
            self._children.clear()
            self._due.clear()
        for child in children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while (
            any(child.process.poll() is None for child in children)
            and time.monotonic() < deadline
            and not self._force.is_set()
        ):
            time.sleep(_POLL_S)
        for child in children:
            if child.process.poll() is None:
                logger.warning(
                    "process %r (pid %d) ignored SIGTERM; killing it",
                    child.spec.name,
                    child.process.pid,
                )
            _kill_group(child.process)
            child.process.wait()
        for child in children:
            self._release(child)

    def _end(self, status: int, reason: str) -> None:
        if self._outcome is None:
            self._outcome = (status, reason)
        self._closing.set()
        self._stop_children(timeout=10.0)

    def _watch(self) -> None:
        while not self._closing.wait(_POLL_S):
            try:
                ended = self._check_children(time.monotonic())
            except Exception:
                # The watcher must outlive any one failure, or nothing would be restarted.
                logger.exception("supervisor: checking the processes failed; retrying")
                continue
            if ended is not None:
                self._end(*ended)
                return

    def _check_children(self, now: float) -> tuple[int, str] | None:
        """Restart what is due, schedule what died; (status, why) when the unit must end."""
        with self._lock:
            if self._closing.is_set():
                return None
            for name, child in list(self._children.items()):
                if name in self._restarting:
                    continue
                due = self._due.get(name)
                if due is not None:
                    if now >= due:
                        self._relaunch(name, child, now)
                    continue
                returncode = child.process.poll()
                if returncode is None:
                    continue
                if not child.spec.restart:
                    logger.error(
                        "process %r (pid %d) exited with %s; stopping the others",
                        name,
                        child.process.pid,
                        describe_exit(returncode),
                    )
                    return exit_status(returncode), f"process {name!r} exited"
                backoff = self._backoff.setdefault(name, Backoff(self.policy))
                if name in self._killed:
                    self._killed.discard(name)
                    delay: float | None = self.policy.first_backoff_s
                else:
                    delay = backoff.on_exit(now, child.started_at)
                if delay is None:
                    reason = (
                        f"process {name!r} is crash-looping ({backoff.recent_exits} exits "
                        f"within {self.policy.crash_loop_window_s:.0f}s, the last with "
                        f"{describe_exit(returncode)}); giving up on it. Its log: "
                        f"{self.log_of(name)}"
                    )
                    logger.error("%s; stopping everything", reason)
                    return 1, reason
                logger.warning(
                    "process %r (pid %d) exited with %s; restarting it in %.1fs (restart %d)",
                    name,
                    child.process.pid,
                    describe_exit(returncode),
                    delay,
                    self._restarts[name] + 1,
                )
                self._due[name] = now + delay
        return None

    def _relaunch(self, name: str, old: _Child, now: float) -> None:
        self._release(old)
        try:
            new = self._launch(old.spec)
        except OSError as error:
            backoff = self._backoff.setdefault(name, Backoff(self.policy))
            delay = backoff.on_exit(now, now)
            retry_s = self.policy.max_backoff_s if delay is None else delay
            logger.error(
                "process %r could not be started (%s); retrying in %.1fs", name, error, retry_s
            )
            self._due[name] = now + retry_s
            return
        self._children[name] = new
        self._due.pop(name, None)
        self._restarts[name] += 1

    def _env_of(self, spec: ProcessSpec) -> dict[str, str]:
        return {**self._env, **spec.env}

    def _launch(self, spec: ProcessSpec) -> _Child:
        if self._log_dir is not None:
            log_file = (self._log_dir / f"{spec.name}.log").open("ab")
            try:
                process = spawn_bound_child(
                    spec.argv,
                    env={**self._env, **spec.env},
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                )
            except BaseException:
                log_file.close()
                raise
            return _Child(spec, process, log_file, None)
        process = spawn_bound_child(
            spec.argv,
            env={**self._env, **spec.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert process.stdout is not None
        pump = threading.Thread(
            target=self._pump,
            args=(spec.name, process.stdout),
            name=f"supervisor-output-{spec.name}",
            daemon=True,
        )
        pump.start()
        return _Child(spec, process, None, pump)

    def _pump(self, name: str, stream: IO[bytes]) -> None:
        with stream:
            for raw in iter(stream.readline, b""):
                line = raw.decode(errors="replace").rstrip("\r\n")
                with self._output_lock:
                    try:
                        self._output.write(f"[{name}] {line}\n")
                        self._output.flush()
                    except ValueError:  # the output was closed under us
                        return

    def _release(self, child: _Child) -> None:
        if child.pump is not None:
            # A grandchild may still hold the pipe open; do not hang on it.
            child.pump.join(timeout=1.0)
        if child.log_file is not None:
            child.log_file.close()

    @contextlib.contextmanager
    def _signal_handlers(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame: FrameType | None) -> None:
            if self._stop_requested.is_set():
                self._force.set()
            self._stop_requested.set()

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        self._force.clear()
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._force.clear()
