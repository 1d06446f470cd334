"""Ingest: the nodes of the inventory and their GPU counts, failed ones included.

A GPU sample is checked against it: a node outside the inventory, or a GPU index beyond
the node's count, is refused rather than stored.
"""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    schema = current_schema()
    op.execute(
        f"""
        CREATE TABLE {schema}.nodes (
            name text PRIMARY KEY,
            gpus integer NOT NULL
        )
        """
    )
    # Nodes already in the pool membership are known.
    op.execute(
        f"INSERT INTO {schema}.nodes (name, gpus) "
        f"SELECT node, max(idx) + 1 FROM {schema}.gpu_pool GROUP BY node"
    )
