"""A small client of the request/reply API, for the CLI, the demo and the tests.

Everything here fails fast and in words: a server that cannot be reached is an
`Unreachable` error naming the URL tried and what to check, within a few seconds, never
an endless reconnect; a request nobody answers in time is an `ApiError` saying so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar

import nats
from nats.aio.client import Client as NatsClient
from pydantic import BaseModel

from gpusched.cli.errors import (
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    ApiError,
    BadInput,
    CliError,
    NoAnswer,
    NotConfigured,
    Unreachable,
)
from gpusched.cli.stackfile import StackFileError, read_stack_file, stack_file_path
from gpusched.contracts.messages import GetJob, GetReply, SubmitJob, SubmitReply
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth, tracing
from gpusched.infra.natsauth import FIRST_OPERATOR
from gpusched.infra.settings import Settings
from gpusched.infra.tls import nats_context, server_name

CONNECT_TIMEOUT_S = 2.0
R = TypeVar("R", bound=BaseModel)


def stack_settings(settings: Settings | None = None) -> Settings:
    """The settings with the stack's URLs: from GPUSCHED_NATS_URL / GPUSCHED_DATABASE_URL
    when set, else from the stack file of GPUSCHED_DATA_DIR (what `gpusched up` wrote)."""
    settings = settings if settings is not None else Settings()
    if settings.nats_url and settings.database_url:
        return settings
    try:
        found = read_stack_file(settings.data_dir)
    except StackFileError as exc:
        raise NotConfigured(str(exc)) from exc
    if found is None:
        return settings
    update: dict[str, Any] = {}
    if not settings.nats_url and found.nats_url:
        update["nats_url"] = found.nats_url
    if not settings.database_url and found.database_url:
        update["database_url"] = found.database_url
    if "subject_prefix" not in settings.model_fields_set:
        update["subject_prefix"] = found.subject_prefix
    if settings.nats_credentials is None and found.auth_dir:
        update["nats_credentials"] = Path(found.auth_dir) / "creds" / f"{FIRST_OPERATOR}.creds"
    if settings.security.auth_dir is None and found.auth_dir:
        update["security"] = settings.security.model_copy(update={"auth_dir": Path(found.auth_dir)})
    return settings.model_copy(update=update)


def stack_identity(settings: Settings, identity: str) -> Path | None:
    """The credentials of one of the stack's own identities (auditor, simulator, admin)
    from its bundle; None where the stack has no bundle (NATS without auth)."""
    if settings.security.auth_dir is None:
        return None
    path = settings.security.auth_dir / "creds" / f"{identity}.creds"
    if not path.is_file():
        raise NotConfigured(
            f"{path} does not exist: this command needs the stack's {identity} credentials "
            "(made by `gpusched up` or `gpusched auth init`)"
        )
    return path


def require_nats_url(settings: Settings) -> str:
    if settings.nats_url:
        return settings.nats_url
    raise NotConfigured(
        f"no stack found: GPUSCHED_NATS_URL is not set and there is no stack file at "
        f"{stack_file_path(settings.data_dir)}. Start the stack with `gpusched up` (or set "
        "GPUSCHED_DATA_DIR to its data dir), or set GPUSCHED_NATS_URL."
    )


def require_database_url(settings: Settings) -> str:
    if settings.database_url:
        return settings.database_url
    raise NotConfigured(
        f"no stack found: GPUSCHED_DATABASE_URL is not set and there is no stack file at "
        f"{stack_file_path(settings.data_dir)}. Start the stack with `gpusched up`, or set "
        "GPUSCHED_DATABASE_URL."
    )


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "no answer"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError | asyncio.TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:.0f}s"
    if isinstance(exc, socket.gaierror):
        return "unknown host"
    text = str(exc).strip()
    return text or type(exc).__name__


NATS_HINT = "Is the stack up? Start it with `gpusched up`, or set GPUSCHED_NATS_URL."
POSTGRES_HINT = "Is the stack up? Start it with `gpusched up`, or set GPUSCHED_DATABASE_URL."


async def connect_nats(
    url: str,
    name: str,
    *,
    timeout_s: float = CONNECT_TIMEOUT_S,
    hint: str = NATS_HINT,
    credentials: Path | None = None,
    tls: ssl.SSLContext | None = None,
    on_closed: Callable[[], None] | None = None,
) -> NatsClient:
    """Connect once, bounded by `timeout_s`; Unreachable (one line) if that fails
    (a certificate refused either way included). `tls`: see infra.tls.

    The connection does reconnect later if it drops (a short outage of the server), but
    the first connect is never retried: a wrong URL must fail now, not in minutes.
    `on_closed` is called once the client gave up on a dropped connection (the stack
    stopped): a long-lived reader ends then, in words, instead of waiting forever.
    """
    errors: list[BaseException] = []

    async def note(exc: Exception) -> None:
        errors.append(exc)

    async def closed() -> None:
        if on_closed is not None:
            on_closed()

    nc = NatsClient()
    try:
        await asyncio.wait_for(
            nc.connect(
                url,
                name=name,
                connect_timeout=max(1, round(timeout_s)),
                # One attempt per server: nats-py retries the initial connect forever with
                # max_reconnect_attempts <= 0, and a refused connect must fail at once.
                max_reconnect_attempts=1,
                reconnect_time_wait=0,
                error_cb=note,
                closed_cb=closed,
                **natsauth.connect_options(credentials),  # type: ignore[arg-type]
                tls=tls,
                tls_hostname=server_name(tls),
            ),
            timeout=timeout_s + 1.0,
        )
    except natsauth.AuthError as exc:
        raise NotConfigured(str(exc)) from None
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        cause = errors[-1] if errors else exc
        if "authorization violation" in str(cause).lower():
            raise Unreachable(
                "NATS",
                url,
                "the server refused these credentials (authorization violation)",
                "Use the credentials file of this installation: GPUSCHED_NATS_CREDENTIALS, "
                "or `gpusched auth issue` from an operator.",
            ) from None
        if isinstance(exc, TimeoutError) and not errors:
            cause = exc
        raise Unreachable("NATS", url, _reason(cause), hint) from None
    finally:
        if not nc.is_connected:
            await _quietly_close(nc)
    return nc


async def _quietly_close(nc: NatsClient) -> None:
    # A client that never connected (or is closing anyway) has nothing to lose.
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), timeout=1.0)


async def check_postgres(
    url: str,
    *,
    timeout_s: float = CONNECT_TIMEOUT_S,
    hint: str = POSTGRES_HINT,
    tls: ssl.SSLContext | None = None,
) -> None:
    """One bounded connect and `SELECT 1`; Unreachable (one line) if that fails.
    `tls`: see infra.tls."""
    import asyncpg

    dsn = url.replace("postgresql+asyncpg://", "postgresql://", 1)
    shown = _without_password(dsn)
    try:
        connection = await asyncio.wait_for(
            asyncpg.connect(dsn, timeout=timeout_s, ssl=tls), timeout_s + 1
        )
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
        raise Unreachable("PostgreSQL", shown, _reason(exc), hint) from None
    try:
        await asyncio.wait_for(connection.fetchval("SELECT 1"), timeout_s)
    except (OSError, TimeoutError, asyncpg.PostgresError) as exc:
        raise Unreachable("PostgreSQL", shown, _reason(exc), hint) from None
    finally:
        connection.terminate()


def _without_password(dsn: str) -> str:
    import urllib.parse

    parts = urllib.parse.urlsplit(dsn)
    if parts.password is None:
        return dsn
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


class ApiClient:
    def __init__(
        self,
        nats_url: str,
        prefix: str = "gpusched",
        timeout_s: float = 10.0,
        *,
        credentials: Path | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.nats_url = nats_url
        self.tls = tls
        self.subjects = Subjects(prefix)
        self.timeout_s = timeout_s
        self.credentials = credentials
        self._nc: NatsClient | None = None

    @classmethod
    def for_stack(cls, settings: Settings | None = None, timeout_s: float = 10.0) -> ApiClient:
        """A client of the stack the environment names (env vars, else the stack file)."""
        resolved = stack_settings(settings)
        return cls(
            require_nats_url(resolved),
            resolved.subject_prefix,
            timeout_s,
            credentials=resolved.nats_credentials,
            tls=nats_context(resolved),
        )

    async def __aenter__(self) -> Self:
        self._nc = await connect_nats(
            self.nats_url, "gpusched-cli", credentials=self.credentials, tls=self.tls
        )
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._nc is not None:
            await _quietly_close(self._nc)

    @property
    def nc(self) -> NatsClient:
        assert self._nc is not None, "use `async with ApiClient(...)`"
        return self._nc

    async def request(self, subject: str, body: bytes) -> bytes:
        headers = tracing.inject() or None
        if natsauth.message_size(body, headers) > natsauth.CLIENT_MAX_PAYLOAD:
            # The server would cut the connection of a client that sent it.
            raise BadInput(
                f"the request is {len(body):,} bytes, more than a client may send "
                f"({natsauth.CLIENT_MAX_PAYLOAD:,}): send less in one command"
            )
        try:
            msg = await self.nc.request(subject, body, timeout=self.timeout_s, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise NoAnswer(
                f"no service answers on {subject}: is the stack up (`gpusched up`)?"
            ) from exc
        except nats.errors.TimeoutError as exc:
            raise NoAnswer(
                f"no answer on {subject} within {self.timeout_s:g}s: the service may be "
                "restarting or overloaded; try again, or see its log"
            ) from exc
        return bytes(msg.data)

    async def ask(self, subject: str, request: BaseModel, reply: type[R]) -> R:
        """One request of a typed model, its typed reply."""
        return reply.model_validate_json(
            await self.request(subject, request.model_dump_json().encode())
        )

    async def wait_until_serving(self, within_s: float = 60.0) -> None:
        """Wait until admission answers (services start in parallel after `up`)."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            try:
                await self.get("job-000000000000")
                return
            except ApiError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def submit(self, job: SubmitJob) -> SubmitReply:
        with tracing.tracer().start_as_current_span("client submit"):
            raw = await self.request(self.subjects.api_jobs_submit, job.model_dump_json().encode())
        return SubmitReply.model_validate_json(raw)

    async def get(self, job_id: str) -> GetReply:
        raw = await self.request(
            self.subjects.api_jobs_get, GetJob(job_id=job_id).model_dump_json().encode()
        )
        return GetReply.model_validate_json(raw)

    async def call(self, subject_suffix: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Any other API endpoint, by its suffix after the prefix (e.g. `api.billing.statement`)."""
        raw = await self.request(
            f"{self.subjects.prefix}.{subject_suffix}", json.dumps(payload, default=str).encode()
        )
        reply = json.loads(raw)
        assert isinstance(reply, dict)
        return reply


__all__ = [
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "ApiClient",
    "ApiError",
    "CliError",
    "NoAnswer",
    "NotConfigured",
    "Unreachable",
    "check_postgres",
    "connect_nats",
    "require_database_url",
    "require_nats_url",
    "stack_settings",
]
