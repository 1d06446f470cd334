"""Group commit of job submissions: concurrent submits share one transaction.

A submit is answered only after the transaction holding its job row and its audit
record committed, so every {ok: true} reply is durable and its idempotency key is
taken. Up to WRITERS groups commit at once; while they do, the submits arriving
meanwhile gather for the next, so under load a transaction carries many jobs (one
INSERT for the rows, one for the audit records) and when idle a lone submit commits at
once, without waiting for company.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from gpusched.contracts.messages import ApiError, SubmitJob, SubmitReply
from gpusched.infra import tracing
from gpusched.infra.db import Outgoing, UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import is_outage

from . import store
from .queue import JobState, new_job_id

log = logging.getLogger(__name__)

# Groups committing at once: a submit that arrives while one group commits starts the
# next at once instead of waiting a whole commit for its turn (each group is its own
# transaction of distinct rows; a key taken by both is settled by the raced look-up).
WRITERS = 2


@dataclass(frozen=True, slots=True)
class Submission:
    """One validated submit, decided (refused, held or queued) before it is written."""

    job: SubmitJob
    received_at: datetime
    warnings: tuple[str, ...] = ()
    held: bool = False
    refusal: ApiError | None = None
    # The submit request's span: the job's trace starts here.
    trace: dict[str, str] = field(default_factory=tracing.inject)

    @property
    def state(self) -> JobState:
        return JobState.HELD if self.held else JobState.QUEUED


@dataclass(slots=True)
class _Waiting:
    submission: Submission
    reply: asyncio.Future[SubmitReply]


class Intake:
    def __init__(self, uow: UnitOfWorkFactory, queued: Callable[[], None]) -> None:
        self._uow = uow
        self._queued = queued
        self._waiting: list[_Waiting] = []
        self._writers: set[asyncio.Task[None]] = set()

    async def submit(self, submission: Submission) -> SubmitReply:
        """The reply for ``submission``, once its group has committed (or failed)."""
        waiting = _Waiting(submission, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        if len(self._writers) < WRITERS:
            writer = asyncio.create_task(self._write_groups())
            self._writers.add(writer)
            writer.add_done_callback(self._writers.discard)
        return await waiting.reply

    async def _write_groups(self) -> None:
        while self._waiting:
            group, self._waiting = self._waiting, []
            try:
                await self._commit(group)
            except Exception as exc:
                if is_outage(exc) or len(group) == 1:
                    _fail(group, exc)
                    continue
                # One bad submit must not fail the others: each alone, in turn.
                log.exception("a group of %d submits failed; retrying one by one", len(group))
                for one in group:
                    try:
                        await self._commit([one])
                    except Exception as exc_one:
                        _fail([one], exc_one)

    async def _commit(self, group: Sequence[_Waiting]) -> None:
        replies: list[tuple[_Waiting, SubmitReply]] = []
        queued = False
        async with self._uow() as uow:
            keys = {
                (w.submission.job.team, w.submission.job.idempotency_key)
                for w in group
                if w.submission.job.idempotency_key is not None
            }
            known = await store.job_ids_for_keys(uow, keys)
            new: list[tuple[_Waiting, str]] = []
            audits: list[Outgoing] = []
            for waiting in group:
                s = waiting.submission
                if s.refusal is not None:
                    audits.append(_refused(uow, s, s.refusal))
                    replies.append((waiting, SubmitReply(ok=False, error=s.refusal)))
                    continue
                key = s.job.idempotency_key
                if key is not None and (s.job.team, key) in known:
                    replies.append((waiting, SubmitReply(ok=True, job_id=known[s.job.team, key])))
                    continue
                job_id = new_job_id()
                if key is not None:
                    # A second submit with the same key in this group gets the same job.
                    known[s.job.team, key] = job_id
                new.append((waiting, job_id))
            inserted = await store.insert_jobs(
                uow,
                [
                    store.NewJob(
                        job_id,
                        w.submission.job,
                        w.submission.warnings,
                        w.submission.received_at,
                        w.submission.state,
                        w.submission.trace,
                    )
                    for w, job_id in new
                ],
            )
            raced = {
                (w.submission.job.team, w.submission.job.idempotency_key)
                for w, job_id in new
                if job_id not in inserted and w.submission.job.idempotency_key is not None
            }
            # Another replica committed these keys after our look-up: answer with its jobs.
            winners = await store.job_ids_for_keys(uow, raced) if raced else {}
            for waiting, job_id in new:
                s = waiting.submission
                if job_id in inserted:
                    audits.append(_accepted(uow, s, job_id))
                    replies.append((waiting, SubmitReply(ok=True, job_id=job_id)))
                    queued = queued or not s.held
                else:
                    key = s.job.idempotency_key
                    assert key is not None  # only a key can conflict
                    known_id = winners.get((s.job.team, key), known.get((s.job.team, key)))
                    replies.append((waiting, SubmitReply(ok=True, job_id=known_id)))
            await uow.emit_many(audits)
            await uow.commit()
        for waiting, reply in replies:
            if not waiting.reply.done():
                waiting.reply.set_result(reply)
        if queued:
            self._queued()


def _fail(group: Sequence[_Waiting], exc: Exception) -> None:
    """Answer submits whose transaction failed; nothing of them was stored."""
    if is_outage(exc):
        # The database is away: the endpoint answers `unavailable` (logged once per outage
        # by the edge), and the client submits again with its idempotency key.
        failure: Exception = exc
    else:
        log.exception("a submit could not be stored", exc_info=exc)
        failure = RuntimeError("the job could not be stored; nothing was queued, submit again")
    for one in group:
        if not one.reply.done():
            one.reply.set_exception(failure)


def _refused(uow: UnitOfWork, s: Submission, refusal: ApiError) -> Outgoing:
    # A decision about a well-formed request: audited, nothing else stored.
    return uow.audit_event(
        "job.rejected",
        entity=s.job.team,
        reason=f"{refusal.code}: {refusal.message}",
        details={
            "name": s.job.name,
            "code": refusal.code,
            "kind": s.job.kind.value,
            "priority_class": s.job.priority_class.value,
            "workload": s.job.workload.kind,
            "gpus": s.job.gpus.model_dump(mode="json"),
        },
        trace_headers=s.trace,
    )


def _accepted(uow: UnitOfWork, s: Submission, job_id: str) -> Outgoing:
    job = s.job
    return uow.audit_event(
        "job.held" if s.held else "job.submitted",
        entity=job_id,
        reason=(
            f"held for approval: {job.priority_class} is above team {job.team}'s max"
            if s.held
            else f"queued: {job.priority_class} {job.kind} job of team {job.team}"
        ),
        details={
            "name": job.name,
            "team": job.team,
            "gpus": job.gpus.model_dump(mode="json"),
            "idempotency_key": job.idempotency_key,
            "warnings": list(s.warnings),
        },
        trace_headers=s.trace,
    )
