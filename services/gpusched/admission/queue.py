"""The job queue's vocabulary: job states, the order queued jobs are placed in, ids."""

from __future__ import annotations

import uuid
from enum import StrEnum

from gpusched.domain.ledger import PriorityClass


class JobState(StrEnum):
    # Above its team's max priority class: waits for an operator's approval.
    HELD = "held"
    QUEUED = "queued"
    RUNNING = "running"
    # Evicted by a saga whose outcome (the checkpoint to resume from) has not arrived.
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"
    # Set aside by the scheduler for a reason of its own (an unreadable row, a placement
    # that raised): not placed until an operator approves it again or cancels it.
    PARKED = "parked"
    # An operator cancelled it while it ran: its workloads are being stopped.
    CANCELLING = "cancelling"
    # Ended by an operator (`gpusched cancel`).
    CANCELLED = "cancelled"


# A job in one of these states is over: it cannot be cancelled or retried.
FINISHED = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


# Inference first: it is never made to wait behind training (DESIGN §7).
_PLACEMENT_ORDER = (
    PriorityClass.INFERENCE,
    PriorityClass.P0_URGENT,
    PriorityClass.P1_NORMAL,
    PriorityClass.P2_OFFLINE,
)


def placement_rank(priority_class: PriorityClass) -> int:
    """Queued jobs are tried by this rank, then first in, first out."""
    return _PLACEMENT_ORDER.index(priority_class)


def new_job_id() -> str:
    # Hex only, so the id is safe as a subject token (`<p>.jobs.<job_id>.events`).
    return f"job-{uuid.uuid4().hex[:12]}"


def new_allocation_id() -> str:
    return f"alloc-{uuid.uuid4().hex[:12]}"


class EvictionOutcome(StrEnum):
    """How the eviction saga of an allocation ended, when it ended in an eviction."""

    COMPLETED = "completed"
    FORCED = "forced"
