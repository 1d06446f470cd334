"""The whole control plane on one machine: servers, streams, migrations, services.

`gpusched up`, `gpusched demo` and the end-to-end tests use this. With
GPUSCHED_NATS_URL / GPUSCHED_DATABASE_URL set it starts no servers and uses those.

While it runs, nothing stops it but stop(): a service that dies is restarted by the
Supervisor, an embedded server that dies is restarted here, on the same port with its
data (clients keep their URL; services reconnect by themselves). Either is given up on
only in a crash loop, loudly, and then everything stops. The ports are chosen once per
data dir and kept in its stack file (see stackfile), which the CLI reads.

Each service serves /metrics, /livez and /readyz on a port of its own (chosen once per
data dir, or GPUSCHED_METRICS_PORT and the next ones), listed in the stack file and in
`<data_dir>/prometheus/targets.json` for a Prometheus `file_sd_configs`; the stack is
ready when every service's /readyz says so (health.py).

For fault injection: `kill(name)` sends SIGKILL (or any signal) to a service, "nats" or
"postgres"; `restarts(name)` counts how often each came back.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import signal
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import aiohttp

from gpusched.cli.client import check_postgres, connect_nats
from gpusched.cli.errors import NotConfigured
from gpusched.cli.stackfile import (
    StackFile,
    StackFileError,
    StackLock,
    StackRunning,
    read_stack_file,
    stack_file_path,
    write_stack_file,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus, natsauth
from gpusched.infra.db import create_engine
from gpusched.infra.embedded import (
    STACK_MAX_PAYLOAD,
    EmbeddedNats,
    EmbeddedPostgres,
    EmbeddedServerError,
    free_port,
)
from gpusched.infra.migrations import migrate, migrations_dir
from gpusched.infra.settings import Settings
from gpusched.infra.supervisor import (
    Backoff,
    ProcessSpec,
    RestartPolicy,
    Supervisor,
    describe_exit,
)
from gpusched.infra.tls import database_context, nats_context

__all__ = [
    "SERVERS",
    "SERVICES",
    "Stack",
    "StackNotReady",
    "StackRunning",
    "prepare",
    "service_migrations",
]

log = logging.getLogger(__name__)

# Start order matters little (every service waits on durable consumers), but the
# ledger owner first lets the others see the inventory event at once.
SERVICES: tuple[str, ...] = ("admission", "ingest", "preemption", "checkpoint", "billing", "agent")
# The embedded servers, by the names kill()/restarts()/pid() take.
SERVERS: tuple[str, ...] = ("nats", "postgres")
_WATCH_S = 0.2


class StackNotReady(RuntimeError):
    """The stack did not become ready in time; the message says what is missing."""


# Told each change in what a service waits for, then "<service> ready", while the stack
# becomes ready (`gpusched up` prints them).
Progress = Callable[[str], None]
# File of the Prometheus targets of the stack's services, under the data dir.
PROMETHEUS_TARGETS = Path("prometheus") / "targets.json"


# How long a service gets to stop by itself before it is killed. Every step of a
# service's shutdown is bounded; the agent's is the longest (its jobs checkpoint within
# 3 s, their reports and buffered events get a few more, then the runtime drains).
SERVICE_STOP_S = 20.0


def missing_files(settings: Settings) -> list[str]:
    """The configuration files the services read at start that do not exist, each in one
    line naming its setting: checked before anything starts, so a wrong working
    directory is one clear error instead of a service crash-looping."""
    files = [
        (settings.admission.inventory_path, "GPU inventory", "GPUSCHED_ADMISSION__INVENTORY_PATH"),
        (settings.billing.price_book_path, "price book", "GPUSCHED_BILLING__PRICE_BOOK_PATH"),
        (settings.admission.quotas_path, "quotas file", "GPUSCHED_ADMISSION__QUOTAS_PATH"),
    ]
    return [
        f"the {what} {path} does not exist (relative to {Path.cwd()}); set {setting} or "
        "start gpusched from the repository's directory"
        for path, what, setting in files
        if path is not None and not Path(path).is_file()
    ]


def service_migrations(service: str) -> Path | None:
    module = importlib.import_module(f"gpusched.{service}.app")
    assert module.__file__ is not None
    path = migrations_dir(module.__file__)
    return path if path.is_dir() else None


async def prepare(
    settings: Settings, services: Sequence[str] = SERVICES, *, credentials: Path | None = None
) -> None:
    """Create the streams and run every service's migrations (idempotent).

    Both servers are checked first with a short bound, so a wrong URL is one clear
    error (client.Unreachable) within seconds, not a retry loop. `credentials`: the
    installer's identity (only it may create streams); default: the settings'.
    """
    nats_url, db_url = settings.require_urls()
    database_tls = database_context(settings)
    await check_postgres(db_url, tls=database_tls)
    nc = await connect_nats(
        nats_url,
        "gpusched-prepare",
        credentials=credentials or settings.nats_credentials,
        tls=nats_context(settings),
    )
    try:
        await bus.ensure_streams(
            nc.jetstream(),
            Subjects(settings.subject_prefix).streams(),
            replicas=settings.bus.stream_replicas,
        )
    except bus.StreamReplicasRefused as exc:
        raise NotConfigured(str(exc)) from None
    finally:
        await nc.close()
    engine = create_engine(db_url, pool_size=1, tls=database_tls)
    try:
        for service in services:
            path = service_migrations(service)
            if path is not None:
                await migrate(engine, service, path)
    finally:
        await engine.dispose()


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _port(watched: _Watched | None) -> int | None:
    """The server's port, or None if it never got one (it failed to start)."""
    if watched is None:
        return None
    try:
        return watched.server.port
    except EmbeddedServerError:
        return None


