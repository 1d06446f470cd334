"""The jobs API (request/reply): submit, get, approve, why and list.

A submit is validated against the static catalogue and queued through the intake's
group commit; it never waits for a scheduling pass (the pass runs in its own loop and
is kicked). Reads take no ledger lock except `why` of a queued job, which asks the
scheduler's own ``find`` on the current ledger.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from pydantic import ValidationError

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.identity import CallerKind
from gpusched.contracts.messages import (
    ApiError,
    ApproveJob,
    ApproveReply,
    GetJob,
    GetReply,
    GpuRef,
    GpuRequest,
    JobKind,
    JobSummary,
    JobView,
    ListJobs,
    ListReply,
    PriorityClassName,
    ReservationView,
    SubmitJob,
    SubmitReply,
    WhyJob,
    WhyReply,
)
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.domain.quota import usage_of
from gpusched.infra import access
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import is_outage

from . import parking, replicas, reservations, store, wire
from .catalog import Catalog, ErrorCode, refuse, submission_warnings
from .explain import find
from .index import FairOrder, QueueIndex
from .intake import Intake, Submission
from .keeper import LedgerKeeper
from .metrics import SUBMITS
from .nodes import newest_checkpoint
from .queue import Clock, JobState

# Jobs put in the fair order between two turns of the event loop (`why` of a job deep in
# a deep queue goes through every job ahead of it).
_YIELD_EVERY = 1000


class JobsApi:
    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        catalog: Catalog,
        kick: Callable[[], None],
        clock: Clock = utcnow,
    ) -> None:
        self._uow = uow
        self._keeper = keeper
        self._catalog = catalog
        self._kick = kick
        self._clock = clock
        self._intake = Intake(uow, kick)

    async def submit(self, raw: bytes) -> SubmitReply:
        reply = await self._submit(raw)
        outcome = "accepted" if reply.ok else "refused"
        SUBMITS.labels(outcome if reply.error is None else str(reply.error.code)).inc()
        return reply

    async def _submit(self, raw: bytes) -> SubmitReply:
        job = parse_request(SubmitJob, raw)
        if isinstance(job, Invalid):
            return SubmitReply(ok=False, error=job.error())
        who = access.caller()
        if not who.may_submit_for(job.team):
            # The team comes from the credential: a team submits for itself only, a
            # cluster agent for the teams its credential names.
            why = (
                f"its credentials do not name team {job.team!r} "
                "(gpusched auth issue --agent NAME --teams ...)"
                if who.kind is CallerKind.AGENT
                else f"the job names team {job.team!r}; submit as that team or as an operator"
            )
            return SubmitReply(
                ok=False, error=await access.forbid(self._uow, "submit", job.team, why)
            )
        refusal = self._catalog.refusal(job)
        if refusal is not None:
            return await self._intake.submit(Submission(job, self._clock(), refusal=refusal))
        warnings = submission_warnings(job)
        held = self._catalog.held_for_approval(job)
        if held:
            warnings.append(
                f"held for approval: {job.priority_class} is above team {job.team}'s max "
                "priority class; an operator runs `gpusched approve <job>`"
            )
        # Written with the submits arriving alongside it, in one transaction (intake).
        return await self._intake.submit(Submission(job, self._clock(), tuple(warnings), held))

    async def get(self, raw: bytes) -> GetReply:
        request = parse_request(GetJob, raw)
        if isinstance(request, Invalid):
            return GetReply(ok=False, error=request.error())
        async with self._uow() as uow:
            await uow.snapshot()  # the job, its allocations and reservation as of one moment
            try:
                job = await store.job(uow, request.job_id)
            except store.UnreadableJob:
                return GetReply(
                    ok=True, job=_unreadable_view(await store.job_row(uow, request.job_id))
                )
            if job is None:
                return GetReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if not access.caller().may_act_for(job.team):
                why = f"it belongs to team {job.team}"
                return GetReply(
                    ok=False, error=await access.forbid(self._uow, "read", job.job_id, why)
                )
            held = None
            if job.allocation_id is not None:
                held = await store.allocation(uow, job.allocation_id)
            reservation = await store.reservation_of(uow, job.job_id)
            service = (
                None if job.replicas is None else await store.live_allocations_of(uow, job.job_id)
            )
        allocated = (
            []
            if held is None
            else [
                GpuRef(node=ref.node, index=ref.index, model=held.allocation.model)
                for ref in held.allocation.gpus
            ]
        )
        if service is not None:
            # A service's GPUs are those of every live replica.
            allocated = [
                GpuRef(node=ref.node, index=ref.index, model=replica.model)
                for replica in service
                for ref in replica.gpus
            ]
        spec = job.spec
        return GetReply(
            ok=True,
            job=JobView(
                job_id=job.job_id,
                name=spec.name,
                team=spec.team,
                kind=spec.kind,
                priority_class=spec.priority_class,
                state=job.state,
                attempt=job.attempt,
                gpus=spec.gpus,
                allocation_id=job.allocation_id,
                allocated=allocated,
                host=spec.host,
                node=None if held is None else held.allocation.node,
                resume_from=job.resume_from,
                # The checkpoint catalogue lives in the checkpoint service; admission knows
                # the one an eviction left and the newest the job confirmed.
                latest_checkpoint=newest_checkpoint(job.resume_from, job.latest_checkpoint),
                submitted_at=job.submitted_at,
                warnings=list(job.warnings),
                share=None if held is None else wire.share(held.allocation),
                reservation=None
                if reservation is None
                else ReservationView(
                    nodes=list(reservation.nodes),
                    since=reservation.since,
                    reason=reservation.reason,
                ),
                replicas=None
                if service is None
                else replicas.view(job, [replica.allocation_id for replica in service]),
                parked_reason=job.parked_reason if job.state is JobState.PARKED else None,
            ),
        )

    async def approve(self, raw: bytes) -> ApproveReply:
        """An operator lets a held job into the queue (audited with who and why)."""
        request = parse_request(ApproveJob, raw)
        if isinstance(request, Invalid):
            return ApproveReply(ok=False, error=request.error())
        who = access.caller()
        if not who.is_operator:
            why = "approving is an operator's decision"
            return ApproveReply(
                ok=False, error=await access.forbid(self._uow, "approve", request.job_id, why)
            )
        if who.kind is CallerKind.OPERATOR:
            # Audited under the name the credential proves, not the one the payload says.
            request = request.model_copy(update={"operator": who.name})
        async with self._uow() as uow:
            # Under the ledger lock, so an approval and a scheduling pass never interleave.
            await self._keeper.read(uow)
            found = await store.job_state(uow, request.job_id)
            if found is not None and found[0] == JobState.PARKED:
                # A retry: back to the queue; the next pass parks it again if it fails again.
                await store.unpark_job(uow, request.job_id, self._clock())
                await uow.audit(
                    "job.unparked",
                    entity=request.job_id,
                    reason=f"{request.operator} retries the parked job"
                    + (f": {request.reason}" if request.reason else ""),
                    details={"operator": request.operator, "reason": request.reason},
                )
                await parking.recount(uow)
                await uow.commit()
                self._kick()
                return ApproveReply(ok=True)
            job = await store.job(uow, request.job_id)
            if job is None:
                return ApproveReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if job.state is not JobState.HELD:
                return ApproveReply(
                    ok=False,
                    error=refuse(
                        ErrorCode.NOT_HELD,
                        f"job {job.job_id} is {job.state}, not held for approval or parked",
                    ),
                )
            await store.set_job_state(uow, job.job_id, JobState.QUEUED, self._clock())
            await uow.audit(
                "job.approved",
                entity=job.job_id,
                reason=f"{request.operator} approved {job.priority_class} for team "
                f"{job.team}" + (f": {request.reason}" if request.reason else ""),
                details={"operator": request.operator, "reason": request.reason},
            )
            await uow.commit()
        self._kick()
        return ApproveReply(ok=True)

    async def why(self, raw: bytes) -> WhyReply:
        """Why a job is where it is, in the scheduler's own terms."""
        request = parse_request(WhyJob, raw)
        if isinstance(request, Invalid):
            return WhyReply(ok=False, error=request.error())
        async with self._uow() as uow:
            try:
                job = await store.job(uow, request.job_id)
            except store.UnreadableJob as exc:
                row = await store.job_row(uow, request.job_id)
                return WhyReply(
                    ok=True,
                    job_id=request.job_id,
                    state=row.state,
                    reasons=_unreadable_words(row, exc),
                )
            if job is None:
                return WhyReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            if not access.caller().may_act_for(job.team):
                why = f"it belongs to team {job.team}"
                return WhyReply(
                    ok=False, error=await access.forbid(self._uow, "read", job.job_id, why)
                )
            if job.state is JobState.RUNNING and job.replicas is not None:
                return await self._why_service(uow, job)
            if job.state is not JobState.QUEUED:
                return WhyReply(
                    ok=True, job_id=job.job_id, state=job.state, reasons=_not_waiting(job)
                )
            # The queue before the ledger lock: reading a deep one takes a while.
            queued = QueueIndex()
            async for page in store.queued_pages(uow):
                for other in page:
                    queued.put(other)
            ledger = await self._keeper.read(uow)
            reserved = {r.job_id: r for r in await store.reservations(uow)}
        usage = usage_of(ledger.allocations.values())
        ahead = []
        for number, other in enumerate(FairOrder.of(queued, ledger, usage), 1):
            if other.job_id == job.job_id:
                break
            ahead.append(other)
            if number % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a deep queue: let the other requests in
        # As the scheduler sees it: nodes reserved for a gang tried before this job.
        blockers = [reserved[other.job_id] for other in ahead if other.job_id in reserved]
        held = frozenset(node for r in blockers for node in r.nodes)
        try:
            attempt = find(ledger, self._catalog, job, usage, held=held, now=self._clock())
        except Exception as exc:
            if is_outage(exc):
                raise
            # What the pass would fail on too: it parks the job, so say that, never "fits".
            return WhyReply(
                ok=True,
                job_id=job.job_id,
                state=job.state,
                reasons=[f"{parking.reason_for(exc)}; the next scheduling pass parks it"],
            )
        reasons = list(attempt.reasons)
        if job.job_id in reserved:
            reasons.insert(0, reservations.describe(reserved[job.job_id], self._clock()))
        if attempt.placement is None:
            reasons.extend(reservations.blocking(r) for r in blockers)
        if job.replicas is not None:
            reasons[:0] = [
                replicas.waiting_words(job, ledger),
                *replicas.backoff_words(job, self._clock()),
            ]
        if attempt.placement is not None and attempt.placement.layout is not None:
            reasons.append(
                f"mig: GPU {attempt.placement.gpus[0]} is empty and may be given MIG layout "
                f"{'+'.join(attempt.placement.layout)}; the next scheduling pass changes it "
                "and places the job once the cluster agent reports the layout applied"
            )
        elif attempt.placement is not None:
            reasons.append(
                "it fits now: the next scheduling pass places it"
                if job.replicas is None
                else "one replica fits now: the next pass places the missing min replicas "
                "if they all fit together"
            )
        if ahead:
            names = ", ".join(
                f"{other.job_id} ({other.priority_class}, team {other.team}, "
                f"{other.gpus.count} GPUs)"
                for other in ahead[:5]
            )
            more = f" and {len(ahead) - 5} more" if len(ahead) > 5 else ""
            reasons.append(
                f"queue: behind {len(ahead)} job(s) tried first (priority class, then fair "
                f"share across teams, then submission order): {names}{more}"
            )
        return WhyReply(ok=True, job_id=job.job_id, state=job.state, reasons=reasons)

    async def _why_service(self, uow: UnitOfWork, job: store.JobRecord) -> WhyReply:
        """A running service: how many replicas it misses and why they are not placed."""
        ledger = await self._keeper.read(uow)
        live = len(replicas.live_replicas(ledger, job.job_id))
        now = self._clock()
        reasons = replicas.short_words(job, live, now)
        if live < job.replicas_wanted and not replicas.backing_off(job, now):
            usage = usage_of(ledger.allocations.values())
            attempt = find(ledger, self._catalog, job, usage, now=now)
            reasons.extend(attempt.reasons)
            if attempt.placement is not None and attempt.placement.layout is not None:
                reasons.append(
                    f"mig: one more replica needs GPU {attempt.placement.gpus[0]} given MIG "
                    f"layout {'+'.join(attempt.placement.layout)} first; it is placed once the "
                    "cluster agent reports the layout applied"
                )
            elif attempt.placement is not None:
                reasons.append("one more replica fits now: the next scheduling pass places it")
        return WhyReply(ok=True, job_id=job.job_id, state=job.state, reasons=reasons)


