"""A probe service's schema: the delivery tables plus one table of applied steps."""

from alembic import op

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    schema = current_schema()
    create_outbox_and_inbox(schema)
    op.execute(f"CREATE TABLE {schema}.steps (job_id text, step int)")
