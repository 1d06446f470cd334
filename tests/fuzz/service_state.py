"""What a fuzz test compares before and after: a digest of a service's tables, and
the dead letters and audit records a service published."""

from __future__ import annotations

from nats.js import JetStreamContext

from gpusched.infra.runtime import ServiceRuntime
from tests.support.waiting import stream_messages_after

# Columns a service rewrites on its own clock, whatever it is sent: ingest's replicas
# restamp their pool shares at every flush.
VOLATILE = {"pool_partials": ("updated",)}


async def digest(rt: ServiceRuntime) -> dict[str, str]:
    """An md5 of every table of the service's schema, by table name."""
    async with rt.uow() as uow:
        rows = await uow.execute(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = :s",
            {"s": rt.schema},
        )
        tables = sorted(r.table_name for r in rows)
        found: dict[str, str] = {}
        for table in tables:
            row = "to_jsonb(t)" + "".join(f" - '{c}'" for c in VOLATILE.get(table, ()))
            result = await uow.execute(
                f"SELECT md5(coalesce(string_agg(({row})::text, '|' ORDER BY ({row})::text),"
                f" '')) AS d FROM {rt.schema}.\"{table}\" t"
            )
            found[table] = result.one().d
        return found


async def dead_letters(js: JetStreamContext, subject: str) -> list[bytes]:
    return [msg.data for msg in await stream_messages_after(js, subject)]
