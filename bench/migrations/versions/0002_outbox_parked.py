"""The outbox's parked rows, as every service has them (gpusched.infra.outbox)."""

from gpusched.infra.migrations import create_outbox_parked, current_schema

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    create_outbox_parked(current_schema())
