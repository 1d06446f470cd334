"""The unit of work's snapshot on the real PostgreSQL: a view read in several statements
sees one moment, whatever commits between them."""

from __future__ import annotations

import pytest
from sqlalchemy.exc import DBAPIError

from gpusched.contracts.subjects import Subjects
from gpusched.infra.db import UnitOfWorkFactory, create_engine


async def test_a_snapshot_reads_one_moment_and_writes_nothing(database_url: str) -> None:
    engine = create_engine(database_url, pool_size=2)
    units = UnitOfWorkFactory(engine, "public", "test", Subjects("t"))
    try:
        async with units() as uow:
            await uow.execute("CREATE TABLE rows (n int)")
            await uow.commit()
        async with units() as reader:
            await reader.snapshot()
            before = (await reader.execute("SELECT count(*) FROM rows")).scalar_one()
            async with units() as writer:
                await writer.execute("INSERT INTO rows VALUES (1)")
                await writer.commit()
            after = (await reader.execute("SELECT count(*) FROM rows")).scalar_one()
            assert (before, after) == (0, 0)
            with pytest.raises(DBAPIError, match="read-only transaction"):
                await reader.execute("INSERT INTO rows VALUES (2)")
        async with units() as uow:
            assert (await uow.execute("SELECT count(*) FROM rows")).scalar_one() == 1
    finally:
        await engine.dispose()
