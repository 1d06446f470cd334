"""Which failures are outages (wait for the server) and which are the message's own."""

from __future__ import annotations

import asyncio
import errno
import socket

import pytest

from gpusched.contracts.errors import MalformedMessage
from gpusched.infra.db import create_engine
from gpusched.infra.errors import Rejected, Unavailable, is_outage


class FakeAsyncpgError(Exception):
    pass


def test_connection_errors_and_timeouts_are_outages() -> None:
    assert is_outage(ConnectionRefusedError(errno.ECONNREFUSED, "refused"))
    assert is_outage(TimeoutError())
    assert is_outage(Unavailable("postgres down"))
    assert is_outage(OSError(errno.EHOSTUNREACH, "no route"))


def test_an_outage_wrapped_by_another_error_is_still_an_outage() -> None:
    try:
        try:
            raise ConnectionResetError(errno.ECONNRESET, "reset")
        except ConnectionResetError as inner:
            raise RuntimeError("statement failed") from inner
    except RuntimeError as outer:
        assert is_outage(outer)


def test_a_postgres_connection_sqlstate_is_an_outage_and_a_data_error_is_not() -> None:
    down = FakeAsyncpgError("terminating connection due to administrator command")
    down.sqlstate = "57P01"  # type: ignore[attr-defined]
    bad = FakeAsyncpgError("invalid input syntax")
    bad.sqlstate = "22P02"  # type: ignore[attr-defined]
    assert is_outage(down)
    assert not is_outage(bad)


def test_message_faults_are_not_outages() -> None:
    assert not is_outage(MalformedMessage("not json"))
    assert not is_outage(Rejected("no such saga"))
    assert not is_outage(ValueError("bad value"))
    assert not is_outage(KeyError("missing"))
    assert not is_outage(OSError(errno.ENOENT, "no such file"))


def test_a_name_that_does_not_resolve_is_an_outage_and_other_resolver_answers_are_not() -> None:
    # `docker compose restart postgres`: the service's DNS name goes while it restarts.
    assert is_outage(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert is_outage(socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution"))
    # A request the resolver cannot answer at all is this process's fault, not a server's.
    assert not is_outage(socket.gaierror(socket.EAI_SERVICE, "Servname not supported"))
    assert not is_outage(socket.gaierror(socket.EAI_BADFLAGS, "Bad value for ai_flags"))


async def test_a_database_host_that_does_not_resolve_is_an_outage_as_sqlalchemy_raises_it() -> None:
    engine = create_engine("postgresql+asyncpg://u:p@no-such-host.invalid:5432/db")
    try:
        async with asyncio.timeout(30):
            with pytest.raises(Exception) as raised:  # whatever the driver raises
                async with engine.connect():
                    pass
    finally:
        await engine.dispose()
    assert is_outage(raised.value), repr(raised.value)
