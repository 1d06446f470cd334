"""Ingest: pool membership, rolling GPU samples and inference service stats."""

from alembic import op

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    schema = current_schema()
    create_outbox_and_inbox(schema)
    # Projection of admission's ledger: which pool each GPU serves.
    op.execute(
        f"""
        CREATE TABLE {schema}.gpu_pool (
            node           text NOT NULL,
            idx            integer NOT NULL,
            pool           text NOT NULL,
            lent           boolean NOT NULL DEFAULT false,
            pending        boolean NOT NULL DEFAULT false,
            reservation_id text,
            PRIMARY KEY (node, idx)
        )
        """
    )
    # High volume and short-lived: no key, one index for the window scan and pruning.
    op.execute(
        f"""
        CREATE TABLE {schema}.samples (
            node          text NOT NULL,
            idx           integer NOT NULL,
            time          timestamptz NOT NULL,
            util          double precision NOT NULL,
            mem_used_mib  bigint NOT NULL,
            mem_total_mib bigint NOT NULL
        )
        """
    )
    op.execute(f"CREATE INDEX samples_time ON {schema}.samples (time)")
    op.execute(
        f"""
        CREATE TABLE {schema}.service_stats (
            service     text NOT NULL,
            time        timestamptz NOT NULL,
            window_s    double precision NOT NULL,
            requests    bigint NOT NULL,
            queue_depth bigint NOT NULL,
            p50_ms      double precision NOT NULL,
            p99_ms      double precision NOT NULL
        )
        """
    )
    op.execute(f"CREATE INDEX service_stats_latest ON {schema}.service_stats (service, time DESC)")
