"""The process supervisor behind `gpusched up`, driven with throwaway child programs."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gpusched.infra.supervisor import Backoff, ProcessSpec, RestartPolicy, Supervisor

REPO = Path(__file__).resolve().parents[2]

SLEEPER = [sys.executable, "-c", "import time\nwhile True: time.sleep(0.1)"]
STUBBORN = [
    sys.executable,
    "-c",
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ignoring SIGTERM', flush=True)\n"
    "while True: time.sleep(0.1)",
]


def exits_with(code: int, after_s: float = 0.3) -> list[str]:
    return [sys.executable, "-c", f"import time; time.sleep({after_s}); raise SystemExit({code})"]


def process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (exited, not yet reaped by init) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def make_supervisor() -> Iterator[Callable[..., Supervisor]]:
    made: list[Supervisor] = []

    def make(specs: list[ProcessSpec], **kwargs: object) -> Supervisor:
        supervisor = Supervisor(specs, env={}, **kwargs)  # type: ignore[arg-type]
        made.append(supervisor)
        return supervisor

    yield make
    for supervisor in made:
        supervisor.stop(timeout=1)


# Runs a script under a subreaper that reaps every orphan and exits once none is left, so
# "every child died" is observable as the reaper's exit and leaves no zombie behind (this
# machine's init may not reap). It exits with the script's shell-style status.
REAPER = """
import ctypes, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
script = subprocess.Popen([sys.executable, "-c", sys.argv[1]]).pid
status = 0
while True:
    try:
        pid, raw = os.wait()
    except ChildProcessError:
        break
    if pid == script:
        code = os.waitstatus_to_exitcode(raw)
        status = 128 - code if code < 0 else code
sys.exit(status)
"""

SUPERVISOR_SCRIPT = textwrap.dedent(
    f"""
    import json, os, sys
    from gpusched.infra.supervisor import ProcessSpec, Supervisor

    sleeper = {SLEEPER!r}
    supervisor = Supervisor([ProcessSpec("a", sleeper), ProcessSpec("b", sleeper)], env={{}})
    supervisor.start()
    print(json.dumps([os.getpid(), *supervisor.pids.values()]), flush=True)
    sys.exit(supervisor.wait())
    """
)


def wait_until_caught(pid: int, sig: int, timeout: float = 10.0) -> None:
    """Until process `pid` has a handler for `sig` (its SigCgt mask in /proc)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:")).split()[1]
        if int(caught, 16) >> (sig - 1) & 1:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} installed no handler for signal {sig} in {timeout}s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signalling_or_killing_the_supervisor_leaves_no_child_alive(sig: int) -> None:
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER, SUPERVISOR_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    # The supervisor first: a failed run must not leave it alive, restarting children.
    started: list[int] = []
    children: list[int] = []
    try:
        assert reaper.stdout is not None
        started = json.loads(reaper.stdout.readline())
        supervisor, *children = started
        assert len(children) == 2 and all(map(process_alive, children))
        # wait() installs the handlers of SIGINT and SIGTERM together, SIGTERM last. A
        # fixed sleep for it once lost the race under load: SIGINT came first and, being
        # ignored in a background job's process, was dropped, and nothing stopped.
        wait_until_caught(supervisor, signal.SIGTERM)

        os.kill(supervisor, sig)

        # The reaper exits only once the supervisor and every child are gone.
        assert reaper.wait(timeout=20) == (128 + sig if sig == signal.SIGKILL else 0)
        assert not any(map(process_alive, children))
    finally:
        for pid in filter(process_alive, started):
            os.kill(pid, signal.SIGKILL)
        reaper.kill()
        reaper.wait()


def test_a_one_shot_child_exiting_stops_the_others_and_wait_returns_its_code(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor(
        [ProcessSpec("steady", SLEEPER), ProcessSpec("crashing", exits_with(3), restart=False)]
    )
    supervisor.start()
    steady = supervisor.pid("steady")

    assert supervisor.wait() == 3

    assert not process_alive(steady)
    assert supervisor.pids == {}


def test_a_one_shot_child_killed_by_a_signal_makes_wait_return_128_plus_the_signal(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor(
        [ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER, restart=False)]
    )
    supervisor.start()
    supervisor.kill("b", signal.SIGKILL)

    assert supervisor.wait() == 128 + signal.SIGKILL


def test_restart_replaces_the_child_with_a_new_process(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER)])
    supervisor.start()
    old, other = supervisor.pid("a"), supervisor.pid("b")

    new = supervisor.restart("a")

    assert new == supervisor.pid("a") != old
    assert not process_alive(old)
    assert process_alive(new)
    assert supervisor.pid("b") == other and process_alive(other)