def _not_waiting(job: store.JobRecord) -> list[str]:
    if job.state is JobState.HELD:
        return [
            f"held for approval: {job.priority_class} is above team {job.team}'s max "
            "priority class; an operator runs `gpusched approve "
            f"{job.job_id}` (or resubmit with a lower class)"
        ]
    if job.state is JobState.RUNNING:
        return [f"not waiting: running as allocation {job.allocation_id}"]
    if job.state is JobState.PREEMPTED:
        return ["evicted: requeued once its eviction saga reports the checkpoint to resume from"]
    if job.state is JobState.PARKED:
        return [
            f"parked: {job.parked_reason or 'the scheduler set it aside'}",
            f"it is not placed: an operator retries it with `gpusched approve {job.job_id}` "
            f"or removes it with `gpusched cancel {job.job_id}`",
        ]
    if job.state is JobState.CANCELLING:
        return [f"{job.cancel_reason or 'cancelled'}; its workloads are being stopped"]
    return [f"not waiting: the job is {job.state}"]


def _unreadable_view(row: Any) -> JobView:
    """What can be shown of a job whose stored spec does not parse: its columns, and
    the spec's GPU request if that part still parses."""
    spec = row.spec if isinstance(row.spec, dict) else {}
    try:
        gpus = GpuRequest.model_validate(spec.get("gpus"))
    except ValidationError:
        gpus = GpuRequest.model_construct(count=0)
    return JobView.model_construct(
        job_id=row.job_id,
        name=row.name,
        team=row.team,
        kind=_member(JobKind, row.kind),
        priority_class=_member(PriorityClassName, row.priority_class),
        state=row.state,
        attempt=row.attempt,
        gpus=gpus,
        allocation_id=row.allocation_id,
        allocated=[],
        resume_from=None,
        latest_checkpoint=None,
        submitted_at=row.submitted_at,
        warnings=[
            "the stored job spec cannot be read; only its columns are shown",
            *(str(w) for w in row.warnings or ()),
        ],
        share=None,
        reservation=None,
        replicas=None,
        parked_reason=row.parked_reason,
    )


