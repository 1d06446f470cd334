"""The scheduling pass: the service step around planning.plan.

The pass runs as a singleton loop (the leader replica), woken by a kick (a submit, a
release, GPUs returned) or every schedule interval, and coalesces: kicks during a pass
make one more pass. Correctness does not rest on the singleton: every pass holds the
ledger lock (see keeper), so a pass on another replica would only wait its turn.

What a pass reads and plans is driven by what changed. The queue is held in memory
(queue.QueueIndex), loaded at the first pass and then kept up to date from the job rows
changed since the last read (store.jobs_changed_since: new submits, requeued, cancelled
or edited jobs, whichever replica wrote them). A pass is full (every queued job) when
capacity may have grown: the ledger changed since the pass before (a release, a node
added, GPUs returned), a reservation ended, a service's back-off ended, or the last pass
failed. Otherwise it is incremental: it plans the changed jobs and those that crossed
reserve_after or starve_after since (found by submission time in the index), and none
of the others, which did not fit and still would not. Running services are topped up
by every pass. The decisions are planning.plan's, pure and run in a worker thread, so
the event loop goes on answering the API while a full pass over a deep queue runs;
this module reads, writes and audits.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import TypeVar

from prometheus_client import Counter, Histogram

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import T
from gpusched.domain.inventory import Pool
from gpusched.domain.ledger import JobKind, Ledger, default_pools
from gpusched.domain.quota import usage_of
from gpusched.infra.db import Outgoing, UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import is_outage

from . import mig, parking, store, wire
from .catalog import WHOLE_GPU_MILLI, Catalog
from .credentials import JobCredentials
from .explain import Attempt
from .index import QueueIndex
from .keeper import LedgerKeeper
from .metrics import PASS_FAILURES, PLACEMENTS, SchedulerView
from .planning import Grant, JobFailed, Plan, Reserving, Rules, crossed, plan
from .queue import Clock, JobState
from .reservations import Reservation, ReservationEnd, ended_reason, lapsed
from .store import JobRecord
from .words import models_words

log = logging.getLogger(__name__)
_Item = TypeVar("_Item")

# A pass parks at most this many jobs before it gives up for this tick (each park
# removes one job from the queue, so this only bounds one tick's work).
_MOST_PARKED_PER_PASS = 50
# A plan's events are written this many jobs at a time (a first pass over a deep queue
# audits every job as waiting), and built this many between two turns of the event
# loop (each is a few tens of microseconds of pydantic and JSON).
_WRITE_PART = 200
_BUILD_PART = 25
# An incremental pass over at most this many jobs plans on the event loop (~20 µs a job).
_PLAN_INLINE = 500
# In-memory bookkeeping over many jobs lets the loop run other work this often.
_YIELD_EVERY = 500
# How long a running service whose top-up failed gets no new replica.
_TOPUP_PAUSE = timedelta(minutes=5)

PASS_SECONDS = Histogram(
    "gpusched_admission_pass_seconds",
    "Time of one scheduling pass that planned (full: every queued job; incremental: "
    "the changed ones)",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
PASS_CHANGED = Counter(
    "gpusched_admission_pass_changed_jobs_total",
    "Queued jobs a scheduling pass found new or changed since the pass before",
)


class QueuedJobs:
    """The queue in memory, kept in step with the job rows by their change stamps.

    ``load`` reads the queue once, page by page, each page a short step of the event
    loop, without the ledger lock: whatever changes meanwhile is stamped after its
    mark and read again. From then on each read takes in only the rows changed since
    the last one: queued ones are put in the index, the others dropped. ``any_news``
    reads without the ledger lock (the tick that finds nothing to do takes no lock);
    ``refresh``, under the lock at the start of a pass, reads the rest and returns the
    ids of the queued jobs that changed since the last pass other than by this
    scheduler's own bookkeeping (marking a job audited as waiting is no news to plan on).
    Either read takes its rows in, so no row is parsed twice.
    """

    def __init__(self) -> None:
        self.index = QueueIndex()
        self._mark: int | None = None
        # Taken in since the last pass: queued jobs with news, and whether a job held
        # in the index left the queue.
        self._news: set[str] = set()
        self._left = False

    @property
    def loaded(self) -> bool:
        return self._mark is not None

    async def load(self, uow: UnitOfWork) -> None:
        """The first read of the queue (every queued job is news)."""
        mark = await store.change_mark(uow)
        async for page in store.queued_pages(uow):
            for job in page:
                self.index.put(job)
                self._news.add(job.job_id)
        self._mark = mark

    async def any_news(self, uow: UnitOfWork) -> bool:
        """Whether a job changed since the last pass other than by this scheduler's own
        bookkeeping."""
        if self._mark is None:
            return True
        if await store.any_changed_since(uow, self._mark):
            await self._take_in(uow)
        return bool(self._news) or self._left

    async def refresh(self, uow: UnitOfWork) -> set[str]:
        await self._take_in(uow)
        changed = self._news
        self._news, self._left = set(), False
        PASS_CHANGED.inc(len(changed))
        return changed

    async def _take_in(self, uow: UnitOfWork) -> None:
        assert self._mark is not None, "load the queue first"
        mark = await store.change_mark(uow)
        queued, gone = await store.jobs_changed_since(uow, self._mark, self.index.get)
        self._news |= self._news_in(queued)
        for number, job in enumerate(queued, 1):
            self.index.put(job)
            if number % _YIELD_EVERY == 0:
                await asyncio.sleep(0)
        for job_id in gone:
            self._left = self._left or job_id in self.index
            self.index.drop(job_id)
        self._news -= gone
        self._mark = mark

    def _news_in(self, queued: Sequence[JobRecord]) -> set[str]:
        """The ids of these queued jobs that are new or changed beyond being audited."""
        news: set[str] = set()
        for job in queued:
            held = self.index.get(job.job_id)
            if held is None or dataclasses.replace(held, wait_audited=job.wait_audited) != job:
                news.add(job.job_id)
        return news

    async def audited(self, job_ids: Sequence[str]) -> None:
        """These jobs were just audited as waiting: what the stored rows now say, though
        the rows are not stamped as changed for it (migration 0004)."""
        for number, job_id in enumerate(job_ids, 1):
            self.index.audited(job_id)
            if number % _YIELD_EVERY == 0:
                await asyncio.sleep(0)  # a first pass marks the whole queue


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
        clock: Clock = utcnow,
    ) -> None:
        self._uow = uow
        self._credentials = credentials
        self._keeper = keeper
        self._catalog = catalog
        self._interval_s = interval_s
        self._rules = Rules(catalog, reserve_after, starve_after)
        self._clock = clock
        self._thresholds = (reserve_after, starve_after)
        # Until when the passes so far planned for jobs crossing a threshold, and the
        # earliest end of a service's restart back-off (a full pass runs then).
        self._checked_at: datetime | None = None
        self._retry_at: datetime | None = None
        self._kicked = asyncio.Event()
        self._queue = QueuedJobs()
        # The committed ledger version after this scheduler's last pass: while the
        # ledger is still there, no capacity was freed or added since. None: plan in
        # full next time.
        self._settled: int | None = None
        # The job the pass works on outside plan(), and where: the one to set aside if
        # the pass fails there.
        self._current: tuple[JobRecord, parking.Where | None] | None = None
        # The queue and ledger as the scrape sees them (metrics.py).
        self.view = SchedulerView(clock, leader_for_s=max(30.0, 10 * interval_s))

    def kick(self) -> None:
        """Ask for a pass now (capacity freed or a job queued) instead of at the next tick."""
        self._kicked.set()

    async def tick(self) -> None:
        """One loop turn: wait for a kick up to the interval, then run a pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._kicked.wait(), self._interval_s)
        self._kicked.clear()
        self.view.ticked_at = time.monotonic()
        try:
            await self.run_pass()
        except Exception as exc:
            PASS_FAILURES.labels("outage" if is_outage(exc) else "error").inc()
            raise

    async def run_pass(self) -> int:
        """Place what fits now; returns how many jobs were placed.

        A job the pass fails on for a reason of its own (see parking.py) is parked and
        the pass runs again without it: the failed pass is rolled back whole, so the
        held ledger never keeps half of what it did (the next holder reloads it), and
        the job is parked in a transaction of its own. An outage is raised as it is.
        """
        for _ in range(_MOST_PARKED_PER_PASS):
            self._current = None
            try:
                return await self._pass()
            except Exception as exc:
                self._settled = None
                culprit = self._culprit(exc)
                if culprit is None:
                    raise
                job_id, where = culprit
                PASS_FAILURES.labels("parked").inc()
                log.exception("the scheduling pass failed on job %s", job_id)
                await self._set_aside(job_id, where, exc)
        return await self._pass()

    def _culprit(self, exc: Exception) -> tuple[str, parking.Where | None] | None:
        """The job a failed pass failed on and where (None where: a running service's
        top-up), or None when the failure is not one job's (an outage, a bulk write)."""
        if is_outage(exc):
            return None
        if isinstance(exc, store.UnreadableJob):
            return exc.job_id, parking.Where.UNREADABLE
        if isinstance(exc, JobFailed):
            return exc.job_id, exc.where
        if self._current is None:
            return None
        job, where = self._current
        return job.job_id, where

    async def _set_aside(self, job_id: str, where: parking.Where | None, exc: Exception) -> None:
        reason = parking.reason_for(
            exc.__cause__ if isinstance(exc, JobFailed) and exc.__cause__ is not None else exc
        )
        now = self._clock()
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
        self._queue.index.drop(job_id)

    def _due(self, now: datetime) -> bool:
        """A waiting job crossed reserve_after or starve_after, or a back-off ended, since
        the last pass: time alone gives a pass something to do."""
        if self._retry_at is not None and now >= self._retry_at:
            return True
        if self._checked_at is None:
            return False
        queue = self._queue.index
        for threshold in self._thresholds:
            first = queue.first_submitted_after(self._checked_at - threshold)
            if first is not None and now >= first + threshold:
                return True
        return False

    def _crossed(self, now: datetime) -> set[str]:
        return crossed(self._queue.index, self._thresholds, self._checked_at, now)

    async def _nothing_new(self) -> bool:
        """True when a pass would find nothing to do: no job changed, the ledger is as
        the last pass left it, and nothing is due. Read without the ledger lock."""
        if self._settled is None or not self._queue.loaded or self._due(self._clock()):
            return False
        async with self._uow() as uow:
            version = await store.ledger_version(uow)
            return version == self._settled and not await self._queue.any_news(uow)

    async def _pass(self) -> int:
        if not self._queue.loaded:
            # Before the ledger lock: reading a deep queue takes a while, and nothing
            # that changes meanwhile is missed (see QueuedJobs).
            async with self._uow() as uow:
                await self._queue.load(uow)
        if await self._nothing_new():
            return 0
        started_at = time.perf_counter()
        async with self._uow() as uow:
            ledger = await self._keeper.hold(uow)
            # The version this pass writes, read now: once it commits, the next holder
            # (a release waiting on the lock) may bump the shared keeper before this
            # coroutine runs again, and that version is not one this pass planned on.
            held = self._keeper.version
            # The version committed before this hold: did anyone change the ledger since?
            unchanged = self._settled is not None and held - 1 == self._settled
            # Another replica may have added or removed a node since this one last looked.
            self._catalog.follow(self._keeper.inventory)
            now = self._clock()
            changed = await self._queue.refresh(uow)
            queue = self._queue.index
            self.view.queue, self.view.ledger = queue, ledger
            # The stored reservations that still hold (see reservations.py); the others
            # end now, which frees their nodes for every job.
            reserved, ended = await self._holding(uow, queue, now)
            retry_due = self._retry_at is not None and now >= self._retry_at
            full = not unchanged or retry_due or bool(ended)
            # A job crossing reserve_after may take a reservation, one crossing
            # starve_after may be offered fewer GPUs: planned again like a changed job.
            only = None if full else changed | self._crossed(now)
            outcome: Plan | None = None
            # Running services below their target are topped up by every pass (few).
            services = await store.running_services(uow)
            if only is None or only or services:
                planning = functools.partial(
                    plan, queue, ledger, usage_of(ledger.allocations.values()), reserved, now,
                    self._rules, only=only, services=services,
                )  # fmt: skip
                # Planning a deep queue is long: in a thread, so the event loop goes on
                # answering (the ledger lock keeps every other user of the ledger away
                # meanwhile). A few jobs plan quicker than the hand-over to a thread.
                few = only is not None and len(only) <= _PLAN_INLINE
                self.view.planning = True
                try:
                    outcome = planning() if few else await asyncio.to_thread(planning)
                finally:
                    self.view.planning = False
                ended.extend(
                    (reservation, ReservationEnd.PLACED, job)
                    for reservation, job in outcome.placed_reserved
                )
            await self._end_reservations(uow, ended)
            if outcome is not None:
                await self._write(uow, ledger, outcome, now)
            await uow.commit()
        self._settled = held
        self._checked_at = now
        if outcome is None:
            return 0
        if full or outcome.retry_at is not None:
            # A full pass saw every service; an incremental one only adds back-offs.
            self._retry_at = (
                outcome.retry_at if full or self._retry_at is None
                else min(self._retry_at, outcome.retry_at or self._retry_at)
            )  # fmt: skip
        for grant in outcome.grants:
            queue.drop(grant.job.job_id)
            PLACEMENTS.labels(str(grant.granted.pool), str(grant.job.priority_class)).inc()
        await self._queue.audited([job.job_id for job, _ in outcome.waiting])
        PASS_SECONDS.labels("full" if full else "incremental").observe(
            time.perf_counter() - started_at
        )
        if outcome.placed:
            log.info("placed %d job(s)", outcome.placed)
        return outcome.placed

    async def _holding(
        self, uow: UnitOfWork, queue: QueueIndex, now: datetime
    ) -> tuple[dict[str, Reservation], list[tuple[Reservation, ReservationEnd, JobRecord | None]]]:
        """The stored reservations that still hold, and those that end before this pass."""
        holding: dict[str, Reservation] = {}
        ended: list[tuple[Reservation, ReservationEnd, JobRecord | None]] = []
        for reservation in await store.reservations(uow):
            job = queue.get(reservation.job_id)
            if job is None:
                # Not queued any more: read it for the words of the audit record.
                job = await store.job(uow, reservation.job_id)
            self._current = None if job is None else (job, parking.Where.PLACEMENT)
            end = lapsed(reservation, job, now, self._rules.starve_after)
            if end is None:
                holding[reservation.job_id] = reservation
            else:
                ended.append((reservation, end, job))
        self._current = None
        return holding, ended

    async def _write(self, uow: UnitOfWork, ledger: Ledger, outcome: Plan, now: datetime) -> None:
        """What the plan decided, in a few statements whatever its size."""
        interval = self._catalog.mig_change_interval
        # Each job's own events are built with the job as the pass's current one: a
        # failure there sets that job aside (see _culprit) instead of failing every pass.
        for relayout in outcome.relayouts:
            self._current = (relayout.job, _where(relayout.job))
            await uow.emit_many(
                mig.layout_outgoing(uow, relayout.changed, relayout.reason, interval)
            )
        for reserving in outcome.reserving:
            self._current = None
            await store.insert_reservation(uow, reserving.reservation)
            self._current = (reserving.job, _where(reserving.job))
            await self._audit_reservation(uow, reserving)
        self._current = None
        for job_id, number in outcome.replica_seqs.items():
            await store.set_replica_seq(uow, job_id, number)
        grants = outcome.grants
        if grants:
            await store.insert_allocations(
                uow, [(grant.granted.allocation, grant.attempt) for grant in grants]
            )
            await store.jobs_started(
                uow,
                [
                    (grant.job.job_id, grant.granted.allocation_id, grant.attempt, grant.warnings)
                    for grant in grants
                ],
                now,
            )
            for part in _parts(grants, _WRITE_PART):
                for some in _parts(part, _BUILD_PART):
                    events: list[Outgoing] = []
                    for grant in some:
                        self._current = (grant.job, _where(grant.job))
                        events.extend(self._grant_events(uow, ledger, grant))
                    self._current = None
                    await uow.emit_many(events)
                    await asyncio.sleep(0)
                await uow.flush()
        free: dict[JobKind, dict[Pool, int]] = {}
        for waiting in _parts(outcome.waiting, _WRITE_PART):
            for few in _parts(waiting, _BUILD_PART):
                audits: list[Outgoing] = []
                for job, attempt in few:
                    self._current = (job, _where(job))
                    audits.append(self._wait_audit(uow, ledger, free, job, attempt))
                self._current = None
                await uow.emit_many(audits)
                await asyncio.sleep(0)
            await uow.flush()
            await store.mark_waiting(uow, [job.job_id for job, _ in waiting], now)

    def _grant_events(self, uow: UnitOfWork, ledger: Ledger, grant: Grant) -> list[Outgoing]:
        job, granted, attempt = grant.job, grant.granted, grant.attempt
        spans = granted.spans_nodes
        borrowed = grant.borrowed
        s = uow.subjects
        milli = granted.share.milli if granted.share is not None else WHOLE_GPU_MILLI
        host_share = self._catalog.host_share(granted.gpus, milli)
        trace = job.trace or None
        return [
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
                    wire.placed_words(granted)
                    + (" (across nodes)" if spans else "")
                    + (" (borrowed beyond the team's guaranteed quota)" if borrowed else "")
                    + mig.share_words(granted.share)
                ),
                details={
                    "allocation_id": granted.allocation_id,
                    "attempt": attempt,
                    "gpus": [str(ref) for ref in granted.gpus],
                    "nodes": list(grant.nodes),
                    "spans_nodes": spans,
                    "borrowed": borrowed,
                    "warnings": list(grant.warnings),
                    "resume_from": job.resume_from.checkpoint_id if job.resume_from else None,
                    "share": None if granted.share is None else asdict(granted.share),
                },
            ),
        ]

    async def _audit_reservation(self, uow: UnitOfWork, reserving: Reserving) -> None:
        reservation = reserving.reservation
        await uow.audit(
            "job.reserving",
            entity=reserving.job.job_id,
            reason=reservation.reason,
            details={
                "node": reservation.nodes[0],
                "nodes": list(reservation.nodes),
                "since": reservation.since.isoformat(),
                "waited_s": int(reserving.waited.total_seconds()),
            },
        )

    async def _end_reservations(
        self,
        uow: UnitOfWork,
        ended: Sequence[tuple[Reservation, ReservationEnd, JobRecord | None]],
    ) -> None:
        if not ended:
            return
        await store.delete_reservations(uow, [reservation.job_id for reservation, _, _ in ended])
        for reservation, end, job in ended:
            await uow.audit(
                "job.reservation_released",
                entity=reservation.job_id,
                reason=ended_reason(end, job, self._rules.starve_after),
                details={
                    "nodes": list(reservation.nodes),
                    "since": reservation.since.isoformat(),
                    "end": end,
                },
            )

    def _wait_audit(
        self,
        uow: UnitOfWork,
        ledger: Ledger,
        free: dict[JobKind, dict[Pool, int]],
        job: JobRecord,
        attempt: Attempt,
    ) -> Outgoing:
        """``free``: the free GPUs per pool by job kind, filled as needed (the ledger does
        not change while a plan is written)."""
        pools = free.get(job.kind)
        if pools is None:
            pools = free[job.kind] = {
                pool: len(ledger.free_gpus(pool)) for pool in default_pools(job.kind)
            }
        return uow.audit_event(
            "job.waiting",
            entity=job.job_id,
            reason=(
                f"needs {job.gpus.count} x {models_words(job.gpus.accepted)} in one gang; "
                "free now: " + ", ".join(f"{pool} {count}" for pool, count in pools.items())
            ),
            details={
                "attempt": job.attempt,
                "priority_class": job.priority_class,
                "free": {str(pool): count for pool, count in pools.items()},
                "reasons": list(attempt.reasons),
            },
        )


def _where(job: JobRecord) -> parking.Where | None:
    """Where a failure while writing what the plan decided for ``job`` is set aside: a
    running service's top-up is paused (None), a queued job is parked."""
    if job.state is JobState.RUNNING:
        return None
    return parking.Where.PLACEMENT if job.replicas is None else parking.Where.REPLICAS


def _parts(items: Sequence[_Item], size: int) -> Iterator[Sequence[_Item]]:
    """``items`` in slices of ``size``."""
    for start in range(0, len(items), size):
        yield items[start : start + size]
