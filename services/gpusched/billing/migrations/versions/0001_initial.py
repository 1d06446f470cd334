"""The billing ledger: usage events and credits, both append-only."""

from alembic import op

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    schema = current_schema()
    create_outbox_and_inbox(schema)
    # One row per allocation opening and one per closing; an open allocation is one
    # with an `opened` row and no `closed` row. Rows are never changed, so a statement
    # for any past period can be rebuilt exactly.
    op.execute(
        f"""
        CREATE TABLE {schema}.usage_events (
            seq            bigserial PRIMARY KEY,
            allocation_id  text NOT NULL,
            event          text NOT NULL CHECK (event IN ('opened', 'closed')),
            at             timestamptz NOT NULL,
            team           text NOT NULL,
            job_id         text NOT NULL,
            kind           text,
            gpu_milli      jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            cpu_cores      numeric NOT NULL DEFAULT 0,
            memory_gb      numeric NOT NULL DEFAULT 0,
            disk_gb        numeric NOT NULL DEFAULT 0,
            message_id     text NOT NULL,
            recorded_at    timestamptz NOT NULL DEFAULT now(),
            UNIQUE (allocation_id, event)
        )
        """
    )
    op.execute(f"CREATE INDEX usage_events_at ON {schema}.usage_events (event, at)")
    op.execute(
        f"""
        CREATE TABLE {schema}.credits (
            seq               bigserial PRIMARY KEY,
            saga_id           text NOT NULL UNIQUE,
            allocation_id     text NOT NULL,
            team              text NOT NULL,
            job_id            text NOT NULL,
            gpu_model         text NOT NULL,
            lost_gpu_seconds  numeric NOT NULL CHECK (lost_gpu_seconds >= 0),
            at                timestamptz NOT NULL,
            message_id        text NOT NULL,
            recorded_at       timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(f"CREATE INDEX credits_at ON {schema}.credits (at)")
    # The ledger is append-only by construction, not by convention: a correction is a
    # new row, never an edit of a billed one.
    op.execute(
        f"""
        CREATE FUNCTION {schema}.refuse_ledger_change() RETURNS trigger
        LANGUAGE plpgsql AS $$
        BEGIN
            RAISE EXCEPTION 'the billing ledger is append-only (% on % refused)',
                TG_OP, TG_TABLE_NAME;
        END
        $$
        """
    )
    for table in ("usage_events", "credits"):
        op.execute(
            f"CREATE TRIGGER {table}_append_only BEFORE UPDATE OR DELETE ON {schema}.{table} "
            f"FOR EACH ROW EXECUTE FUNCTION {schema}.refuse_ledger_change()"
        )
        op.execute(
            f"CREATE TRIGGER {table}_no_truncate BEFORE TRUNCATE ON {schema}.{table} "
            f"FOR EACH STATEMENT EXECUTE FUNCTION {schema}.refuse_ledger_change()"
        )