def _monitor_port(watched: _Watched | None) -> int | None:
    if watched is None or not isinstance(watched.server, EmbeddedNats):
        return None
    try:
        return int(watched.server.monitor_url.rsplit(":", 1)[1])
    except EmbeddedServerError:
        return None


@dataclass
class _Watched:
    """An embedded server under watch: its restart schedule and count."""

    server: EmbeddedNats | EmbeddedPostgres
    backoff: Backoff
    started_at: float = field(default_factory=time.monotonic)
    due: float | None = None
    restarts: int = 0
    # Its next exit was caused by kill(): restarted, but no crash (see Supervisor.kill).
    killed: bool = False


@dataclass
class Stack:
    """Servers (unless external) plus one process per service, kept up until stop()."""

    settings: Settings
    services: Sequence[str] = SERVICES
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    output: TextIO | None = None
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Each service's /metrics, /livez and /readyz port, chosen by start().
    metrics_ports: dict[str, int] = field(default_factory=dict, init=False)
    supervisor: Supervisor | None = field(default=None, init=False)
    _servers: dict[str, _Watched] = field(default_factory=dict, init=False)
    _lock: StackLock | None = field(default=None, init=False)
    _watcher: threading.Thread | None = field(default=None, init=False)
    _closing: threading.Event = field(default_factory=threading.Event, init=False)
    _written_pids: dict[str, int] = field(default_factory=dict, init=False)
    _failure: str | None = field(default=None, init=False)
    # The NATS credentials of the embedded stack (None on an external NATS).
    auth: natsauth.AuthBundle | None = field(default=None, init=False)
    credentials: dict[str, Path] = field(default_factory=dict, init=False)
    # The TLS contexts of the readiness checks (NATS, PostgreSQL), built once.
    _tls: tuple[ssl.SSLContext | None, ssl.SSLContext | None] | None = field(
        default=None, init=False
    )

    @property
    def data_dir(self) -> Path:
        return self.settings.data_dir.resolve()

    @property
    def stack_file(self) -> Path:
        return stack_file_path(self.data_dir)

    def start(self) -> Settings:
        """Start everything; returns the settings with the resolved server URLs.

        Raises StackRunning if another process runs a stack on the same data dir.
        """
        self.claim()
        data_dir = self.data_dir
        nats_url, db_url = self.settings.nats_url, self.settings.database_url
        try:
            previous = self._previous()
            if not nats_url:
                # Secure by default: the embedded NATS authenticates every client, and
                # each service gets its own identity (natsauth, contracts.permissions).
                self.auth = natsauth.AuthBundle.ensure(data_dir / "auth")
                self.auth.write_server_config()
                self.credentials = natsauth.write_installation(
                    self.auth, Subjects(self.settings.subject_prefix)
                )
                nats = EmbeddedNats(
                    data_dir / "nats",
                    self._reuse(previous.nats_port, "NATS"),
                    monitor_port=self._reuse(previous.nats_monitor_port, "NATS monitoring"),
                    auth_config=self.auth.server_config,
                    max_payload=STACK_MAX_PAYLOAD,
                )
                self._servers["nats"] = _Watched(nats, Backoff(self.policy))
                nats_url = nats.start()
                log.info("embedded NATS at %s", nats_url)
            elif (auth_dir := self.settings.security.auth_dir) is not None:
                # An external NATS with an installation's credentials (auth init).
                self.credentials = {
                    path.stem: path for path in sorted((auth_dir / "creds").glob("*.creds"))
                }
            if not db_url:
                pg = EmbeddedPostgres(
                    data_dir / "postgres", self._reuse(previous.postgres_port, "PostgreSQL")
                )
                self._servers["postgres"] = _Watched(pg, Backoff(self.policy))
                pg.start()
                db_url = pg.create_database("gpusched")
                log.info("embedded PostgreSQL at %s", db_url)
            update: dict[str, object] = {"nats_url": nats_url, "database_url": db_url}
            if self.operator_credentials is not None:
                # What start() returns is a client's view: the first operator's identity.
                update["nats_credentials"] = self.operator_credentials
            if self.auth is not None:
                update["security"] = self.settings.security.model_copy(
                    update={
                        "auth_dir": self.auth.root,
                        "clients_account": self.auth.clients_account_id,
                        "job_signing_key": self.auth.job_issuer_path,
                    }
                )
            self.settings = self.settings.model_copy(update=update)
            self._choose_metrics_ports(previous)
            self._write_stack_file(running=True)
            self._write_prometheus_targets()
            asyncio.run(
                prepare(self.settings, self.services, credentials=self._creds(natsauth.ADMIN))
            )
            self.supervisor = Supervisor(  # each service with its own credentials
                [self._spec(name) for name in self.services],
                env=self._child_env(),
                log_dir=self.log_dir,
                output=self.output,
                policy=self.policy,
            )
            self.supervisor.start()
            self._write_stack_file(running=True)
            self._closing.clear()
            self._watcher = threading.Thread(
                target=self._watch, name="stack-server-watcher", daemon=True
            )
            self._watcher.start()
        except BaseException:
            self.stop()
            raise
        return self.settings

    def claim(self) -> None:
        """Take the data dir for this stack (start() does it too); StackRunning if another
        process runs a stack there."""
        if self._lock is None or not self._lock.held:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self._lock = StackLock(self.data_dir)
            self._lock.acquire()

    def wait(self) -> int:
        """Block until SIGINT/SIGTERM or a crash loop (see Supervisor.wait); then stop all."""
        assert self.supervisor is not None, "Stack.wait() before start()"
        try:
            return self.supervisor.wait()
        finally:
            self.stop()

    @property
    def failure(self) -> str | None:
        """Why the stack gave up by itself (a crash loop), if it did."""
        if self._failure is not None:
            return self._failure
        return None if self.supervisor is None else self.supervisor.failure

    # -- fault injection and observation -----------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to a service, "nats" or "postgres"; what dies is restarted (such an
        exit never counts toward a crash loop)."""
        if name in self._servers:
            watched = self._servers[name]
            watched.killed = True
            watched.server.kill(sig)
            return
        if self.supervisor is None:
            raise KeyError(f"no running process named {name!r}")
        self.supervisor.kill(name, sig)

    def restarts(self, name: str) -> int:
        """How often `name` (a service, "nats" or "postgres") was restarted after dying."""
        if name in self._servers:
            return self._servers[name].restarts
        if self.supervisor is None:
            raise KeyError(f"no process named {name!r}")
        return self.supervisor.restarts(name)

    def pid(self, name: str) -> int | None:
        """The pid of a service or server (None for a server that is down)."""
        if name in self._servers:
            return self._servers[name].server.pid
        if self.supervisor is None:
            raise KeyError(f"no process named {name!r}")
        return self.supervisor.pid(name)

    @property
    def pids(self) -> dict[str, int]:
        pids = {} if self.supervisor is None else dict(self.supervisor.pids)
        for name, watched in self._servers.items():
            if watched.server.pid is not None:
                pids[name] = watched.server.pid
        return pids

    def server_log(self, name: str) -> Path:
        return self._servers[name].server.log_path

    # -- readiness -----------------------------------------------------------------

    async def wait_until_ready(
        self, timeout_s: float = 120.0, progress: Progress | None = None
    ) -> None:
        """Return once every service says it is ready and admission answers a request.

        A service is ready when its /readyz says so: it has connected to NATS and
        PostgreSQL, migrated, registered its consumers, and each consumer and loop is
        advancing (health.py). `progress` hears each change in what a service waits for
        and each service that becomes ready. StackNotReady says what is missing after
        `timeout_s`.
        """
        assert self.settings.nats_url and self.settings.database_url
        assert self.supervisor is not None, "Stack.wait_until_ready() before start()"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        told: dict[str, str] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0)) as http:
            while True:
                if self.failure is not None:
                    raise StackNotReady(self.failure)
                waiting = await self._services_waiting(http)
                for service in self.services:
                    now = waiting.get(service, "ready")
                    if progress is not None and told.get(service) != now:
                        progress(f"{service:<11}{now}")
                    told[service] = now
                missing = [f"{service} {problem}" for service, problem in waiting.items()]
                if not missing:
                    missing = await self._api_missing()
                    if not missing:
                        return
                if loop.time() > deadline:
                    raise StackNotReady(
                        f"the stack is not ready after {timeout_s:.0f}s: {'; '.join(missing)}"
                        + (f" (logs in {self.log_dir})" if self.log_dir is not None else "")
                    )
                await asyncio.sleep(0.3)

    async def readiness(self, service: str, http: aiohttp.ClientSession) -> str | None:
        """None when `service` says it is ready, else what it waits for, in words that
        follow its name ("is migrating", "consumer ... is not subscribed yet")."""
        assert self.supervisor is not None
        try:
            running = self.supervisor.returncode(service) is None
        except KeyError:
            # Given up on (a crash loop) between two checks: the failure says why.
            running = False
        if not running:
            return "is not running"
        port = self.metrics_ports.get(service)
        if port is None:
            return "has no health endpoint"
        try:
            async with http.get(f"http://{self._health_host}:{port}/readyz") as response:
                verdict = await response.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return "is starting"
        if isinstance(verdict, dict) and verdict.get("ready") is True:
            return None
        problems = verdict.get("problems") if isinstance(verdict, dict) else None
        if isinstance(problems, list) and problems:
            problem = str(problems[0])
            return problem.removeprefix(f"{service} ")
        return "is not ready"

    async def _services_waiting(self, http: aiohttp.ClientSession) -> dict[str, str]:
        answers = await asyncio.gather(*(self.readiness(s, http) for s in self.services))
        return {
            service: answer
            for service, answer in zip(self.services, answers, strict=True)
            if answer is not None
        }

    async def _api_missing(self) -> list[str]:
        """What a client finds missing: admission must answer a request through the
        clients' account, as every CLI command will."""
        assert self.settings.nats_url
        if "admission" not in self.services:
            return []
        from gpusched.cli.client import ApiClient, CliError

        if self._tls is None:
            self._tls = (nats_context(self.settings), database_context(self.settings))
        api = ApiClient(
            self.settings.nats_url,
            self.settings.subject_prefix,
            timeout_s=2.0,
            credentials=self.operator_credentials,
            tls=self._tls[0],
        )
        try:
            async with api:
                await api.get("job-000000000000")
        except CliError as exc:
            return [f"admission does not answer requests yet ({exc})"]
        return []

    @property
    def _health_host(self) -> str:
        host = self.settings.metrics_host
        return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host

    # -- internals -----------------------------------------------------------------

    def _previous(self) -> StackFile:
        try:
            return read_stack_file(self.data_dir) or StackFile()
        except StackFileError as exc:
            log.warning("%s; starting afresh", exc)
            return StackFile()

    def _reuse(self, port: int | None, what: str) -> int | None:
        """The port this data dir used last time, unless another process took it."""
        if port is None or _port_free(port):
            return port
        log.warning(
            "port %d of %s (from %s) is taken by another process; choosing another one",
            port,
            what,
            self.stack_file,
        )
        return None

    def _choose_metrics_ports(self, previous: StackFile) -> None:
        """One port per service: GPUSCHED_METRICS_PORT and the next ones if it is set,
        else those this data dir used last time, else free ones; a port another process
        took is replaced, with a warning."""
        base = self.settings.metrics_port
        for offset, service in enumerate(self.services):
            wanted = base + offset if base else previous.metrics_ports.get(service)
            if wanted is not None and wanted not in self.metrics_ports.values():
                if _port_free(wanted):
                    self.metrics_ports[service] = wanted
                    continue
                log.warning(
                    "port %d for the metrics of %s is taken by another process; "
                    "choosing another one",
                    wanted,
                    service,
                )
            port = free_port()
            while port in self.metrics_ports.values():
                port = free_port()
            self.metrics_ports[service] = port

    def _write_prometheus_targets(self) -> None:
        """The services' /metrics as a Prometheus file_sd target list (job `gpusched`
        in the scrape config that reads it, as the alert rules expect)."""
        path = self.data_dir / PROMETHEUS_TARGETS
        path.parent.mkdir(parents=True, exist_ok=True)
        targets = [
            {"targets": [f"{self._health_host}:{port}"], "labels": {"component": service}}
            for service, port in self.metrics_ports.items()
        ]
        scratch = path.with_name(f".{path.name}.tmp")
        scratch.write_text(json.dumps(targets, indent=2) + "\n", encoding="utf-8")
        scratch.replace(path)

    @property
    def prometheus_targets(self) -> Path:
        return self.data_dir / PROMETHEUS_TARGETS

    def _write_stack_file(self, *, running: bool) -> None:
        nats = self._servers.get("nats")
        pg = self._servers.get("postgres")
        pids = {"up": os.getpid(), **self.pids} if running else {}
        content = StackFile(
            running=running,
            nats_url=self.settings.nats_url,
            database_url=self.settings.database_url,
            subject_prefix=self.settings.subject_prefix,
            nats_port=_port(nats),
            nats_monitor_port=_monitor_port(nats),
            postgres_port=_port(pg),
            log_dir=None if self.log_dir is None else str(self.log_dir.resolve()),
            auth_dir=(
                None
                if self.settings.security.auth_dir is None
                else str(self.settings.security.auth_dir)
            ),
            pids=pids,
            metrics_ports=dict(self.metrics_ports),
        )
        write_stack_file(self.data_dir, content)
        self._written_pids = pids

    def _watch(self) -> None:
        while not self._closing.wait(_WATCH_S):
            for name, watched in self._servers.items():
                if self._closing.is_set():
                    return
                try:
                    if not self._keep_up(name, watched, time.monotonic()):
                        return
                except Exception:
                    # The watcher must outlive any one failure, or nothing would come back.
                    log.exception("watching %s failed; retrying", name)
            if self.supervisor is not None and not self._closing.is_set():
                pids = {"up": os.getpid(), **self.pids}
                if pids != self._written_pids:
                    try:
                        self._write_stack_file(running=True)
                    except OSError as exc:
                        log.warning("cannot update %s: %s", self.stack_file, exc)

    def _keep_up(self, name: str, watched: _Watched, now: float) -> bool:
        """Restart `name` if it died and its backoff is over; False once given up on."""
        server = watched.server
        if watched.due is None:
            if server.is_running:
                return True
            returncode = server.returncode
            if watched.killed:
                watched.killed = False
                delay: float | None = self.policy.first_backoff_s
            else:
                delay = watched.backoff.on_exit(now, watched.started_at)
            if delay is None:
                return self._give_up(name, watched)
            log.warning(
                "%s (pid %s) exited with %s; restarting it on port %d in %.1fs (restart %d)",
                name,
                server.pid,
                "an unknown status" if returncode is None else describe_exit(returncode),
                server.port,
                delay,
                watched.restarts + 1,
            )
            watched.due = now + delay
            return True
        if now < watched.due:
            return True
        try:
            server.revive()
        except EmbeddedServerError as exc:
            delay = watched.backoff.on_exit(time.monotonic(), now)
            if delay is None:
                return self._give_up(name, watched)
            first_line = str(exc).splitlines()[0]
            log.error("%s could not be restarted (%s); retrying in %.1fs", name, first_line, delay)
            watched.due = time.monotonic() + delay
            return True
        watched.due = None
        watched.started_at = time.monotonic()
        watched.restarts += 1
        log.warning("%s is back on port %d (pid %s)", name, server.port, server.pid)
        return True

    def _give_up(self, name: str, watched: _Watched) -> bool:
        reason = (
            f"{name} is crash-looping ({watched.backoff.recent_exits} exits within "
            f"{self.policy.crash_loop_window_s:.0f}s); giving up on it. Its log: "
            f"{watched.server.log_path}"
        )
        self._failure = reason
        if self.supervisor is not None:
            self.supervisor.abort(reason)
        else:
            log.error("%s", reason)
        return False

    def _spec(self, service: str) -> ProcessSpec:
        env: dict[str, str] = {}
        creds = self._creds(service)
        if creds is not None:
            env["GPUSCHED_NATS_CREDENTIALS"] = str(creds)
        security = self.settings.security
        if security.clients_account is not None:
            env["GPUSCHED_SECURITY__CLIENTS_ACCOUNT"] = security.clients_account
        if security.auth_dir is not None:
            env["GPUSCHED_SECURITY__AUTH_DIR"] = str(security.auth_dir)
        if service == "admission" and security.job_signing_key is not None:
            env["GPUSCHED_SECURITY__JOB_SIGNING_KEY"] = str(security.job_signing_key)
        # Its own port: one shared GPUSCHED_METRICS_PORT would clash between services.
        env["GPUSCHED_METRICS_PORT"] = str(self.metrics_ports[service])
        return ProcessSpec(
            service, [sys.executable, "-m", "gpusched.cli.main", "service", service], env=env
        )

    def _creds(self, identity: str) -> Path | None:
        """The credentials file of one of this stack's identities (None without auth)."""
        return self.credentials.get(identity)

    @property
    def operator_credentials(self) -> Path | None:
        return self._creds(natsauth.FIRST_OPERATOR)

    def _child_env(self) -> dict[str, str]:
        assert self.settings.nats_url and self.settings.database_url
        env = {
            "GPUSCHED_NATS_URL": self.settings.nats_url,
            "GPUSCHED_DATABASE_URL": self.settings.database_url,
            "GPUSCHED_SUBJECT_PREFIX": self.settings.subject_prefix,
            "GPUSCHED_DATA_DIR": str(self.data_dir),
            # The simulated cluster's checkpoints live with the rest of this stack's data.
            "GPUSCHED_AGENT__WORKDIR": str(self.data_dir / "agent"),
            **self._file_roots(),
            **self.env,
        }
        if self.settings.trace_file is not None:
            env["GPUSCHED_TRACE_FILE"] = str(self.settings.trace_file.resolve())
        return env

    def _file_roots(self) -> dict[str, str]:
        """Where the checkpoint service reads file:// claims: the settings' roots, else,
        with the simulated cluster (whose jobs save in the agent's workdir), that
        workdir. A Kubernetes agent's pods save on storage of their own: unset."""
        roots = [str(root) for root in self.settings.checkpoint.file_roots]
        cluster = self.env.get("GPUSCHED_AGENT__CLUSTER", self.settings.agent.cluster)
        if not roots and cluster == "sim":
            roots = [str((self.data_dir / "agent").resolve())]
        return {"GPUSCHED_CHECKPOINT__FILE_ROOTS": json.dumps(roots)} if roots else {}

    def stop(self) -> None:
        """Services first, then the servers they use; idempotent."""
        self._closing.set()
        watcher, self._watcher = self._watcher, None
        if watcher is not None and watcher is not threading.current_thread():
            watcher.join()
        if self.supervisor is not None:
            self.supervisor.stop(SERVICE_STOP_S)
        for watched in reversed(list(self._servers.values())):
            watched.server.stop()
        lock, self._lock = self._lock, None
        if lock is not None and lock.held:
            # Keep the ports for the next start; only "running" and the pids go.
            if self.settings.nats_url or self._servers:
                try:
                    self._write_stack_file(running=False)
                except OSError as exc:
                    log.warning("cannot update %s: %s", self.stack_file, exc)
            lock.release()
        self._servers.clear()

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
