"""A starving gang's reservation: which nodes it holds, since when, and when it ends.

A gang that waited ``reserve_after`` holds the node where it has the most free GPUs:
GPUs freeing there are kept for it, while smaller jobs use every other node (backfill).
The reservation is stored, so it outlives a restart or a change of leader, and it
ends when the gang is placed, leaves the queue (held, cancelled, failed), or has
waited ``starve_after`` (then it is offered fewer GPUs if it allows, and no longer
holds the cluster hostage). Pure: time is passed in.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING

from .queue import JobState

if TYPE_CHECKING:
    from .store import JobRecord


class ReservationEnd(StrEnum):
    PLACED = "placed"
    TIMED_OUT = "timed_out"
    LEFT_QUEUE = "left_queue"


@dataclass(frozen=True, slots=True)
class Reservation:
    job_id: str
    nodes: tuple[str, ...]
    since: datetime
    reason: str


def lapsed(
    reservation: Reservation, job: JobRecord | None, now: datetime, starve_after: timedelta
) -> ReservationEnd | None:
    """Why ``reservation`` ends before this pass tries its job, or None if it holds."""
    if job is None or job.job_id != reservation.job_id or job.state is not JobState.QUEUED:
        return ReservationEnd.LEFT_QUEUE
    if now - job.submitted_at >= starve_after:
        return ReservationEnd.TIMED_OUT
    return None


def taken_reason(job: JobRecord, node: str, free: int, waited: timedelta) -> str:
    return (
        f"waited {int(waited.total_seconds())} s for {job.gpus.count} GPUs: node {node} "
        f"({free} free now) is held for it as GPUs free up; other nodes keep serving "
        "smaller jobs"
    )


def ended_reason(end: ReservationEnd, job: JobRecord | None, starve_after: timedelta) -> str:
    if end is ReservationEnd.PLACED:
        return "the gang was placed"
    if end is ReservationEnd.TIMED_OUT:
        return (
            f"the gang waited over {int(starve_after.total_seconds())} s: it no longer holds "
            "nodes (it is offered fewer GPUs if it allows)"
        )
    state = "gone" if job is None else str(job.state)
    return f"the job left the queue (it is {state})"


def describe(reservation: Reservation, now: datetime) -> str:
    """The reservation in words, for `gpusched why` and the job's get reply."""
    held = int((now - reservation.since).total_seconds())
    nodes = ", ".join(reservation.nodes)
    return (
        f"reservation: holds node {nodes} for {held} s (since "
        f"{reservation.since.isoformat(timespec='seconds')}): GPUs freeing there are kept "
        f"for it ({reservation.reason})"
    )


def blocking(reservation: Reservation) -> str:
    """Why another job cannot use the reserved nodes, for `gpusched why`."""
    nodes = ", ".join(reservation.nodes)
    return (
        f"reservation: node {nodes} is held for the waiting gang {reservation.job_id} "
        f"(since {reservation.since.isoformat(timespec='seconds')}); other nodes stay open"
    )
