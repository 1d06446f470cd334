"""The scheduling pass: place queued jobs on the ledger, in priority order then FIFO.

The pass runs as a singleton loop (the leader replica) every schedule interval, and at
once when kicked (a submit, a release, GPUs returned). Correctness does not rest on
the singleton: every pass holds the ledger lock (see keeper), so a pass on another
replica would only wait its turn; the singleton just avoids replicas racing for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta

from prometheus_client import Counter, Histogram

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import T
from gpusched.domain.ledger import (
    AllocationGranted,
    Ledger,
    Placement,
    default_pools,
)
from gpusched.domain.quota import usage_of
from gpusched.infra.db import Outgoing, UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import is_outage

from . import mig, parking, replicas, store, wire
from .catalog import WHOLE_GPU_MILLI, Catalog
from .credentials import JobCredentials
from .explain import Attempt, fair_order, find, reservation_target
from .keeper import LedgerKeeper
from .queue import JobState, new_allocation_id
from .reservations import Reservation, ReservationEnd, ended_reason, lapsed, taken_reason
from .store import JobRecord

log = logging.getLogger(__name__)

# A pass parks at most this many jobs before it gives up for this tick (each park
# removes one job from the queue, so this only bounds one tick's work).
_MOST_PARKED_PER_PASS = 50
# How long a running service whose top-up failed gets no new replica.
_TOPUP_PAUSE = timedelta(minutes=5)

PASS_SECONDS = Histogram(
    "gpusched_admission_pass_seconds",
    "Time of one scheduling pass that ran (a pass skipped as having nothing to do is not timed)",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PASS_CHANGED = Counter(
    "gpusched_admission_pass_changed_jobs_total",
    "Queued jobs a scheduling pass found new or changed since the pass before",
)


@dataclass(frozen=True, slots=True)
class _Started:
    job: JobRecord
    granted: AllocationGranted
    attempt: int
    warnings: tuple[str, ...]
    events: tuple[Outgoing, ...]


class QueuedJobs:
    """The queued jobs as of this transaction, parsed once per row version.

    Every pass lists the queued ids with their row versions (a small index scan) and
    reads in full only the rows it has not parsed at that version: new submits, requeued
    or changed jobs, whichever replica wrote them. A long waiting queue then costs a
    pass almost nothing to re-read, and nothing has to tell this replica about a change.
    """

    def __init__(self) -> None:
        self._parsed: dict[str, tuple[str, JobRecord]] = {}

    async def read(self, uow: UnitOfWork) -> list[JobRecord]:
        listed = await store.queued_versions(uow)
        stale = [
            job_id
            for job_id, version in listed
            if (known := self._parsed.get(job_id)) is None or known[0] != version
        ]
        fresh = await store.queued_by_id(uow, stale)
        PASS_CHANGED.inc(len(stale))
        parsed: dict[str, tuple[str, JobRecord]] = {}
        for job_id, version in listed:
            if job_id in fresh:
                parsed[job_id] = fresh[job_id]
            elif self._parsed.get(job_id, ("", None))[0] == version:
                parsed[job_id] = self._parsed[job_id]
            # Otherwise it left the queue between the two reads: the next pass sees why.
        self._parsed = parsed
        return [record for _, record in parsed.values()]


class Scheduler:
    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        catalog: Catalog,
        interval_s: float,
        reserve_after: timedelta = timedelta(minutes=5),
        starve_after: timedelta = timedelta(minutes=30),
        credentials: JobCredentials | None = None,
    ) -> None:
        self._uow = uow
        self._credentials = credentials
        self._keeper = keeper
        self._catalog = catalog
        self._interval_s = interval_s
        self._reserve_after = reserve_after
        self._starve_after = starve_after
        # When a waiting job next crosses reserve_after or starve_after: a pass must run
        # then even if nothing else changed.
        self._next_deadline: datetime | None = None
        self._kicked = asyncio.Event()
        self._queue = QueuedJobs()
        # The ledger version after a pass that placed nothing: until the ledger or the
        # queue changes, another pass would place nothing either.
        self._fruitless_at: int | None = None
        # The job the pass works on now, and where (None: a running service's top-up):
        # the one to set aside if the pass fails.
        self._current: tuple[JobRecord, parking.Where | None] | None = None

    def kick(self) -> None:
        """Ask for a pass now (capacity freed or a job queued) instead of at the next tick."""
        self._kicked.set()

    async def tick(self) -> None:
        """One loop turn: wait for a kick up to the interval, then run a pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._kicked.wait(), self._interval_s)
        forced = self._kicked.is_set()
        self._kicked.clear()
        await self.run_pass(forced=forced)

    async def run_pass(self, *, forced: bool = True) -> int:
        """Place what fits now; returns how many jobs were placed.

        A job the pass fails on for a reason of its own (see parking.py) is parked and
        the pass runs again without it: the failed pass is rolled back whole, so the
        held ledger never keeps half of what it did (the next holder reloads it), and
        the job is parked in a transaction of its own. An outage is raised as it is.
        """
        for _ in range(_MOST_PARKED_PER_PASS):
            self._current = None
            try:
                return await self._pass(forced=forced)
            except Exception as exc:
                culprit = self._culprit(exc)
                if culprit is None:
                    raise
                job_id, where = culprit
                log.exception("the scheduling pass failed on job %s", job_id)
                await self._set_aside(job_id, where, exc)
                forced = True
        return await self._pass(forced=True)

    def _culprit(self, exc: Exception) -> tuple[str, parking.Where | None] | None:
        """The job a failed pass failed on and where (None where: a running service's
        top-up), or None when the failure is not one job's (an outage, a bulk write)."""
        if is_outage(exc):
            return None
        if isinstance(exc, store.UnreadableJob):
            return exc.job_id, parking.Where.UNREADABLE
        if self._current is None:
            return None
        job, where = self._current
        return job.job_id, where

    async def _set_aside(self, job_id: str, where: parking.Where | None, exc: Exception) -> None:
        reason = parking.reason_for(exc)
        now = utcnow()
        async with self._uow() as uow:
            # The ledger lock, so no other pass or handler interleaves; read, not held:
            # parking changes no GPU.
            await self._keeper.read(uow)
            if where is None:
                # A running service's top-up: its replicas keep running; no more are
                # placed for a while, as after a crash-looping replica.
                await store.pause_replicas(uow, job_id, now + _TOPUP_PAUSE, now)
                await uow.audit(
                    "replica.topup_failed",
                    entity=job_id,
                    reason=f"{reason}; no replica is placed for it before "
                    f"{(now + _TOPUP_PAUSE).isoformat()}",
                    details={"retry_at": (now + _TOPUP_PAUSE).isoformat()},
                )
                parking.SKIPPED.labels("service_topup").inc()
            else:
                await parking.park(uow, job_id, reason, where, now)
            await uow.commit()

    async def _pass(self, *, forced: bool) -> int:
        async with self._uow() as uow:
            if not forced:
                probe = await store.queue_probe(uow)
                due = self._next_deadline is not None and utcnow() >= self._next_deadline
                # Running services below their target too: capacity may have freed up
                # without a kick (another replica released it, a back-off ended).
                short = await store.short_services(uow, utcnow()) if probe.queued == 0 else 0
                if (probe.queued == 0 and short == 0) or (
                    probe.unexamined == 0 and probe.ledger_version == self._fruitless_at and not due
                ):
                    return 0
            started_at = time.perf_counter()
            ledger = await self._keeper.hold(uow)
            # Another replica may have added or removed a node since this one last looked.
            self._catalog.follow(self._keeper.inventory)
            now = utcnow()
            usage = usage_of(ledger.allocations.values())
            placed = 0
            started: list[_Started] = []
            newly_waiting: list[tuple[JobRecord, Attempt]] = []
            queued = await self._queue.read(uow)
            # The stored reservations that still hold (see reservations.py); the others
            # end now. A gang's nodes are held from its own turn on, so jobs tried
            # before it (higher priority, fairer share) may still use them.
            reserved, ended = await self._holding(uow, queued, now)
            held: frozenset[str] = frozenset()
            self._next_deadline = None
            # Priority class first, then DRF across teams, then FIFO.
            for job in fair_order(queued, ledger, usage):
                waited = now - job.submitted_at
                where = parking.Where.PLACEMENT
                if job.spec.replicas is not None:
                    where = parking.Where.REPLICAS
                self._current = (job, where)
                if job.spec.replicas is not None:
                    if self._backing_off(job, now):
                        continue
                    batch, attempt = await self._replicas(uow, ledger, job, usage, now, held)
                    if batch:
                        started.extend(batch)
                        placed += 1
                        continue
                else:
                    attempt = self._find(ledger, job, usage, held=held)
                offered = self._fewer(ledger, job, usage, held, waited, attempt)
                if offered is not None:
                    attempt = offered
                if attempt.placement is not None and attempt.placement.layout is not None:
                    # A MIG slice that needs a new layout: changed now, placed once the
                    # cluster agent reports the layout applied (that report kicks a pass).
                    attempt = await self._relayout(uow, ledger, job, attempt.placement, now)
                if attempt.placement is not None:
                    started.append(
                        self._grant(uow, ledger, job, attempt.placement, attempt.borrowed, now)
                    )
                    key = (job.spec.team, attempt.placement.model)
                    usage[key] = usage.get(key, 0) + len(attempt.placement.gpus)
                    placed += 1
                    if job.job_id in reserved:
                        ended.append((reserved.pop(job.job_id), ReservationEnd.PLACED, job))
                    continue
                if job.job_id in reserved:
                    held |= set(reserved[job.job_id].nodes)
                elif not reserved and self._reserve_after <= waited < self._starve_after:
                    taken = self._reservation_for(ledger, job, held, waited, now)
                    if taken is not None:
                        reserved[job.job_id] = taken
                        held |= set(taken.nodes)
                        await store.insert_reservation(uow, taken)
                        await self._audit_reservation(uow, job, taken, waited)
                self._note_deadline(job.submitted_at, waited)
                if not job.wait_audited:
                    newly_waiting.append((job, attempt))
            # Running inference services below their replica target: more as they fit.
            for service in await store.running_services(uow):
                if self._backing_off(service, now):
                    continue
                self._current = (service, None)
                batch, _ = await self._replicas(uow, ledger, service, usage, now, held)
                started.extend(batch)
                placed += bool(batch)
            self._current = None
            await self._end_reservations(uow, ended)
            await self._write_started(uow, started, now)
            for job, attempt in newly_waiting:
                self._current = (job, parking.Where.PLACEMENT)
                await self._audit_wait(uow, ledger, job, attempt)
            self._current = None
            await store.mark_waiting(uow, [job.job_id for job, _ in newly_waiting], now)
            await uow.commit()
        PASS_SECONDS.observe(time.perf_counter() - started_at)
        self._fruitless_at = None if placed else self._keeper.version
        if placed:
            log.info("placed %d job(s)", placed)
        return placed

    def _backing_off(self, service: JobRecord, now: datetime) -> bool:
        """A failed replica's restart back-off holds the service's placements; a pass
        must run when it ends, kicked or not."""
        restart_at = service.replica_restart_at
        if restart_at is None or not replicas.backing_off(service, now):
            return False
        if self._next_deadline is None or restart_at < self._next_deadline:
            self._next_deadline = restart_at
        return True

    def _note_deadline(self, submitted_at: datetime, waited: timedelta) -> None:
        for threshold in (self._reserve_after, self._starve_after):
            if waited < threshold:
                due = submitted_at + threshold
                if self._next_deadline is None or due < self._next_deadline:
                    self._next_deadline = due

    def _fewer(
        self,
        ledger: Ledger,
        job: JobRecord,
        usage: dict[tuple[str, str], int],
        held: frozenset[str],
        waited: timedelta,
        attempt: Attempt,
    ) -> Attempt | None:
        """After starve_after, a job that accepts fewer GPUs gets the most that fit."""
        least = job.spec.gpus.min_count
        if attempt.placement is not None or least is None or waited < self._starve_after:
            return None
        for count in range(job.spec.gpus.count - 1, least - 1, -1):
            fewer = self._find(ledger, job, usage, held=held, count=count)
            if fewer.placement is not None:
                return fewer
        return None

    async def _holding(
        self, uow: UnitOfWork, queued: Sequence[JobRecord], now: datetime
    ) -> tuple[dict[str, Reservation], list[tuple[Reservation, ReservationEnd, JobRecord | None]]]:
        """The stored reservations that still hold, and those that end before this pass."""
        by_id = {job.job_id: job for job in queued}
        holding: dict[str, Reservation] = {}
        ended: list[tuple[Reservation, ReservationEnd, JobRecord | None]] = []
        for reservation in await store.reservations(uow):
            job = by_id.get(reservation.job_id)
            if job is None:
                # Not queued any more: read it for the words of the audit record.
                job = await store.job(uow, reservation.job_id)
            self._current = None if job is None else (job, parking.Where.PLACEMENT)
            end = lapsed(reservation, job, now, self._starve_after)
            if end is None:
                holding[reservation.job_id] = reservation
            else:
                ended.append((reservation, end, job))
        self._current = None
        return holding, ended

    def _reservation_for(
        self,
        ledger: Ledger,
        job: JobRecord,
        held: frozenset[str],
        waited: timedelta,
        now: datetime,
    ) -> Reservation | None:
        node = reservation_target(ledger, self._catalog, job, held)
        if node is None:
            return None
        free = sum(
            1
            for pool in default_pools(job.kind)
            for ref in ledger.free_gpus(pool)
            if ref.node == node
        )
        return Reservation(job.job_id, (node,), now, taken_reason(job, node, free, waited))

    async def _audit_reservation(
        self, uow: UnitOfWork, job: JobRecord, reservation: Reservation, waited: timedelta
    ) -> None:
        await uow.audit(
            "job.reserving",
            entity=job.job_id,
            reason=reservation.reason,
            details={
                "node": reservation.nodes[0],
                "nodes": list(reservation.nodes),
                "since": reservation.since.isoformat(),
                "waited_s": int(waited.total_seconds()),
            },
        )

    async def _end_reservations(
        self,
        uow: UnitOfWork,
        ended: Sequence[tuple[Reservation, ReservationEnd, JobRecord | None]],
    ) -> None:
        await store.delete_reservations(uow, [reservation.job_id for reservation, _, _ in ended])
        for reservation, end, job in ended:
            await uow.audit(
                "job.reservation_released",
                entity=reservation.job_id,
                reason=ended_reason(end, job, self._starve_after),
                details={
                    "nodes": list(reservation.nodes),
                    "since": reservation.since.isoformat(),
                    "end": end,
                },
            )

    async def _relayout(
        self, uow: UnitOfWork, ledger: Ledger, job: JobRecord, placement: Placement, now: datetime
    ) -> Attempt:
        """Give an empty MIG GPU the layout ``placement`` needs; the job keeps waiting."""
        assert placement.layout is not None and placement.share is not None
        ref = placement.gpus[0]
        interval = self._catalog.mig_change_interval
        changed = ledger.change_layout(ref, placement.layout, now, interval)
        await self._keeper.save(uow, [ref])
        reason = f"job {job.job_id} needs a {placement.share.profile} slice"
        await uow.emit_many(mig.layout_outgoing(uow, changed, reason, interval))
        return Attempt(
            None,
            reasons=(
                f"mig: GPU {ref} is being given MIG layout {'+'.join(placement.layout)} for "
                "it; it is placed once the cluster agent reports the layout applied",
            ),
        )

    def _find(
        self,
        ledger: Ledger,
        job: JobRecord,
        usage: dict[tuple[str, str], int],
        *,
        held: frozenset[str] = frozenset(),
        count: int | None = None,
    ) -> Attempt:
        # A job the ledger refuses with an error raises here: the pass parks it.
        return find(ledger, self._catalog, job, usage, count=count, held=held, now=utcnow())

    def _grant(
        self,
        uow: UnitOfWork,
        ledger: Ledger,
        job: JobRecord,
        placement: Placement,
        borrowed: bool,
        now: datetime,
        *,
        allocation_id: str | None = None,
        attempt: int | None = None,
    ) -> _Started:
        """Allocate in the held ledger; the rows and events are written with the pass's.

        ``allocation_id``/``attempt``: a service replica's (see replicas.py)."""
        granted = ledger.allocate(
            allocation_id or new_allocation_id(), placement, job.spec.team, job.priority_class,
            now, borrowed=borrowed,
        )  # fmt: skip
        attempt = attempt or job.attempt + 1
        warnings = list(job.warnings)
        if len(placement.gpus) < job.spec.gpus.count:
            warnings.append(
                f"offered {len(placement.gpus)} of {job.spec.gpus.count} GPUs after waiting "
                f"over {int(self._starve_after.total_seconds() // 60)} min (min_count "
                f"{job.spec.gpus.min_count})"
            )
        spans = granted.spans_nodes
        if spans:
            warning = f"spans nodes {', '.join(placement.nodes)}: gang traffic crosses the network"
            if warning not in warnings:
                warnings.append(warning)
        s = uow.subjects
        milli = granted.share.milli if granted.share is not None else WHOLE_GPU_MILLI
        host_share = self._catalog.host_share(granted.gpus, milli)
        trace = job.trace or None
        events = [
            Outgoing(
                s.event(uow.source, T.ALLOCATION_GRANTED),
                T.ALLOCATION_GRANTED,
                wire.allocation_granted(granted, job, attempt, ledger, host_share),
                correlation_id=job.job_id,
                trace_headers=trace,
            ),
            Outgoing(
                s.command("agent", T.START_WORKLOAD),
                T.START_WORKLOAD,
                wire.start_workload(
                    granted,
                    job,
                    attempt,
                    ledger,
                    None if self._credentials is None else self._credentials.issue(job.job_id),
                ),
                correlation_id=job.job_id,
                trace_headers=trace,
            ),
            uow.audit_event(
                "job.placed",
                entity=job.job_id,
                reason=(
                    f"{len(granted.gpus)} x {granted.model} free in the {granted.pool} pool"
                    + (" (across nodes)" if spans else "")
                    + (" (borrowed beyond the team's guaranteed quota)" if borrowed else "")
                    + mig.share_words(granted.share)
                ),
                details={
                    "allocation_id": granted.allocation_id,
                    "attempt": attempt,
                    "gpus": [str(ref) for ref in granted.gpus],
                    "nodes": list(placement.nodes),
                    "spans_nodes": spans,
                    "borrowed": borrowed,
                    "warnings": warnings,
                    "resume_from": job.resume_from.checkpoint_id if job.resume_from else None,
                    "share": None if granted.share is None else asdict(granted.share),
                },
            ),
        ]
        return _Started(job, granted, attempt, tuple(warnings), tuple(events))

    async def _replicas(
        self,
        uow: UnitOfWork,
        ledger: Ledger,
        service: JobRecord,
        usage: dict[tuple[str, str], int],
        now: datetime,
        held: frozenset[str],
    ) -> tuple[list[_Started], Attempt]:
        """An inference service's missing replicas, each placed like a job by ``find``:
        up to min all or nothing (while it is queued), then up to its target as they fit."""
        live = len(replicas.live_replicas(ledger, service.job_id))
        wanted = service.replicas_wanted - live
        spec = service.spec.replicas
        assert spec is not None  # callers pass services only
        queued = service.state is JobState.QUEUED
        at_least = max(spec.min - live, 0) if queued else 0
        number = service.replica_seq
        attempt_number = service.attempt + 1 if queued else max(service.attempt, 1)
        last = Attempt(None)

        relayout: Placement | None = None

        def place_one() -> _Started | None:
            nonlocal number, last, relayout
            last = self._find(ledger, service, usage, held=held)
            if last.placement is None:
                return None
            if last.placement.layout is not None:
                # A slice that needs a new MIG layout first: the layout is changed below,
                # and more replicas are placed once the agent reports it applied.
                relayout = last.placement
                return None
            number += 1
            one = self._grant(
                uow, ledger, service, last.placement, last.borrowed, now,
                allocation_id=replicas.replica_id(service.job_id, number),
                attempt=attempt_number,
            )  # fmt: skip
            key = (service.spec.team, one.granted.model)
            usage[key] = usage.get(key, 0) + len(one.granted.gpus)
            return one

        def undo(one: _Started) -> None:
            ledger.release(one.granted.allocation_id, now)
            key = (service.spec.team, one.granted.model)
            usage[key] -= len(one.granted.gpus)

        placed, undone = replicas.place_replicas(at_least, wanted, place_one, undo)
        if undone:
            # A MIG layout changed for an undone replica stays changed: store and announce it.
            await self._keeper.save(uow, [ref for one in undone for ref in one.granted.gpus])
            await uow.emit_many(
                [
                    event
                    for one in undone
                    for event in one.events
                    if event.message_type not in (T.ALLOCATION_GRANTED, T.START_WORKLOAD, T.AUDIT)
                ]
            )
            last = Attempt(
                None,
                reasons=(
                    f"replicas: {len(undone)} of the {at_least} needed together fit, so none "
                    "was placed (min replicas are placed all or nothing)",
                ),
            )
        if relayout is not None:
            waiting = await self._relayout(uow, ledger, service, relayout, now)
            if not placed:
                last = Attempt(None, reasons=(*last.reasons, *waiting.reasons))
        if placed:
            await store.set_replica_seq(uow, service.job_id, number)
        return placed, last

    async def _write_started(
        self, uow: UnitOfWork, started: Sequence[_Started], now: datetime
    ) -> None:
        """The pass's placements in a few statements, whatever their number."""
        if not started:
            return
        await store.insert_allocations(
            uow, [(one.granted.allocation, one.attempt) for one in started]
        )
        await self._keeper.save(uow, [ref for one in started for ref in one.granted.gpus])
        await store.jobs_started(
            uow,
            [
                (one.job.job_id, one.granted.allocation_id, one.attempt, one.warnings)
                for one in started
            ],
            now,
        )
        await uow.emit_many([event for one in started for event in one.events])

    async def _audit_wait(
        self, uow: UnitOfWork, ledger: Ledger, job: JobRecord, attempt: Attempt
    ) -> None:
        pools = default_pools(job.kind)
        free = {pool: len(ledger.free_gpus(pool)) for pool in pools}
        await uow.audit(
            "job.waiting",
            entity=job.job_id,
            reason=(
                f"needs {job.spec.gpus.count} x {job.spec.gpus.model or 'any model'} in one "
                f"gang; free now: " + ", ".join(f"{pool} {count}" for pool, count in free.items())
            ),
            details={
                "attempt": job.attempt,
                "priority_class": job.priority_class,
                "free": {str(pool): count for pool, count in free.items()},
                "reasons": list(attempt.reasons),
            },
        )
