"""The admission schema: the capacity ledger, the job queue and the allocations.

`gpus` is the ledger's GPU slots as a table, written in the same transaction as every
ledger change; the in-memory ledger is rebuilt from `allocations` (live rows) and the
reservation ids on `gpus`. `ledger_state` holds one row: its row lock serializes every
ledger transaction and its version tells a replica whether its in-memory copy is current.
"""

from alembic import op

from gpusched.infra.migrations import create_outbox_and_inbox, current_schema

revision = "0001"
down_revision = None


def upgrade() -> None:
    s = current_schema()
    create_outbox_and_inbox(s)
    op.execute(
        f"""
        CREATE TABLE {s}.nodes (
            name       text PRIMARY KEY,
            pool       text NOT NULL,
            cpu_milli  bigint NOT NULL,
            memory_mib bigint NOT NULL,
            -- GPU index groups: nvlink_islands and numa, each a list of lists
            gpu_groups jsonb NOT NULL DEFAULT '{{}}',
            -- MIG on/off for the node's GPUs; NULL: as the GPU model's MIG table says
            mig        boolean,
            -- local disk in GiB; 0: not stated
            disk_gib   bigint NOT NULL DEFAULT 0,
            -- up, drained (no new placements) or failed (out of the placeable set)
            state      text NOT NULL DEFAULT 'up',
            changed_at timestamptz
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.gpus (
            node           text NOT NULL REFERENCES {s}.nodes (name),
            gpu_index      int NOT NULL,
            model          text NOT NULL,
            memory_mib     bigint NOT NULL,
            pool           text NOT NULL,
            status         text NOT NULL,
            allocation_id  text,
            reservation_id text,
            -- The MIG layout (profile names; empty: none) and its last change, which
            -- rations changes to one per interval per GPU.
            mig_layout        jsonb NOT NULL DEFAULT '[]'::jsonb,
            layout_changed_at timestamptz,
            -- Not yet reported applied by the cluster agent: its slices wait.
            layout_pending    boolean NOT NULL DEFAULT false,
            -- While pending: the layout the agent still has, the GPU's again if the
            -- change fails (reported, or no report within the apply timeout).
            layout_before     jsonb NOT NULL DEFAULT '[]'::jsonb,
            -- A reservation on a GPU training still holds takes effect on its release.
            pending        boolean GENERATED ALWAYS AS
                               (reservation_id IS NOT NULL AND allocation_id IS NOT NULL) STORED,
            PRIMARY KEY (node, gpu_index)
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.jobs (
            job_id          text PRIMARY KEY,
            name            text NOT NULL,
            team            text NOT NULL,
            kind            text NOT NULL,
            priority_class  text NOT NULL,
            spec            jsonb NOT NULL,
            state           text NOT NULL,
            attempt         int NOT NULL DEFAULT 0,
            allocation_id   text,
            resume_from     jsonb,
            idempotency_key text,
            submitted_at    timestamptz NOT NULL,
            updated_at      timestamptz NOT NULL,
            warnings        jsonb NOT NULL DEFAULT '[]'::jsonb,
            -- Set once a scheduling pass found no room, so the wait is audited once.
            wait_audited    boolean NOT NULL DEFAULT false,
            -- The submit's trace context: placements and evictions continue it.
            trace           jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            -- The newest checkpoint the job confirmed (its job events), and when: a
            -- node failure requeues the job from it.
            latest_checkpoint    jsonb,
            latest_checkpoint_at timestamptz,
            -- An inference service's replica target (NULL: its replicas.max) and the
            -- number of its last replica allocation (<job>-r<N>).
            replica_target  int,
            replica_seq     int NOT NULL DEFAULT 0,
            -- Replica failures in a row and when their replacement may be placed (the
            -- restart back-off, replicas.py): in the row, so it outlives this process.
            replica_failures   int NOT NULL DEFAULT 0,
            replica_restart_at timestamptz,
            UNIQUE (team, idempotency_key)
        )
        """
    )
    op.execute(f"CREATE INDEX jobs_by_state ON {s}.jobs (state, submitted_at)")
    # Running inference services, which every scheduling pass tops up to their target:
    # few rows among many running jobs.
    op.execute(
        f"CREATE INDEX jobs_running_services ON {s}.jobs (submitted_at, job_id) "
        "WHERE state = 'running' AND jsonb_typeof(spec->'replicas') = 'object'"
    )
    op.execute(
        f"""
        CREATE TABLE {s}.allocations (
            allocation_id    text PRIMARY KEY,
            job_id           text NOT NULL REFERENCES {s}.jobs (job_id),
            team             text NOT NULL,
            kind             text NOT NULL,
            priority_class   text NOT NULL,
            model            text NOT NULL,
            pool             text NOT NULL,
            gpus             jsonb NOT NULL,
            attempt          int NOT NULL,
            granted_at       timestamptz NOT NULL,
            released_at      timestamptz,
            release_reason   text,
            -- The eviction saga's outcome (completed/forced) for this allocation, which
            -- may arrive before or after the workload stopped.
            eviction_outcome text,
            eviction_saga_id text,
            -- Granted beyond the team's guaranteed quota: preemption reclaims it first.
            borrowed         boolean NOT NULL DEFAULT false,
            -- Part of its one GPU (a fraction or a MIG slice): milli, memory_mib, profile, slice
            share            jsonb,
            -- GPU-seconds since the last confirmed checkpoint, when a node failure ended it.
            lost_gpu_seconds double precision
        )
        """
    )
    op.execute(
        f"CREATE INDEX allocations_live ON {s}.allocations (allocation_id) "
        "WHERE released_at IS NULL"
    )
    # A service's live replicas, counted when the scheduling pass tops services up.
    op.execute(
        f"CREATE INDEX allocations_live_by_job ON {s}.allocations (job_id) "
        "WHERE released_at IS NULL"
    )
    op.execute(
        f"""
        CREATE TABLE {s}.ledger_state (
            id      int PRIMARY KEY CHECK (id = 1),
            version bigint NOT NULL
        )
        """
    )
    op.execute(f"INSERT INTO {s}.ledger_state (id, version) VALUES (1, 0)")
    op.execute(
        f"""
        CREATE TABLE {s}.ledger_commands (
            decision_id    text PRIMARY KEY,
            kind           text NOT NULL,
            reservation_id text NOT NULL,
            applied_at     timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(
        f"""
        CREATE TABLE {s}.reservations (
            -- A starving gang's hold on nodes (one row while it lasts): freeing GPUs
            -- there are kept for it while backfill uses the other nodes.
            job_id text PRIMARY KEY REFERENCES {s}.jobs (job_id),
            nodes  jsonb NOT NULL,
            since  timestamptz NOT NULL,
            reason text NOT NULL
        )
        """
    )
