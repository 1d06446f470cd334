"""How a handler failure is treated at the edge (STYLE 5): the exception type decides.

- MalformedMessage (contracts.errors): dead-letter at once, never retried.
- Rejected: the message is well-formed but can never be applied (e.g. refers to
  something that does not exist): dead-letter at once, with the reason.
- An outage (`is_outage`: PostgreSQL or NATS unreachable, a connection dropped, a
  bounded network wait ran out): not the message's fault. The consumer waits for the
  server and applies the same message again, without spending its redelivery budget.
- Anything else is a failure of this message: redelivered with a delay, and
  dead-lettered after `bus.max_deliver` attempts.
"""

from __future__ import annotations

import asyncio
import errno
import socket

from gpusched.contracts.errors import MalformedMessage


class Rejected(Exception):
    """A well-formed message that can never be applied."""


class Unavailable(Exception):
    """A server this process depends on cannot be reached right now (an outage)."""


# Errors that say a connection is gone or was never made, whatever library raised them.
_CONNECTION_ERRNOS = frozenset(
    {
        errno.ECONNREFUSED,
        errno.ECONNRESET,
        errno.ECONNABORTED,
        errno.EPIPE,
        errno.ETIMEDOUT,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENOTCONN,
    }
)
# getaddrinfo's answers while a name cannot be resolved for now: no such name (yet),
# a temporary failure, no address, a resolver that failed.
_RESOLVER_OUTAGES = frozenset(
    code
    for code in (
        socket.EAI_NONAME,
        socket.EAI_AGAIN,
        socket.EAI_FAIL,
        getattr(socket, "EAI_NODATA", None),
        getattr(socket, "EAI_ADDRFAMILY", None),
    )
    if code is not None
)
# PostgreSQL SQLSTATE classes of an unavailable server: 08 connection exception,
# 57P01-57P03 admin/crash shutdown and "cannot connect now", 53300 too many connections.
_OUTAGE_SQLSTATES = ("08", "57P01", "57P02", "57P03", "53300")


def is_outage(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) says a server is unreachable, not that the
    message or the data is wrong."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _is_outage_one(current):
            return True
        current = current.__cause__ or current.__context__
    return False


def _is_outage_one(exc: BaseException) -> bool:
    if isinstance(exc, Unavailable | TimeoutError | asyncio.TimeoutError | ConnectionError):
        return True
    if isinstance(exc, OSError) and exc.errno in _CONNECTION_ERRNOS:
        return True
    if isinstance(exc, socket.gaierror) and exc.errno in _RESOLVER_OUTAGES:
        # The server's name does not resolve right now: its DNS record goes while it
        # restarts (a compose service, a StatefulSet pod), or DNS itself is down.
        return True
    module = type(exc).__module__ or ""
    name = type(exc).__name__
    if module.startswith("sqlalchemy"):
        # A DBAPI error raised because the connection died; SQLAlchemy says so itself.
        if getattr(exc, "connection_invalidated", False):
            return True
        if name in {"InterfaceError", "DisconnectionError", "InvalidatePoolError"}:
            return True
        if name == "TimeoutError":  # the pool found no connection in time
            return True
    if module.startswith("asyncpg") and name in {
        "ConnectionDoesNotExistError",
        "InterfaceError",
        "ConnectionFailureError",
        "CannotConnectNowError",
        "TooManyConnectionsError",
        "AdminShutdownError",
        "CrashShutdownError",
        "ClientCannotConnectError",
    }:
        return True
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if isinstance(sqlstate, str) and sqlstate.startswith(_OUTAGE_SQLSTATES):
        return True
    if module.startswith("nats"):
        # nats-py's connection-level errors; a JetStream API error (nats.js.errors.APIError
        # with a code) is an answer from the server, not an outage.
        return name in {
            "ConnectionClosedError",
            "NoServersError",
            "StaleConnectionError",
            "OutboundBufferLimitError",
            "UnexpectedEOF",
            "FlushTimeoutError",
            "TimeoutError",
            "ServiceUnavailableError",
            "NoRespondersError",
        }
    return False


__all__ = ["MalformedMessage", "Rejected", "Unavailable", "is_outage"]
