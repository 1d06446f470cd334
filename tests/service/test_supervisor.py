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

from gpusched.infra.supervisor import ProcessSpec, Supervisor

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


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_signalling_or_killing_the_supervisor_leaves_no_child_alive(sig: int) -> None:
    reaper = subprocess.Popen(
        [sys.executable, "-c", REAPER, SUPERVISOR_SCRIPT],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    children: list[int] = []
    try:
        assert reaper.stdout is not None
        supervisor, *children = json.loads(reaper.stdout.readline())
        assert len(children) == 2 and all(map(process_alive, children))
        time.sleep(0.2)  # let wait() install its signal handlers

        os.kill(supervisor, sig)

        # The reaper exits only once the supervisor and every child are gone.
        assert reaper.wait(timeout=20) == (128 + sig if sig == signal.SIGKILL else 0)
        assert not any(map(process_alive, children))
    finally:
        for pid in filter(process_alive, children):
            os.kill(pid, signal.SIGKILL)
        reaper.kill()
        reaper.wait()


def test_a_child_exiting_by_itself_stops_the_others_and_wait_returns_its_code(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor(
        [ProcessSpec("steady", SLEEPER), ProcessSpec("crashing", exits_with(3))]
    )
    supervisor.start()
    steady = supervisor.pid("steady")

    assert supervisor.wait() == 3

    assert not process_alive(steady)
    assert supervisor.pids == {}


def test_a_child_killed_by_a_signal_makes_wait_return_128_plus_the_signal(
    make_supervisor: Callable[..., Supervisor],
) -> None:
    supervisor = make_supervisor([ProcessSpec("a", SLEEPER), ProcessSpec("b", SLEEPER)])
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
    supervisor = make_supervisor([ProcessSpec("talker", talker)], log_dir=tmp_path / "logs")
    supervisor.start()

    assert supervisor.wait() == 0

    assert sorted((tmp_path / "logs" / "talker.log").read_text().splitlines()) == [
        "to err",
        "to out",
    ]


def test_children_get_the_given_environment_on_top_of_ours(tmp_path: Path) -> None:
    output = io.StringIO()
    show = [sys.executable, "-c", "import os; print(os.environ['GREETING'], 'PATH' in os.environ)"]
    supervisor = Supervisor([ProcessSpec("env", show)], env={"GREETING": "hi"}, output=output)
    supervisor.start()

    assert supervisor.wait() == 0
    assert output.getvalue() == "[env] hi True\n"
