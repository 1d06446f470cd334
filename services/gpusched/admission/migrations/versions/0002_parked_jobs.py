"""Parked and cancelled jobs, and the allocations the cluster agent reported started.

A job the scheduling pass cannot handle for a reason of its own (a row it cannot read,
a placement that raises) is parked: state `parked`, with the reason, out of the queue
until an operator approves it again or cancels it. `started_at` is set when the agent
reports the allocation's workload started: after an agent restart only those it does
not list any more were interrupted (a start command not yet consumed is still durable).
"""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    s = current_schema()
    op.execute(f"ALTER TABLE {s}.jobs ADD COLUMN parked_reason text")
    op.execute(f"ALTER TABLE {s}.jobs ADD COLUMN parked_at timestamptz")
    # Who cancelled the job and why, while the cancel of a running job is under way.
    op.execute(f"ALTER TABLE {s}.jobs ADD COLUMN cancel_reason text")
    op.execute(f"ALTER TABLE {s}.allocations ADD COLUMN started_at timestamptz")