def _member(enum: type[StrEnum], value: str) -> Any:
    """The enum member named by a stored column, or the text itself if it names none."""
    try:
        return enum(value)
    except ValueError:
        return value


def _unreadable_words(row: Any, exc: store.UnreadableJob) -> list[str]:
    if row.state == JobState.PARKED:
        return [
            f"parked: {row.parked_reason or exc}",
            f"it is not placed: remove it with `gpusched cancel {row.job_id}`",
        ]
    return [f"{exc}; the next scheduling pass parks it"]


class JobListing:
    """`<p>.api.jobs.list`: jobs by team, state, class and kind, newest first, in pages.

    A team lists its own jobs only (the team comes from its credential); naming
    another team is `forbidden` and audited, like reading another team's job.
    """

    def __init__(self, uow: UnitOfWorkFactory) -> None:
        self._uow = uow

    async def __call__(self, raw: bytes) -> ListReply:
        request = parse_request(ListJobs, raw)
        if isinstance(request, Invalid):
            return ListReply(ok=False, error=request.error())
        who = access.caller()
        if not who.is_operator:
            if who.team is None or request.team not in (None, who.team):
                why = (
                    f"a team lists its own jobs ({who.team}), not team {request.team}'s"
                    if who.team is not None
                    else "only a team (its own jobs) or an operator lists jobs"
                )
                error = await access.forbid(self._uow, "list", request.team or "-", why)
                return ListReply(ok=False, error=error)
            request = request.model_copy(update={"team": who.team})
        async with self._uow() as uow:
            if request.after is not None and not await _listed(uow, request.after, request.team):
                # Unknown, an empty page would read as the end of the list.
                scope = f" among team {request.team}'s jobs" if request.team is not None else ""
                error = ApiError(
                    code=ErrorCode.INVALID,
                    message=f"after: no job {request.after!r}{scope} to list after (the "
                    "cursor is the `next` of a previous page)",
                    field="after",
                )
                return ListReply(ok=False, error=error)
            rows = await store.list_jobs(
                uow,
                team=request.team,
                states=[s.value for s in request.states],
                priority_class=request.priority_class,
                kind=request.kind,
                after=request.after,
                # One more than asked: whether a next page exists, without a count.
                limit=request.limit + 1,
            )
        page = [_summary(row) for row in rows[: request.limit]]
        more = len(rows) > request.limit
        return ListReply(ok=True, jobs=page, next=page[-1].job_id if more and page else None)


async def _listed(uow: UnitOfWork, job_id: str, team: str | None) -> bool:
    """Whether ``job_id`` is a job the listing of ``team`` (None: every team) holds."""
    owner = await store.job_team(uow, job_id)
    return owner is not None and team in (None, owner)


def _summary(row: Any) -> JobSummary:
    gpus = row.gpus if isinstance(row.gpus, dict) else {}
    count, milli, model = gpus.get("count"), gpus.get("milli"), gpus.get("model")
    return JobSummary(
        job_id=row.job_id,
        name=row.name,
        team=row.team,
        kind=row.kind,
        priority_class=row.priority_class,
        state=row.state,
        attempt=row.attempt,
        # A stored spec that no longer parses still lists, with what can be read of it.
        gpus=count if isinstance(count, int) else 0,
        milli=milli if isinstance(milli, int) else None,
        model=model if isinstance(model, str) else None,
        submitted_at=row.submitted_at,
        allocation_id=row.allocation_id,
    )
