"""Leader election for singleton loops, on a PostgreSQL session advisory lock.

The lock lives as long as the holder's connection: if the leader process dies, its
connection closes and the lock is free at once, so a standby takes over on its next
try. A leader that loses its connection stops leading before it acts again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import zlib

import asyncpg

from gpusched.infra.db import asyncpg_dsn
from gpusched.infra.outages import describe

log = logging.getLogger(__name__)

# Every wait on the lease's connection is bounded: an unreachable server costs a tick
# at most this long, and then this process is not the leader.
CONNECT_TIMEOUT_S = 5.0
QUERY_TIMEOUT_S = 5.0


class LeaderLease:
    def __init__(self, database_url: str, name: str, *, tls: ssl.SSLContext | None = None) -> None:
        self._dsn = asyncpg_dsn(database_url)
        self._tls = tls
        self.name = name
        self._key = zlib.crc32(f"gpusched-leader:{name}".encode())
        self._conn: asyncpg.Connection | None = None
        self.is_leader = False
        self._unreachable = False  # logged once per outage, not per try

    async def try_acquire(self) -> bool:
        """True while this process holds the lease; cheap to call before each tick.

        A lost connection (PostgreSQL restarted or unreachable) means not leader, until
        a new connection acquires the lock again; the lock died with the old session,
        so another replica may hold it by then."""
        try:
            if self._conn is None or self._conn.is_closed():
                self.is_leader = False
                self._conn = await asyncpg.connect(
                    self._dsn,
                    timeout=CONNECT_TIMEOUT_S,
                    command_timeout=QUERY_TIMEOUT_S,
                    ssl=self._tls,
                )
            if self.is_leader:
                # Prove the session (and so the lock) is still alive.
                await self._conn.fetchval("SELECT 1", timeout=QUERY_TIMEOUT_S)
                return True
            self.is_leader = bool(
                await self._conn.fetchval(
                    "SELECT pg_try_advisory_lock($1)", self._key, timeout=QUERY_TIMEOUT_S
                )
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self.is_leader:
                log.warning("lost leader lease %s: %s", self.name, describe(exc))
            elif not self._unreachable:
                log.warning("cannot reach PostgreSQL for lease %s: %s", self.name, describe(exc))
            self._unreachable = True
            await self.release()
            return False
        self._unreachable = False
        if self.is_leader:
            log.info("became leader of %s", self.name)
        return self.is_leader

    async def release(self) -> None:
        self.is_leader = False
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(conn.close(timeout=QUERY_TIMEOUT_S), QUERY_TIMEOUT_S)
            if not conn.is_closed():
                conn.terminate()
