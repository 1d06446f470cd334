"""Preemption: ledger projections, decisions, evictions and the controller's timers."""

from alembic import op

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    schema = current_schema()
    create_outbox_and_inbox(schema)
    # Projection of admission's live allocations: the victim candidates.
    op.execute(
        f"""
        CREATE TABLE {schema}.allocations (
            allocation_id      text PRIMARY KEY,
            job_id             text NOT NULL,
            team               text NOT NULL,
            kind               text NOT NULL,
            priority_class     text NOT NULL,
            pool               text NOT NULL,
            gpu_refs           jsonb NOT NULL,
            gpus               integer NOT NULL,
            checkpointable     boolean NOT NULL,
            started_at         timestamptz NOT NULL,
            last_checkpoint_at timestamptz,
            -- Granted over the team's guaranteed quota: reclaimed first.
            borrowed           boolean NOT NULL DEFAULT false,
            -- The job's trace context, so its eviction continues the job's trace.
            trace              jsonb NOT NULL DEFAULT '{{}}'::jsonb
        )
        """
    )
    op.execute(f"CREATE INDEX allocations_job ON {schema}.allocations (job_id)")
    # Projection of admission's inventory: the NVLink island (or NUMA node) of each GPU,
    # so a victim that frees a whole island can be preferred.
    op.execute(
        f"""
        CREATE TABLE {schema}.gpu_islands (
            node      text NOT NULL,
            gpu_index integer NOT NULL,
            island    text NOT NULL,
            PRIMARY KEY (node, gpu_index)
        )
        """
    )
    # Projection of admission's reservations: shared GPUs lent to inference.
    op.execute(
        f"""
        CREATE TABLE {schema}.lent_gpus (
            node           text NOT NULL,
            idx            integer NOT NULL,
            reservation_id text NOT NULL,
            lent_at        timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (node, idx)
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {schema}.decisions (
            decision_id    text PRIMARY KEY,
            kind           text NOT NULL,
            time           timestamptz NOT NULL,
            reservation_id text,
            inputs         jsonb NOT NULL,
            need           integer NOT NULL,
            victims        jsonb NOT NULL DEFAULT '[]'::jsonb,
            status         text NOT NULL,
            finished_at    timestamptz
        )
        """
    )
    op.execute(
        f"CREATE UNIQUE INDEX decisions_one_in_flight ON {schema}.decisions ((true)) "
        "WHERE status = 'in_flight'"
    )
    op.execute(
        f"""
        CREATE TABLE {schema}.evictions (
            request_id    text PRIMARY KEY,
            decision_id   text NOT NULL REFERENCES {schema}.decisions (decision_id),
            allocation_id text NOT NULL,
            gpus          integer NOT NULL,
            status        text NOT NULL,
            replaces      text REFERENCES {schema}.evictions (request_id),
            requested_at  timestamptz NOT NULL,
            -- Set when the need disappeared and the saga was asked to cancel.
            withdrawn_at  timestamptz,
            finished_at   timestamptz
        )
        """
    )
    op.execute(f"CREATE INDEX evictions_decision ON {schema}.evictions (decision_id)")
    # The eviction rate limit counts the requests of the last minute.
    op.execute(f"CREATE INDEX evictions_requested_at ON {schema}.evictions (requested_at)")
    # One row: the timers live in the database (DESIGN §5), and locking it serializes
    # decisions across replicas.
    op.execute(
        f"""
        CREATE TABLE {schema}.controller (
            id                integer PRIMARY KEY CHECK (id = 1),
            last_change_at    timestamptz,
            last_shortfall_at timestamptz,
            -- The newest pool snapshot (wire JSON) and since when each condition has
            -- held without a break: the windows survive restarts and failovers.
            reading           jsonb,
            reading_id        text,
            reading_at        timestamptz,
            expand_since      timestamptz,
            shrink_since      timestamptz
        )
        """
    )
    op.execute(f"INSERT INTO {schema}.controller (id) VALUES (1)")
