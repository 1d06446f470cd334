"""The priority class of each job the service has seen, from admission's grants and the
eviction requests: which URI schemes a job's claims may use unverified depends on it
(checkpoint.trusted_schemes), and a periodic claim carries no class of its own."""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    s = current_schema()
    op.execute(
        f"""
        CREATE TABLE {s}.job_classes (
            job_id         text PRIMARY KEY,
            priority_class text NOT NULL,
            updated_at     timestamptz NOT NULL
        )
        """
    )
