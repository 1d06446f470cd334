"""A bench schema with nothing but the delivery tables every service has."""

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    create_outbox_and_inbox(current_schema())
