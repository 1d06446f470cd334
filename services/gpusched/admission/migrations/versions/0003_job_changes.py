"""Every change to a job row is stamped with the transaction that made it.

`changed_xid` is the (epoch-extended) id of the transaction that last inserted or
updated the row, indexed, so the scheduling pass reads only the jobs changed since its
last read, whichever replica or tool changed them, instead of the whole queue: it keeps
the queue in memory (queue.QueueIndex) and asks for `changed_xid >=` the oldest
transaction that was still running at its previous read (store.jobs_changed_since).
"""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    s = current_schema()
    op.execute(
        f"ALTER TABLE {s}.jobs ADD COLUMN changed_xid bigint NOT NULL DEFAULT txid_current()"
    )
    op.execute(
        f"CREATE FUNCTION {s}.jobs_stamp_change() RETURNS trigger LANGUAGE plpgsql AS $$ "
        "BEGIN NEW.changed_xid := txid_current(); RETURN NEW; END $$"
    )
    op.execute(
        f"CREATE TRIGGER jobs_stamp_change BEFORE UPDATE ON {s}.jobs "
        f"FOR EACH ROW EXECUTE FUNCTION {s}.jobs_stamp_change()"
    )
    op.execute(f"CREATE INDEX jobs_changed_xid ON {s}.jobs (changed_xid)")
