"""`gpusched cancel`: an operator ends a job, whatever state it is in.

A job with no live allocation (queued, held, parked, preempted) is cancelled at once: it
leaves the queue and a reservation it held is released. A job with live allocations (a
running job, every replica of a service) becomes `cancelling`: the cluster agent is told
to stop each workload at once (`workload.evict`, forced, saga `cancel-<job>`), and when
the last one reports stopped its allocation is released and the job is `cancelled`
(see ``settle_cancelled``). A finished job cannot be cancelled (`conflict`).

Only the job's state column is read, never its spec: a job whose stored row does not
parse can be cancelled too.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.identity import CallerKind
from gpusched.contracts.messages import ApiError, CancelJob, CancelReply, EvictWorkload, T
from gpusched.contracts.validation import Invalid, parse_request
from gpusched.infra import access
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory

from . import parking, store
from .catalog import ErrorCode, refuse
from .keeper import LedgerKeeper
from .queue import FINISHED, Clock, JobState


def saga_id(job_id: str) -> str:
    """The eviction id of a cancel: the agent's stop report carries it back."""
    return f"cancel-{job_id}"


def who_and_why(request: CancelJob) -> str:
    return f"cancelled by {request.operator}" + (f": {request.reason}" if request.reason else "")


class CancelOps:
    """The cancel request (`<p>.api.jobs.cancel`)."""

    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        kick: Callable[[], None],
        clock: Clock = utcnow,
    ) -> None:
        self._clock = clock
        self._uow = uow
        self._keeper = keeper
        self._kick = kick

    async def cancel(self, raw: bytes) -> CancelReply:
        request = parse_request(CancelJob, raw)
        if isinstance(request, Invalid):
            return CancelReply(ok=False, error=request.error())
        who = access.caller()
        async with self._uow() as uow:
            team = await store.job_team(uow, request.job_id)
        if team is not None and not who.may_act_for(team):
            why = f"it belongs to team {team}; a team cancels its own jobs, an operator any"
            return CancelReply(
                ok=False, error=await access.forbid(self._uow, "cancel", request.job_id, why)
            )
        if who.kind is CallerKind.OPERATOR or who.kind is CallerKind.TEAM:
            # Audited under the identity the credential proves.
            request = request.model_copy(update={"operator": str(who)})
        async with self._uow() as uow:
            # The ledger lock: a cancel and a scheduling pass never interleave.
            await self._keeper.read(uow)
            found = await store.job_state(uow, request.job_id)
            if found is None:
                return CancelReply(
                    ok=False, error=refuse(ErrorCode.NOT_FOUND, f"no job {request.job_id!r}")
                )
            state, _ = found
            if state in FINISHED:
                return CancelReply(
                    ok=False, job_id=request.job_id, state=state, error=_over(request.job_id, state)
                )
            if state == JobState.CANCELLING:
                return CancelReply(ok=True, job_id=request.job_id, state=state)
            now = self._clock()
            live = await store.live_allocations_of(uow, request.job_id)
            reason = who_and_why(request)
            details = {
                "operator": request.operator,
                "reason": request.reason,
                "state_before": state,
            }
            await store.delete_reservations(uow, [request.job_id])
            if not live:
                await store.set_state_only(uow, request.job_id, JobState.CANCELLED, now)
                await uow.audit(
                    "job.cancelled", entity=request.job_id, reason=reason, details=details
                )
                new_state = JobState.CANCELLED
            else:
                await store.set_cancel_reason(uow, request.job_id, reason, now)
                await store.set_state_only(uow, request.job_id, JobState.CANCELLING, now)
                for allocation in live:
                    await uow.emit(
                        uow.subjects.command("agent", T.EVICT_WORKLOAD),
                        T.EVICT_WORKLOAD,
                        EvictWorkload(
                            allocation_id=allocation.allocation_id,
                            job_id=request.job_id,
                            saga_id=saga_id(request.job_id),
                            forced=True,
                        ),
                        correlation_id=request.job_id,
                    )
                await uow.audit(
                    "job.cancelling",
                    entity=request.job_id,
                    reason=f"{reason}; stopping {len(live)} workload(s)",
                    details=details | {"allocation_ids": [a.allocation_id for a in live]},
                )
                new_state = JobState.CANCELLING
            if state == JobState.PARKED:
                await parking.recount(uow)
            await uow.commit()
        self._kick()  # a queued job left, or a reservation ended
        return CancelReply(ok=True, job_id=request.job_id, state=new_state)


def _over(job_id: str, state: str) -> ApiError:
    return refuse(
        ErrorCode.CONFLICT,
        f"job {job_id} is {state} already: only a job not finished can be cancelled",
    )


async def settle_cancelled(
    uow: UnitOfWork, job_id: str, allocation_id: str, now: datetime, causation_id: str
) -> bool:
    """A workload of a job being cancelled stopped (its allocation is released already):
    the job is cancelled once none is left. False if the job is not being cancelled."""
    found = await store.job_state(uow, job_id)
    if found is None or found[0] != JobState.CANCELLING:
        return False
    left = await store.live_allocations_of(uow, job_id)
    if left:
        return True
    await store.set_state_only(uow, job_id, JobState.CANCELLED, now)
    await uow.audit(
        "job.cancelled",
        entity=job_id,
        reason=found[1] or "cancelled",
        details={"last_allocation_id": allocation_id},
        causation_id=causation_id,
    )
    return True
