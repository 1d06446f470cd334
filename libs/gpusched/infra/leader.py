"""Leader election for singleton loops, on a PostgreSQL session advisory lock.

The lock lives as long as the holder's connection: if the leader process dies, its
connection closes and the lock is free at once, so a standby takes over on its next
try. A leader that loses its connection stops leading before it acts again.
"""

from __future__ import annotations

import contextlib
import logging
import zlib

import asyncpg

from gpusched.infra.db import asyncpg_dsn

log = logging.getLogger(__name__)


class LeaderLease:
    def __init__(self, database_url: str, name: str) -> None:
        self._dsn = asyncpg_dsn(database_url)
        self.name = name
        self._key = zlib.crc32(f"gpusched-leader:{name}".encode())
        self._conn: asyncpg.Connection | None = None
        self.is_leader = False

    async def try_acquire(self) -> bool:
        """True while this process holds the lease; cheap to call before each tick."""
        try:
            if self._conn is None or self._conn.is_closed():
                self.is_leader = False
                self._conn = await asyncpg.connect(self._dsn)
            if self.is_leader:
                # Prove the session (and so the lock) is still alive.
                await self._conn.fetchval("SELECT 1")
                return True
            self.is_leader = bool(
                await self._conn.fetchval("SELECT pg_try_advisory_lock($1)", self._key)
            )
            if self.is_leader:
                log.info("became leader of %s", self.name)
            return self.is_leader
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
            log.warning("lost leader lease %s", self.name, exc_info=True)
            await self.release()
            return False

    async def release(self) -> None:
        self.is_leader = False
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None