def test_stop_kills_a_child_that_ignores_sigterm_and_is_idempotent(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    output = io.StringIO()
    supervisor = make_supervisor(
        [ProcessSpec("stubborn", STUBBORN), ProcessSpec("polite", SLEEPER)], output=output
    )
    supervisor.start()
    pids = list(supervisor.pids.values())
    assert eventually(lambda: "[stubborn] ignoring SIGTERM\n" in output.getvalue())

    started = time.monotonic()
    supervisor.stop(timeout=0.5)
    supervisor.stop(timeout=0.5)

    assert time.monotonic() - started < 5
    assert not any(map(process_alive, pids))


def test_output_goes_to_one_log_file_per_process_when_a_log_dir_is_given(
    make_supervisor: Callable[..., Supervisor], tmp_path: Path
) -> None:
    talker = [sys.executable, "-c", "import sys; print('to out'); print('to err', file=sys.stderr)"]
    supervisor = make_supervisor(
        [ProcessSpec("talker", talker, restart=False)], log_dir=tmp_path / "logs"
    )
    supervisor.start()

    assert supervisor.wait() == 0

    assert sorted((tmp_path / "logs" / "talker.log").read_text().splitlines()) == [
        "to err",
        "to out",
    ]


def test_children_get_the_given_environment_on_top_of_ours(tmp_path: Path) -> None:
    output = io.StringIO()
    show = [sys.executable, "-c", "import os; print(os.environ['GREETING'], 'PATH' in os.environ)"]
    supervisor = Supervisor(
        [ProcessSpec("env", show, restart=False)], env={"GREETING": "hi"}, output=output
    )
    supervisor.start()

    assert supervisor.wait() == 0
    assert output.getvalue() == "[env] hi True\n"


FAST = RestartPolicy(
    first_backoff_s=0.2, max_backoff_s=1.0, stable_after_s=5.0, crash_loop_exits=3,
    crash_loop_window_s=30.0,
)  # fmt: skip


def test_a_killed_child_is_restarted_and_the_others_keep_running(
    make_supervisor: Callable[..., Supervisor], caplog: pytest.LogCaptureFixture
) -> None:
    supervisor = make_supervisor(
        [ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER)], policy=FAST
    )
    supervisor.start()
    first, other = supervisor.pid("a"), supervisor.pid("b")

    with caplog.at_level("WARNING", logger="gpusched.infra.supervisor"):
        supervisor.kill("a")
        assert eventually(lambda: supervisor.restarts("a") == 1)

    second = supervisor.pid("a")
    assert second != first and process_alive(second)
    assert supervisor.pid("b") == other and process_alive(other)
    assert supervisor.restarts("b") == 0
    restart_lines = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert restart_lines == [
        f"process 'a' (pid {first}) exited with signal SIGKILL; restarting it in 0.2s (restart 1)"
    ]


def test_restarts_back_off_doubling_up_to_the_longest_wait() -> None:
    backoff = Backoff(RestartPolicy(first_backoff_s=0.5, max_backoff_s=4.0, crash_loop_exits=100))
    delays = [backoff.on_exit(now=float(t), started_at=float(t)) for t in range(7)]

    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0]


def test_a_child_that_ran_stably_starts_over_at_the_first_backoff() -> None:
    backoff = Backoff(RestartPolicy(first_backoff_s=0.5, stable_after_s=60.0))
    assert backoff.on_exit(now=1.0, started_at=0.0) == 0.5
    assert backoff.on_exit(now=3.0, started_at=2.0) == 1.0

    assert backoff.on_exit(now=100.0, started_at=10.0) == 0.5


def test_more_exits_than_allowed_within_the_window_is_a_crash_loop() -> None:
    backoff = Backoff(RestartPolicy(crash_loop_exits=5, crash_loop_window_s=60.0))
    delays = [backoff.on_exit(now=float(t), started_at=float(t)) for t in range(6)]

    assert None not in delays[:5] and delays[5] is None
    # Exits spread out beyond the window are no loop.
    spread = Backoff(RestartPolicy(crash_loop_exits=5, crash_loop_window_s=60.0))
    assert None not in [spread.on_exit(now=t * 20.0, started_at=t * 20.0) for t in range(10)]


def test_the_restart_waits_out_the_backoff(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    policy = RestartPolicy(first_backoff_s=1.5, crash_loop_exits=10)
    supervisor = make_supervisor([ProcessSpec("a", SLEEPER)], policy=policy)
    supervisor.start()
    supervisor.kill("a")
    killed = time.monotonic()

    assert eventually(lambda: supervisor.restarts("a") == 1)

    assert time.monotonic() - killed >= 1.4


def test_a_crash_looping_child_is_given_up_on_loudly_and_everything_stops(
    make_supervisor: Callable[..., Supervisor],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    supervisor = make_supervisor(
        [ProcessSpec("steady", SLEEPER), ProcessSpec("broken", exits_with(1, after_s=0.05))],
        log_dir=tmp_path / "logs",
        policy=FAST,
    )
    supervisor.start()
    steady = supervisor.pid("steady")

    started = time.monotonic()
    with caplog.at_level("ERROR", logger="gpusched.infra.supervisor"):
        assert supervisor.wait() == 1

    assert time.monotonic() - started < 20
    assert supervisor.restarts("broken") == FAST.crash_loop_exits
    assert not process_alive(steady)
    assert supervisor.pids == {}
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1, errors
    assert "'broken' is crash-looping" in errors[0]
    assert str(tmp_path / "logs" / "broken.log") in errors[0]
    assert supervisor.failure is not None and "'broken'" in supervisor.failure


def test_a_clean_stop_stops_every_child_and_restarts_none(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER)])
    supervisor.start()
    pids = list(supervisor.pids.values())

    supervisor.stop()
    time.sleep(1.0)  # longer than the first backoff: a restart would have happened

    assert not any(map(process_alive, pids))
    assert supervisor.pids == {}
    assert supervisor.restarts("a") == supervisor.restarts("b") == 0


def test_kills_on_request_are_restarted_but_never_count_as_a_crash_loop(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor([ProcessSpec("a", SLEEPER)], policy=FAST)
    supervisor.start()

    for round_ in range(1, FAST.crash_loop_exits + 3):
        supervisor.kill("a")
        assert eventually(lambda n=round_: supervisor.restarts("a") == n)

    assert supervisor.failure is None
    assert process_alive(supervisor.pid("a"))
