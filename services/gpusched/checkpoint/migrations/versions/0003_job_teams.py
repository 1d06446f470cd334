"""The team of each job the service has seen (from admission's grants and the eviction
requests, which carry it): a team may read the sagas and checkpoints of its own jobs
(`<p>.api.checkpoints.history`), and the service decides that from its own tables."""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    s = current_schema()
    op.execute(f"ALTER TABLE {s}.job_classes ADD COLUMN team text")
