"""Stream replicas on a real three-server NATS cluster (JetStream clustered).

GPUSCHED_BUS__STREAM_REPLICAS is what makes the streams survive the loss of a NATS
server: with 3, every stream is kept on the three servers, and a message acknowledged
before one of them is SIGKILLed is still read afterwards, as are messages published
while it is down. A single server cannot keep replicas, and says so in one line that
names the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import StreamInfo
from tests.support.waiting import eventually

from gpusched.cli.errors import EXIT_USAGE, NotConfigured
from gpusched.cli.stack import prepare
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.embedded import EmbeddedNats, _nats_server_binary, free_port
from gpusched.infra.settings import Settings
from gpusched.infra.supervisor import spawn_bound_child

SERVERS = 3
PORT_ATTEMPTS = 3


class Cluster:
    """Three nats-servers routed to each other, each with its own JetStream store."""

    def __init__(self, root: Path) -> None:
        self.base = root
        self.root = root
        self.names = [f"n{i}" for i in range(SERVERS)]
        self.client_ports: list[int] = []
        self.monitor_ports: list[int] = []
        self.route_ports: list[int] = []
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{port}" for port in self.client_ports]

    def start(self) -> None:
        """Start the three servers and wait until the cluster has formed.

        Ports are picked free, but another test's server (the suite runs in parallel)
        can take one before ours binds it; the server then exits at once, and the
        cluster starts again on fresh ports, as the embedded servers do."""
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._choose_ports(attempt)
            self._launch()
            deadline = time.monotonic() + 60
            while not all(self._healthy(port) for port in self.monitor_ports):
                exited = [n for n, p in self.processes.items() if p.poll() is not None]
                if exited:
                    self.stop()
                    if "already in use" in self.logs() and attempt < PORT_ATTEMPTS:
                        break
                    raise AssertionError(f"NATS server {exited} exited:\n{self.logs()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"the NATS cluster did not form in 60 s:\n{self.logs()}")
                time.sleep(0.2)
            else:
                return

    def _choose_ports(self, attempt: int) -> None:
        self.root = self.base / f"attempt-{attempt}"
        ports: list[int] = []
        while len(ports) < 3 * SERVERS:  # nine distinct ports
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.client_ports = ports[:SERVERS]
        self.monitor_ports = ports[SERVERS : 2 * SERVERS]
        self.route_ports = ports[2 * SERVERS :]
        self.processes = {}

    def _launch(self) -> None:
        routes = [f"nats-route://127.0.0.1:{port}" for port in self.route_ports]
        for i, name in enumerate(self.names):
            folder = self.root / name
            folder.mkdir(parents=True)
            config = folder / "nats.conf"
            config.write_text(
                f"server_name: {name}\n"
                f"listen: 127.0.0.1:{self.client_ports[i]}\n"
                f"http: 127.0.0.1:{self.monitor_ports[i]}\n"
                f"jetstream {{ store_dir: {json.dumps(str(folder / 'js'))} }}\n"
                f"cluster {{ name: gpusched-test, listen: 127.0.0.1:{self.route_ports[i]},"
                f" routes: {json.dumps(routes)} }}\n"
            )
            with (folder / "nats.log").open("ab") as log:
                self.processes[name] = spawn_bound_child(
                    [str(_nats_server_binary()), "--config", str(config)],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=folder,
                )

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=10)

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=10)

    def logs(self) -> str:
        return "\n".join(
            (self.root / name / "nats.log").read_text(errors="replace")[-2000:]
            for name in self.names
        )

    @staticmethod
    def _healthy(monitor_port: int) -> bool:
        # /healthz is ok once this server's JetStream is current with the cluster's
        # metadata leader, i.e. the cluster has formed.
        url = f"http://127.0.0.1:{monitor_port}/healthz"
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:
                return bool(json.loads(reply.read()).get("status") == "ok")
        except (OSError, ValueError):
            return False


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    cluster = Cluster(tmp_path / "nats")
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
async def nc(cluster: Cluster) -> AsyncIterator[NatsClient]:
    client = await nats.connect(
        servers=cluster.urls, connect_timeout=2, reconnect_time_wait=0.2, max_reconnect_attempts=-1
    )
    try:
        yield client
    finally:
        await client.close()


async def _ensure(nc: NatsClient, subjects: Subjects, replicas: int) -> None:
    # Right after the cluster forms, its metadata leader may still be elected.
    async def created() -> bool:
        try:
            await bus.ensure_streams(nc.jetstream(), subjects.streams(), replicas=replicas)
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError):
            return False
        return True

    await eventually(created, within=30)


@pytest.mark.timeout(180)
async def test_streams_kept_on_three_servers_lose_nothing_when_one_is_killed(
    cluster: Cluster, nc: NatsClient
) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")
    js = nc.jetstream()
    name = subjects.stream("EVENTS")
    subject = subjects.event("checkpoint", "eviction.completed")
    # Installed with one replica, then raised to three in place (the next `migrate`).
    await _ensure(nc, subjects, 1)
    assert (await js.publish(subject, b"before-0")).seq == 1
    await _ensure(nc, subjects, 3)

    async def led() -> StreamInfo | None:
        # A replicated stream elects its own leader, and new replicas catch up with it.
        info = await js.stream_info(name)
        kept = info.cluster
        if kept is None or not kept.leader or len(kept.replicas or []) != SERVERS - 1:
            return None
        return info if all(peer.current for peer in kept.replicas or []) else None

    info = await eventually(led, within=30)
    assert info.config.num_replicas == 3
    assert info.cluster is not None and info.cluster.leader in cluster.names
    assert len(info.cluster.replicas or []) == SERVERS - 1
    # Applied again (every service start does), the same replicas change nothing.
    await bus.ensure_streams(js, subjects.streams(), replicas=3)

    before = [(await js.publish(subject, f"before-{i}".encode())).seq for i in range(1, 20)]
    assert before == list(range(2, 21))

    # SIGKILL the server that leads the stream: the other two elect a new leader and
    # keep every acknowledged message.
    cluster.kill(info.cluster.leader)

    async def published_while_down() -> bool:
        try:
            await js.publish(subject, b"after", timeout=2)
        except (
            nats.errors.TimeoutError,
            nats.js.errors.ServiceUnavailableError,
            nats.js.errors.NoStreamResponseError,
        ):
            return False
        return True

    await eventually(published_while_down, within=60)
    after = await js.stream_info(name)
    assert after.cluster is not None and after.cluster.leader != info.cluster.leader

    async def stored() -> list[bytes] | None:
        # Read by sequence from the stream itself; a message it lost is NotFoundError.
        try:
            return [(await js.get_msg(name, seq)).data or b"" for seq in range(1, 22)]
        except (nats.errors.TimeoutError, nats.js.errors.ServiceUnavailableError):
            return None  # the new leader still settling

    read = await eventually(stored, within=30)
    assert read[:20] == [f"before-{i}".encode() for i in range(20)]
    assert read[20] == b"after"


@pytest.mark.timeout(120)
async def test_more_replicas_than_servers_is_refused_naming_the_setting(
    cluster: Cluster, nc: NatsClient, tmp_path: Path, settings: Settings
) -> None:
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")
    await _ensure(nc, subjects, 1)
    with pytest.raises(bus.StreamReplicasRefused, match="GPUSCHED_BUS__STREAM_REPLICAS"):
        await bus.ensure_streams(nc.jetstream(), subjects.streams(), replicas=5)
    # Nothing changed: the streams keep the one replica they had.
    info = await nc.jetstream().stream_info(subjects.stream("EVENTS"))
    assert info.config.num_replicas == 1

    single = EmbeddedNats(tmp_path / "single")
    url = await asyncio.to_thread(single.start)
    try:
        lone = await nats.connect(url, connect_timeout=2)
        try:
            with pytest.raises(bus.StreamReplicasRefused, match=r"non-clustered.*\(1 for a single"):
                await bus.ensure_streams(lone.jetstream(), subjects.streams(), replicas=3)
            with pytest.raises(nats.js.errors.NotFoundError):
                await lone.jetstream().stream_info(subjects.stream("EVENTS"))
        finally:
            await lone.close()
        # `gpusched up` / `migrate` say it as a setting to fix (one line, exit 2).
        wrong = settings.model_copy(
            update={
                "nats_url": url,
                "nats_credentials": None,
                "bus": settings.bus.model_copy(update={"stream_replicas": 3}),
            }
        )
        with pytest.raises(NotConfigured, match="GPUSCHED_BUS__STREAM_REPLICAS") as refused:
            await prepare(wrong, services=())
        assert refused.value.exit_code == EXIT_USAGE
    finally:
        await asyncio.to_thread(single.stop)
