"""The CLI as people run it, against every service as a real process: found through the
data dir, jobs listed and shown with their evictions, checkpoints and credits, a team
kept to its own jobs, audit filtered, and a follow that ends in one line when the stack
goes away."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpusched.cli.stack import Stack
from gpusched.contracts.messages import PriorityClassName, T
from gpusched.infra import natsauth
from gpusched.infra.settings import Settings
from tests.conftest import Servers
from tests.e2e.test_main_flow import Cluster, _stack_settings, cluster_on, start_stack
from tests.support.waiting import eventually

REPO = Path(__file__).resolve().parents[2]


def cli(stack: Stack, *args: str, creds: Path | None = None, timeout: float = 60) -> Any:
    """`gpusched ARGS` in a shell that knows only the stack's data dir (and, for a team,
    its credentials file): no URL is exported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")}
    env["GPUSCHED_DATA_DIR"] = str(stack.settings.data_dir)
    if creds is not None:
        env["GPUSCHED_NATS_CREDENTIALS"] = str(creds)
    return subprocess.run(
        [sys.executable, "-m", "gpusched.cli.main", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture
def stack(settings: Settings, tmp_path: Path) -> Iterator[Stack]:
    # A 2 s checkpoint deadline: a p2 job that cannot checkpoint in time is FORCED. A
    # submit with a command is a `process` workload: allowed here, without a quotas file.
    extra = {
        "GPUSCHED_CHECKPOINT__GRACE_S": "2",
        "GPUSCHED_ADMISSION__ALLOW_PROCESS_WORKLOADS_WITHOUT_QUOTAS": "true",
    }
    yield from start_stack(_stack_settings(settings, tmp_path), tmp_path, extra)


@pytest.fixture
async def cluster(stack: Stack) -> AsyncIterator[Cluster]:
    async for c in cluster_on(stack.settings):
        yield c


def _team_creds(servers: Servers, team: str, tmp_path: Path) -> Path:
    if servers.auth is None:
        pytest.skip("the NATS of this run has no credentials bundle")
    path = tmp_path / f"{team}.creds"
    natsauth.write_secret(path, natsauth.issue_client(servers.auth, "team", team))
    return path


@pytest.mark.timeout(300)
async def test_an_operator_lists_gets_explains_cancels_and_bills_jobs_from_the_cli(
    stack: Stack, cluster: Cluster, tmp_path: Path
) -> None:
    slow = await cluster.submit("slow", PriorityClassName.P2_OFFLINE, 8, checkpoint_s=60.0)
    p1 = await cluster.submit("p1", PriorityClassName.P1_NORMAL, 16)
    p0 = await cluster.submit("p0", PriorityClassName.P0_URGENT, 16)
    for job in (slow, p1, p0):
        await eventually(lambda job=job: _state_is(cluster, job, "running"), within=30)
    await cluster.demand(22.0)
    await eventually(lambda: _seen(cluster, T.EVICTION_FORCED, slow), within=60)

    # submit: a command to run and a job file, the command line winning over the file.
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "name: from-file\nteam: e2e\ngpus: {count: 4}\npriority_class: p2-offline\n"
    )
    done = await asyncio.to_thread(
        cli, stack, "submit", "-f", str(job_file), "--gpus", "2", "-o", "json",
        "--", "python", "-c", "print('hi')",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    submitted = json.loads(done.stdout)["job_id"]
    shown = json.loads((await asyncio.to_thread(cli, stack, "get", submitted, "-o", "json")).stdout)
    assert shown["job"]["gpus"]["count"] == 2 and shown["job"]["name"] == "from-file"

    # list: filters and pages.
    done = await asyncio.to_thread(cli, stack, "list", "--class", "p2-offline", "-o", "json")
    listed = {j["job_id"] for j in json.loads(done.stdout)["jobs"]}
    assert slow in listed and submitted in listed and p1 not in listed
    done = await asyncio.to_thread(cli, stack, "list", "--limit", "1")
    assert done.returncode == 0 and "more jobs: add --after" in done.stderr
    table = [line for line in done.stdout.splitlines() if line.startswith("job-")]
    assert len(table) == 1
    done = await asyncio.to_thread(cli, stack, "list", "--limit", "1", "--all", "-o", "json")
    assert len(json.loads(done.stdout)["jobs"]) == 4

    # get: the forced eviction, the checkpoints, the credit, in one screen.
    async def forced_and_credited() -> dict[str, Any] | None:
        done = await asyncio.to_thread(cli, stack, "get", slow, "-o", "json")
        shown = json.loads(done.stdout)
        sagas = shown["history"].get("sagas") or []
        statement = (shown["bill"] or {}).get("statement") or {}
        return shown if sagas and statement.get("credits") else None

    shown = await eventually(forced_and_credited, within=30)
    [saga] = shown["history"]["sagas"]
    assert saga["state"] == "forced" and saga["lost_gpu_seconds"] > 0
    assert float(shown["bill"]["statement"]["credits_total"]) < 0
    done = await asyncio.to_thread(cli, stack, "get", p0)
    assert done.returncode == 0, done.stderr
    # A 16-GPU job is a screen, not 85 lines of JSON: its GPUs one line per node.
    gpus = [line for line in done.stdout.splitlines() if line.strip().startswith("gpus")]
    assert len(gpus) == 1 and "16 x A100-80GB" in gpus[0], done.stdout
    assert len(done.stdout.splitlines()) < 25, done.stdout
    done = await asyncio.to_thread(cli, stack, "get", slow)
    assert "evictions (1)" in done.stdout and "forced" in done.stdout
    assert "forced eviction(s)" in done.stdout
    done = await asyncio.to_thread(cli, stack, "why", slow)
    assert done.returncode == 0 and "evictions, newest first:" in done.stdout

    # cancel, then the audit stream filtered to that job, as JSON lines.
    done = await asyncio.to_thread(cli, stack, "cancel", submitted, "--reason", "test")
    assert done.returncode == 0 and submitted in done.stdout
    done = await asyncio.to_thread(
        cli, stack, "audit", "--since", "10m", "--job", submitted, "-o", "json"
    )
    records = [json.loads(line) for line in done.stdout.splitlines()]
    assert records and {r["entity"] for r in records} == {submitted}
    assert "job.cancelled" in {r["action"] for r in records}
    done = await asyncio.to_thread(cli, stack, "audit", "--action", "eviction", "--since", "1h")
    assert "eviction.forced" in done.stdout and "job.cancelled" not in done.stdout

    # bill: a team with nothing on record is an error, not a silent empty success.
    done = await asyncio.to_thread(cli, stack, "bill", "--team", "nosuchteam")
    assert done.returncode == 1
    [line] = done.stderr.splitlines()
    assert "no usage or credits on record for team 'nosuchteam'" in line
    done = await asyncio.to_thread(cli, stack, "bill", "--team", "e2e")
    assert done.returncode == 0 and "e2e" in done.stdout


@pytest.mark.timeout(300)
async def test_a_team_sees_only_its_own_jobs_and_a_follow_ends_when_the_stack_stops(
    servers: Servers, stack: Stack, cluster: Cluster, tmp_path: Path
) -> None:
    vision = _team_creds(servers, "vision", tmp_path)
    done = await asyncio.to_thread(
        cli, stack, "submit", "--name", "v", "--team", "vision", "--gpus", "1", "-o", "json",
        creds=vision,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    own = json.loads(done.stdout)["job_id"]
    other = await cluster.submit("theirs", PriorityClassName.P1_NORMAL, 1)

    done = await asyncio.to_thread(cli, stack, "list", "-o", "json", creds=vision)
    assert [j["job_id"] for j in json.loads(done.stdout)["jobs"]] == [own]
    for argv in (["list", "--team", "e2e"], ["get", other], ["why", other]):
        done = await asyncio.to_thread(cli, stack, *argv, creds=vision)
        assert done.returncode == 1, (argv, done.stdout)
        [line] = done.stderr.splitlines()
        assert line.startswith("gpusched: forbidden: team:vision may not"), line
    # The other services' parts of `get` decide for themselves, and say no to another team.
    # (Once they have seen the job placed: before, there is nothing of it to hide.)
    await eventually(lambda: _state_is(cluster, other, "running"), within=30)
    for subject in ("api.checkpoints.history", "api.billing.job"):

        async def refused(subject: str = subject) -> Any:
            reply = await _as_team(stack, vision, subject, {"job_id": other})
            return reply if reply["ok"] is False else None

        reply = await eventually(refused, within=20)
        assert reply["error"]["code"] == "forbidden", (subject, reply)
    done = await asyncio.to_thread(cli, stack, "get", own, creds=vision)
    assert done.returncode == 0 and "team" in done.stdout and "vision" in done.stdout

    # A follow prints as records come and ends in one line when the stack goes away:
    # here its NATS is reached through a proxy the test closes (the session's NATS serves
    # other tests, so it cannot be stopped).
    proxy = await _Proxy.start(stack.settings.nats_url or "")
    follower = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gpusched.cli.main", "audit", "--follow", "--since", "5m",
        cwd=REPO, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("GPUSCHED_")},
             "GPUSCHED_DATA_DIR": str(stack.settings.data_dir),
             "GPUSCHED_NATS_URL": proxy.url},
    )  # fmt: skip
    try:
        assert follower.stdout is not None
        first = await asyncio.wait_for(follower.stdout.readline(), 30)
        assert first.strip(), "the follow printed nothing"
        await proxy.close()
        _, err = await asyncio.wait_for(follower.communicate(), 60)
    finally:
        await proxy.close()
        if follower.returncode is None:
            follower.kill()
            await follower.wait()
    assert follower.returncode == 3
    lines = err.decode().splitlines()
    assert len(lines) == 1 and "lost the connection to NATS" in lines[0], lines


class _Proxy:
    """A TCP relay to NATS that the test can take away, as a stopped stack would."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    @classmethod
    async def start(cls, nats_url: str) -> _Proxy:
        from urllib.parse import urlsplit

        parts = urlsplit(nats_url)
        proxy = cls((parts.hostname or "127.0.0.1", parts.port or 4222))
        proxy.server = await asyncio.start_server(proxy._relay, "127.0.0.1", 0)
        return proxy

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"nats://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for writer in self.writers:
            writer.close()
        self.writers.clear()


async def _as_team(stack: Stack, creds: Path, suffix: str, body: dict[str, Any]) -> Any:
    from gpusched.cli.client import ApiClient

    settings = stack.settings
    assert settings.nats_url
    async with ApiClient(settings.nats_url, settings.subject_prefix, credentials=creds) as api:
        return await api.call(suffix, body)


async def _state_is(cluster: Cluster, job_id: str, state: str) -> bool:
    return await cluster.state(job_id) == state


async def _seen(cluster: Cluster, message_type: str, job_id: str) -> bool:
    return bool(cluster.bus.of(message_type, job_id=job_id))
