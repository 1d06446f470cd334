"""Allocations keep the host CPU and memory they hold, and the node of one without GPUs.

`cpu_per_gpu` and `memory_per_gpu` are what an allocation holds on the node of each of
its GPUs (a job's `host` ask split over its GPUs; 0 for a job that stated none); `node`
is the node whose host a job without GPUs runs on. Rebuilding the ledger from the rows
gives each node the host room it had.
"""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    s = current_schema()
    op.execute(
        f"ALTER TABLE {s}.allocations "
        "ADD COLUMN cpu_per_gpu bigint NOT NULL DEFAULT 0, "
        "ADD COLUMN memory_per_gpu bigint NOT NULL DEFAULT 0, "
        "ADD COLUMN node text"
    )
