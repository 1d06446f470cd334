"""Usage and credits by job, for one job's bill (`<p>.api.billing.job`, `gpusched get`)."""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    s = current_schema()
    op.execute(f"CREATE INDEX usage_events_by_job ON {s}.usage_events (job_id)")
    op.execute(f"CREATE INDEX credits_by_job ON {s}.credits (job_id)")
