"""Ingest: telemetry folded in memory; the database keeps aggregates, not samples.

Each replica writes its telemetry partitions' share of every pool (`pool_partials`,
one row per partition and pool, overwritten at each flush); the per-sample table goes.
A version of the pool membership tells replicas when to reload it.
"""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    schema = current_schema()
    op.execute(f"DROP TABLE {schema}.samples")
    op.execute(
        f"""
        CREATE TABLE {schema}.pool_partials (
            partition integer NOT NULL,
            pool      text NOT NULL,
            util_sum  double precision NOT NULL,
            reporting integer NOT NULL,
            updated   timestamptz NOT NULL,
            version   bigint NOT NULL,  -- of the membership it was folded against
            PRIMARY KEY (partition, pool)
        )
        """
    )
    op.execute(
        f"CREATE TABLE {schema}.membership_version ("
        " version bigint NOT NULL, changed timestamptz NOT NULL DEFAULT now())"
    )
    op.execute(f"INSERT INTO {schema}.membership_version (version) VALUES (0)")
