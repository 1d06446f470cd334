"""The eviction sagas and the checkpoint catalogue."""

from alembic import op

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    schema = current_schema()
    create_outbox_and_inbox(schema)
    # `data` is the whole Saga.to_dict(); the columns beside it are copies kept only so
    # that the constraints and the deadline sweep can be expressed in SQL.
    op.execute(
        f"""
        CREATE TABLE {schema}.sagas (
            saga_id       text PRIMARY KEY,
            request_id    text NOT NULL UNIQUE,
            allocation_id text NOT NULL,
            job_id        text NOT NULL,
            state         text NOT NULL,
            deadline      timestamptz NOT NULL,
            data          jsonb NOT NULL,
            created_at    timestamptz NOT NULL,
            updated_at    timestamptz NOT NULL,
            -- The trace the eviction request came in (the job's): every message the
            -- saga sends continues it, whatever input triggered the step.
            trace         jsonb NOT NULL DEFAULT '{{}}'::jsonb
        )
        """
    )
    # One live eviction per allocation: a second request for the same allocation loses
    # the insert even when two replicas race. The terminal states are spelled out, not
    # imported, so this revision keeps meaning what it meant when it ran.
    op.execute(
        f"""
        CREATE UNIQUE INDEX sagas_one_live_per_allocation ON {schema}.sagas (allocation_id)
        WHERE state NOT IN ('completed', 'cancelled', 'aborted', 'forced')
        """
    )
    op.execute(f"CREATE INDEX sagas_due ON {schema}.sagas (state, deadline)")
    op.execute(f"CREATE INDEX sagas_by_job ON {schema}.sagas (job_id, created_at)")
    # Every confirmation is kept (periodic ones too): the same checkpoint is typically
    # confirmed twice, snapshotted then persisted.
    op.execute(
        f"""
        CREATE TABLE {schema}.checkpoints (
            job_id        text NOT NULL,
            checkpoint_id text NOT NULL,
            stage         text NOT NULL CHECK (stage IN ('snapshotted', 'persisted')),
            request_id    text,
            step          bigint NOT NULL CHECK (step >= 0),
            uri           text NOT NULL,
            bytes         bigint NOT NULL CHECK (bytes >= 0),
            sha256        text NOT NULL,
            confirmed_at  timestamptz NOT NULL,
            PRIMARY KEY (job_id, checkpoint_id, stage)
        )
        """
    )
    op.execute(f"CREATE INDEX checkpoints_latest ON {schema}.checkpoints (job_id, step DESC)")
