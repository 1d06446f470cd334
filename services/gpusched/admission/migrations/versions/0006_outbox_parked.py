"""The outbox's parked rows: a row NATS can never take is set aside, not retried
before every other row for ever (gpusched.infra.outbox)."""

from gpusched.infra.migrations import create_outbox_parked, current_schema

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    create_outbox_parked(current_schema())
