"""The part of its GPU a fractional allocation holds, and whether it is a MIG slice: the
tenants of a GPU shared by training fractions are victims together (domain.elastic).
Rows written before have no share: their GPU is held, never freed by this controller."""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    op.execute(
        f"ALTER TABLE {current_schema()}.allocations "
        "ADD COLUMN share_milli integer, ADD COLUMN mig boolean NOT NULL DEFAULT false"
    )
