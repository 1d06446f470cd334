"""Parked jobs: a job the scheduler cannot handle for a reason of its own is set aside.

A job whose stored row does not parse, whose placement the ledger refuses with an error,
or whose path through the pass raises for any reason that is not an outage is parked:
state `parked` with the reason, audited (`job.parked`) and counted, and the pass goes on
with the rest of the queue. An operator retries a parked job with `gpusched approve`
or removes it with `gpusched cancel`. An outage (`infra.errors.is_outage`) never parks.
"""

from __future__ import annotations

import logging
from datetime import datetime
from enum import StrEnum

from prometheus_client import Counter, Gauge

from gpusched.domain.ledger import LedgerError
from gpusched.infra.db import UnitOfWork

from . import store

log = logging.getLogger(__name__)

PARKED = Counter(
    "gpusched_admission_jobs_parked_total",
    "Jobs the scheduler set aside because their own data or placement failed",
    ["where"],
)
PARKED_NOW = Gauge("gpusched_admission_parked_jobs", "Jobs in state parked now")
SKIPPED = Counter(
    "gpusched_admission_items_skipped_total",
    "Items a loop skipped because handling them failed (the loop went on)",
    ["loop"],
)


class Where(StrEnum):
    """The part of the scheduling pass that failed on the job."""

    UNREADABLE = "unreadable"  # its stored row does not parse
    PLACEMENT = "placement"  # finding or granting its GPUs raised
    REPLICAS = "replicas"  # placing an inference service's replicas raised
    SETTLE = "settle"  # requeueing or ending it after its workload stopped raised


def reason_for(exc: BaseException, doing: str = "the scheduling pass") -> str:
    """One line for the operator: what failed on this job."""
    if isinstance(exc, store.UnreadableJob):
        return f"{exc}; fix or cancel the job (`gpusched cancel`)"
    text = " ".join(str(exc).split())[:500] or type(exc).__name__
    if isinstance(exc, LedgerError):
        return f"refused by the ledger: {text}"
    return f"{doing} failed on this job: {type(exc).__name__}: {text}"


async def park(uow: UnitOfWork, job_id: str, reason: str, where: Where, now: datetime) -> bool:
    """Park the job (False if it is unknown or finished already) and audit it."""
    before = await store.park_job(uow, job_id, reason, now)
    if before is None:
        return False
    await store.delete_reservations(uow, [job_id])
    await uow.audit(
        "job.parked",
        entity=job_id,
        reason=reason,
        details={"where": where, "state_before": before},
    )
    PARKED.labels(where).inc()
    PARKED_NOW.set(await store.count_parked(uow))
    log.error("job %s parked (%s): %s", job_id, where, reason)
    return True


async def recount(uow: UnitOfWork) -> None:
    PARKED_NOW.set(await store.count_parked(uow))
