"""The CLI without a stack: fast help, one-line errors naming the option, fast failure
when nothing answers, and the pure pieces (filters, durations, GPU ranges)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import yaml

from gpusched.cli import audit, choices, output
from gpusched.cli.errors import BadInput

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    return subprocess.run(
        [sys.executable, "-m", "gpusched.cli.main", *args],
        cwd=REPO, env={**base, **(env or {})}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip


def test_help_imports_no_database_bus_or_contract_module() -> None:
    probe = (
        "import sys; from gpusched.cli.main import main; main(['--help']); "
        "print('\\nLOADED', [m for m in ('sqlalchemy', 'alembic', 'asyncpg', 'nats', "
        "'pydantic', 'gpusched.contracts.messages', 'rich', 'yaml') if m in sys.modules])"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "LOADED []"
    # The help says how the stack is found.
    assert "GPUSCHED_DATA_DIR" in result.stdout and "stack file" in result.stdout


def test_every_command_has_help() -> None:
    for command in ("submit", "get", "why", "list", "cancel", "audit", "bill", "node", "up"):
        result = _cli(command, "--help")
        assert result.returncode == 0, (command, result.stderr)
        assert "-h, --help" in result.stdout


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["--gpus", "-1"], "gpusched: invalid gpus.count (--gpus): Input should be greater than"),
        (["--gpus", "0"], "gpusched: invalid host (--cpu-milli, --host-memory-mib): a job without"),
        (
            ["--gpus", "0", "--model", "V100"],
            "gpusched: invalid gpus: a job without GPUs (count 0) asks no model",
        ),
        (["--gpus", "1", "--models", "A|"], "gpusched: invalid gpus.models.1 (--models): "),
        (["--gpus", "1", "--cpu-milli", "-5"], "gpusched: invalid host.cpu_milli (--cpu-milli)"),
        (["--gpus", "1", "--milli", "2000"], "gpusched: invalid gpus.milli (--milli): Input"),
        (["--gpus", "1", "--team", "a b"], "gpusched: invalid team (--team): team 'a b' cannot"),
        (["--gpus", "1", "--replicas", "5:2"], "gpusched: invalid replicas '5:2' (--replicas)"),
        (["--gpus", "1", "--replicas", "x"], "gpusched: invalid replicas 'x' (--replicas): use"),
        (["--gpus", "1", "--name", "a\x01b"], "gpusched: invalid name (--name): control char"),
    ],
)
def test_a_bad_submit_value_is_one_line_naming_the_option_and_exit_2(
    args: list[str], line: str
) -> None:
    base = ["submit", "--name", "x", "--team", "vision"]
    result = _cli(*base, *args)
    assert result.returncode == 2
    [only] = result.stderr.splitlines()
    assert only.startswith(line), only
    assert "Traceback" not in result.stderr and "errors.pydantic.dev" not in result.stderr


def test_a_job_file_is_read_and_the_command_line_wins(tmp_path: Path) -> None:
    from gpusched.cli.jobs import _job_file, _put, _submit_request

    job = tmp_path / "job.yaml"
    job.write_text("name: from-file\nteam: vision\ngpus: {count: 2}\nworkload: {steps: 10}\n")
    document = _job_file(job)
    _put(document, "gpus.count", 4)
    _put(document, "workload.argv", ["python", "train.py"])
    request = _submit_request(document)
    assert (request.name, request.gpus.count, request.workload.steps) == ("from-file", 4, 10)
    assert request.workload.argv == ["python", "train.py"]
    (tmp_path / "bad.json").write_text('{"name": "x", "team": "v", "gpus": {"count": -1}}')
    with pytest.raises(BadInput, match=r"invalid gpus\.count \(--gpus\)"):
        _submit_request(_job_file(tmp_path / "bad.json"))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(BadInput, match="must hold one job"):
        _job_file(tmp_path / "list.yaml")


def test_a_job_file_that_is_a_device_binary_or_missing_is_one_line(tmp_path: Path) -> None:
    from gpusched.cli.jobs import _job_file

    with pytest.raises(BadInput, match="the job file: /dev/zero is not a regular file"):
        _job_file(Path("/dev/zero"))  # it would be read forever
    (tmp_path / "job.yaml").write_bytes(b"name: \xff\xfe")
    with pytest.raises(BadInput, match="is not UTF-8 text"):
        _job_file(tmp_path / "job.yaml")
    with pytest.raises(BadInput, match=r"cannot read the job file .*No such file"):
        _job_file(tmp_path / "none.yaml")


def test_a_submit_with_a_missing_job_file_says_so_in_one_line(tmp_path: Path) -> None:
    result = _cli("submit", "-f", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith(f"gpusched: cannot read the job file {tmp_path / 'nope.yaml'}")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(60)
def test_an_unreachable_stack_is_one_line_with_what_to_check_and_exit_3() -> None:
    # The case: a URL where no NATS listens. It failed after 135 s with 61
    # tracebacks; the subprocess timeout (60 s) is the hang guard here.
    url = f"nats://127.0.0.1:{_closed_port()}"
    for command in (["get", "job-1"], ["list"], ["audit"], ["bill", "--team", "x"]):
        result = _cli(*command, env={"GPUSCHED_NATS_URL": url})
        assert result.returncode == 3, (command, result.stderr)
        [line] = result.stderr.splitlines()
        assert line == (
            f"gpusched: cannot reach NATS at {url} (connection refused). Is the stack up? "
            "Start it with `gpusched up`, or set GPUSCHED_NATS_URL."
        )
    debug = _cli("--debug", "get", "job-1", env={"GPUSCHED_NATS_URL": url})
    assert debug.returncode == 3 and "Traceback (most recent call last)" in debug.stderr


def test_no_stack_known_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _cli("list", env={"GPUSCHED_DATA_DIR": str(tmp_path)})
    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("gpusched: no stack found") and "gpusched up" in line


def test_an_unexpected_error_is_one_line_unless_debug_is_asked_for(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gpusched.cli import jobs
    from gpusched.cli import main as cli

    def broken(go: object, **_: object) -> int:
        raise ValueError("the disk is full\nsecond line")

    monkeypatch.setattr(jobs, "with_api", broken)
    monkeypatch.delenv("GPUSCHED_DEBUG", raising=False)

    assert cli.main(["get", "job-1"]) == 1
    assert capsys.readouterr().err.splitlines() == [
        "gpusched: unexpected error: ValueError: the disk is full "
        "(run with --debug or GPUSCHED_DEBUG=1 for the traceback)"
    ]
    assert cli.main(["--debug", "get", "job-1"]) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_the_command_line_vocabularies_are_the_contracts() -> None:
    from gpusched.admission.queue import JobState
    from gpusched.cli.stack import SERVICES
    from gpusched.contracts.messages import JobKind, JobStateName, PriorityClassName
    from gpusched.contracts.permissions import SERVICE_NAMES

    assert [c.value for c in choices.Priority] == [c.value for c in PriorityClassName]
    assert [c.value for c in choices.Kind] == [c.value for c in JobKind]
    assert [c.value for c in choices.State] == [c.value for c in JobStateName]
    assert [c.value for c in JobStateName] == [c.value for c in JobState]
    assert SERVICE_NAMES == SERVICES


def test_shell_completion_offers_the_commands() -> None:
    result = _cli(env={"_GPUSCHED_COMPLETE": "complete_bash", "COMP_WORDS": "gpusched li",
                       "COMP_CWORD": "1"})  # fmt: skip
    assert "list" in result.stdout.split()


# --- audit filters ------------------------------------------------------------------------


def test_since_takes_durations_iso_times_and_all() -> None:
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    assert audit.since_time("30m", now) == now - timedelta(minutes=30)
    assert audit.since_time("2h", now) == now - timedelta(hours=2)
    assert audit.since_time("7d", now) == now - timedelta(days=7)
    assert audit.since_time("2026-05-01T10:00:00Z", now) == now - timedelta(hours=2)
    assert audit.since_time("all", now) is None
    for bad in ("yesterday", "-5m", "5 parsecs", ""):
        with pytest.raises(BadInput, match="--since"):
            audit.since_time(bad, now)


def test_since_before_any_record_is_all_and_in_the_future_is_refused() -> None:
    now = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)
    # Older than 1970 (no record is): every record, not an overflow.
    assert audit.since_time("99999999999d", now) is None
    assert audit.since_time("0001-01-01", now) is None
    assert audit.since_time("1969-12-31T23:00:00Z", now) is None
    # A little ahead of this clock is clock skew, taken as given.
    assert audit.since_time("2026-05-01T12:04:00Z", now) == now + timedelta(minutes=4)
    for future in ("2026-05-01T12:06:00Z", "9999-12-31T23:59:59Z"):
        with pytest.raises(BadInput, match="is in the future: give a past time"):
            audit.since_time(future, now)


def test_audit_filters_match_action_prefixes_jobs_and_teams() -> None:
    expand = {"action": "preempt.expand", "entity": "decision-1", "details": {"job_id": "job-a"}}
    refused = {
        "action": "access.forbidden",
        "entity": "job-b",
        "details": {"caller": "team:vision"},
    }
    assert audit.matches(expand, "preempt", None, None)
    assert audit.matches(expand, "preempt.expand", "job-a", None)
    assert not audit.matches(expand, "pre", None, None)  # whole words only
    assert not audit.matches(expand, None, "job-b", None)
    assert audit.matches(refused, None, "job-b", "vision")
    assert not audit.matches(refused, None, None, "nlp")
    assert not audit.matches({"action": "x", "details": "not a mapping"}, None, "job-a", None)


def test_json_audit_output_is_one_record_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    class Msg:
        data = json.dumps(
            {
                "id": "m1",
                "time": "2026-05-01T12:00:00+00:00",
                "data": {"action": "job.parked", "actor": "admission", "entity": "job-a",
                         "reason": "r", "details": {}},
            }
        ).encode()  # fmt: skip

    audit._print(Msg(), None, None, None, output.Format.JSON)  # type: ignore[arg-type]
    audit._print(Msg(), "preempt", None, None, output.Format.JSON)  # type: ignore[arg-type]
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line)["action"] == "job.parked"

    audit._print(Msg(), None, None, None, output.Format.YAML)  # type: ignore[arg-type]
    audit._print(Msg(), None, None, None, output.Format.YAML)  # type: ignore[arg-type]
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["action"] for d in documents] == ["job.parked", "job.parked"]
    assert documents[0]["id"] == "m1"


# --- output -------------------------------------------------------------------------------


def test_gpus_are_shown_per_node_as_ranges() -> None:
    refs = [("shared-02", i) for i in range(8)] + [("shared-01", i) for i in (0, 1, 2, 5)]
    assert output.gpus_by_node(refs) == ["shared-01: 4 GPUs (0-2,5)", "shared-02: 8 GPUs (0-7)"]
    assert output.ranges([]) == ""
    assert output.size(1_500_000_000) == "1.5 GB" and output.size(42) == "42 B"


@pytest.mark.parametrize("service", [False, True])
def test_a_list_setting_that_is_not_json_is_one_line_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, service: bool
) -> None:
    from gpusched.cli.errors import NotConfigured
    from gpusched.cli.session import load_settings

    monkeypatch.setenv("GPUSCHED_CHECKPOINT__VERIFY_SCHEMES", "file,s3")
    # A plain value beside it (not JSON either, and needing none) is not named.
    monkeypatch.setenv("GPUSCHED_CHECKPOINT__VERIFY_URIS", "yes")

    with pytest.raises(NotConfigured) as refused:
        load_settings(service=service)

    message = str(refused.value)
    assert message.startswith(
        "GPUSCHED_CHECKPOINT__VERIFY_SCHEMES: not JSON, which a list or mapping setting takes"
    )
    assert "VERIFY_URIS" not in message and "\n" not in message
    monkeypatch.setenv("GPUSCHED_CHECKPOINT__VERIFY_SCHEMES", '["file", "s3"]')
    monkeypatch.delenv("GPUSCHED_CHECKPOINT__VERIFY_URIS")
    assert load_settings(service=service).checkpoint.verify_schemes == ["file", "s3"]


@pytest.mark.parametrize("value", ["nan", "-5", "inf"])
def test_a_readiness_wait_that_is_no_usable_number_of_seconds_starts_nothing(
    tmp_path: Path, value: str
) -> None:
    done = _cli("up", "--ready-timeout", value, env={"GPUSCHED_DATA_DIR": str(tmp_path)})

    assert done.returncode == 2
    assert "Invalid value for '--ready-timeout'" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []  # no server was started, no stack file written


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["replay", "--compression", "nan"], "'--compression': nan is not a finite number"),
        (["replay", "--load", "inf"], "'--load': inf is not a finite number"),
        (["replay", "--load", "-0.5"], "'--load': -0.5 is below the least allowed, 0.01"),
        (["replay", "--node-share", "2"], "'--node-share': 2 is above the most allowed, 1"),
        (["replay", "--compression", "fast"], "'--compression': 'fast' is not a number"),
        (["auth", "issue", "--team", "x", "--ttl", "inf"], "'--ttl': inf is not a finite number"),
        (["up", "--ready-timeout", "NaN"], "'--ready-timeout': NaN is not a finite number"),
    ],
)
def test_a_number_option_says_what_is_wrong_with_nan_infinity_and_out_of_range(
    tmp_path: Path, args: list[str], says: str
) -> None:
    # Typer's own bounds check once told `nan` it "should be less than or equal to 1000000".
    done = _cli(*args, env={"GPUSCHED_DATA_DIR": str(tmp_path)})

    assert done.returncode == 2
    assert says in done.stderr
    assert "Traceback" not in done.stderr


def test_the_kubernetes_agent_without_its_extra_is_one_line_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import importlib.util

    from gpusched.cli.main import main

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "kubernetes_asyncio" else found(name, *a),
    )
    monkeypatch.setenv("GPUSCHED_NATS_URL", "nats://127.0.0.1:1")
    monkeypatch.setenv("GPUSCHED_DATABASE_URL", "postgresql+asyncpg://x@127.0.0.1:1/x")
    monkeypatch.setenv("GPUSCHED_AGENT__CLUSTER", "kubernetes")

    assert main(["service", "agent"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "needs the extra `kubernetes`: pip install 'gpusched[kubernetes]'" in line
