"""The scheduler's note that it audited a job's wait does not stamp the row as changed.

`changed_xid` tells the scheduling pass which jobs to read again (0003). The pass itself
marks every job it found waiting (`wait_audited`), so each of its marks came back as a
change for it to read and parse once more: after a first pass over a deep queue, every
queued job at once. An update that only sets `wait_audited` (and `updated_at`) keeps the
row's stamp; the scheduler puts the flag in its own copy when it commits. Any other
change, including setting `wait_audited` back to false, stamps the row as before.
"""

from alembic import op

from gpusched.infra.migrations import current_schema

revision = "0004"
down_revision = "0003"

_BOOKKEEPING = "ARRAY['wait_audited', 'updated_at', 'changed_xid']"


def upgrade() -> None:
    s = current_schema()
    op.execute(
        f"CREATE OR REPLACE FUNCTION {s}.jobs_stamp_change() RETURNS trigger "
        "LANGUAGE plpgsql AS $$ BEGIN "
        "IF NEW.wait_audited AND NOT OLD.wait_audited "
        f"AND to_jsonb(NEW) - {_BOOKKEEPING} = to_jsonb(OLD) - {_BOOKKEEPING} THEN "
        "RETURN NEW; END IF; "
        "NEW.changed_xid := txid_current(); RETURN NEW; END $$"
    )
