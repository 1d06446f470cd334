"""TLS to NATS and PostgreSQL: the settings, the client contexts, the embedded servers' side.

Client side: a `TlsSettings` section (GPUSCHED_NATS_TLS__*, GPUSCHED_DATABASE_TLS__*)
becomes one `ssl.SSLContext`, built once at start and shared by every connection of the
process. `verify` (the default) checks the server's certificate against `ca_file` (else
the system's trust store) and its name against the URL's host (or `server_name`); a
client certificate is sent when `cert_file` is set. `verify=false` still encrypts but
trusts any server, so it must be asked for and is logged as a warning each time.

Files are read once, when the context is built: a renewed certificate or CA is picked up
by restarting the process (a rollout), not by the running connections.

Server side: `ServerTls` names the files an embedded server serves TLS with (the tests;
a development stack). Nothing here imports the rest of the project: the job SDK uses it.
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:  # settings imports this module
    from gpusched.infra.settings import Settings

__all__ = [
    "DATABASE_TLS",
    "NATS_TLS",
    "ServerTls",
    "TlsConfigError",
    "TlsSettings",
    "check_files",
    "client_context",
    "database_context",
    "nats_context",
    "server_name",
]

log = logging.getLogger(__name__)

# The environment names of the two sections; errors and warnings name the setting by them.
NATS_TLS = "GPUSCHED_NATS_TLS"
DATABASE_TLS = "GPUSCHED_DATABASE_TLS"

_FILES = ("ca_file", "cert_file", "key_file")


class TlsSettings(BaseModel):
    """TLS to one server. Setting any field turns it on (GPUSCHED_NATS_TLS__VERIFY=true
    alone: TLS with the system's trust store)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ca_file: Path | None = Field(
        default=None, description="PEM CA bundle the server's certificate must chain to"
    )
    cert_file: Path | None = Field(
        default=None, description="PEM client certificate, for a server that verifies clients"
    )
    key_file: Path | None = Field(
        default=None, description="PEM key of cert_file (if not in cert_file itself)"
    )
    verify: bool = Field(
        default=True,
        description="check the server's certificate and name; false still encrypts",
    )
    server_name: str | None = Field(
        default=None, description="the name the certificate must carry, if not the URL's host"
    )


class TlsConfigError(ValueError):
    """A TLS setting that cannot be used; the message is one line naming the setting."""


def check_files(settings: TlsSettings, setting: str) -> None:
    """Raise TlsConfigError naming the first file setting that names no file."""
    for name in _FILES:
        path: Path | None = getattr(settings, name)
        if path is not None and not path.is_file():
            raise TlsConfigError(f"{setting}__{name.upper()}={path}: no such file")
    if settings.key_file is not None and settings.cert_file is None:
        raise TlsConfigError(f"{setting}__KEY_FILE is set without {setting}__CERT_FILE")


def client_context(settings: TlsSettings | None, setting: str) -> ssl.SSLContext | None:
    """The client context for `settings` (None: no TLS); `setting` is the section's
    environment name (NATS_TLS, DATABASE_TLS), for the errors and the warning."""
    if settings is None:
        return None
    check_files(settings, setting)
    context = _ClientContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.server_name = settings.server_name
    if settings.verify:
        # PROTOCOL_TLS_CLIENT already means CERT_REQUIRED with the hostname checked.
        if settings.ca_file is not None:
            _load(context.load_verify_locations, setting, "CA_FILE", cafile=settings.ca_file)
        else:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
    else:
        context.check_hostname = False  # before verify_mode: ssl insists on this order
        context.verify_mode = ssl.CERT_NONE
        log.warning(
            "%s__VERIFY=false: the connection is encrypted but the server's certificate "
            "is not checked, so anyone on the path can pose as the server",
            setting,
        )
    if settings.cert_file is not None:
        _load(
            context.load_cert_chain,
            setting,
            "CERT_FILE",
            certfile=settings.cert_file,
            keyfile=settings.key_file,
        )
    return context


def nats_context(settings: Settings) -> ssl.SSLContext | None:
    """The context of the connections to NATS (GPUSCHED_NATS_TLS__*); None: no TLS."""
    return client_context(settings.nats_tls, NATS_TLS)


def database_context(settings: Settings) -> ssl.SSLContext | None:
    """The context of the connections to PostgreSQL (GPUSCHED_DATABASE_TLS__*)."""
    return client_context(settings.database_tls, DATABASE_TLS)


def server_name(context: ssl.SSLContext | None) -> str | None:
    """The `server_name` override a client context was built with (for nats-py's
    `tls_hostname`); the context applies it by itself too."""
    return context.server_name if isinstance(context, _ClientContext) else None


class _ClientContext(ssl.SSLContext):
    """An SSLContext that checks one fixed server name when one is configured.

    asyncpg always checks the host of its DSN; overriding the name where asyncio makes
    the TLS object (wrap_bio, for asyncpg and nats-py alike) serves both."""

    server_name: str | None = None

    def wrap_bio(
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | bytes | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        if self.server_name is not None and not server_side:
            server_hostname = self.server_name
        return super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)


def _load(load: Any, setting: str, name: str, **files: Path | None) -> None:
    """Run one of the context's load functions; its failure names the setting."""
    try:
        load(**{key: None if path is None else str(path) for key, path in files.items()})
    except OSError as exc:
        # ssl.SSLError included: its text says what is wrong (no PEM, a key that does
        # not match its certificate).
        shown = ", ".join(str(path) for path in files.values() if path is not None)
        raise TlsConfigError(f"{setting}__{name}={shown}: cannot be used: {exc}") from exc


@dataclass(frozen=True, slots=True)
class ServerTls:
    """The files an embedded server serves TLS with.

    `ca_file` is the CA that signs client certificates; with `verify_clients`, a client
    without a certificate signed by it is refused.
    """

    cert_file: Path
    key_file: Path
    ca_file: Path | None = None
    verify_clients: bool = False

    def __post_init__(self) -> None:
        if self.verify_clients and self.ca_file is None:
            raise ValueError("ServerTls: verify_clients needs ca_file, the CA of the clients")
