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
from datetime import datetime, timedelta

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import T
from gpusched.domain.ledger import Ledger, LedgerError, Placement, default_pools
from gpusched.domain.quota import usage_of
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory

from . import store, wire
from .catalog import Catalog
from .explain import Attempt, fair_order, find, reservation_target
from .keeper import LedgerKeeper
from .queue import new_allocation_id
from .store import JobRecord

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        catalog: Catalog,
        interval_s: float,
        reserve_after: timedelta = timedelta(minutes=5),
        starve_after: timedelta = timedelta(minutes=30),
    ) -> None:
        self._uow = uow
        self._keeper = keeper
        self._catalog = catalog
        self._interval_s = interval_s
        self._reserve_after = reserve_after
        self._starve_after = starve_after
        # When a waiting job next crosses reserve_after or starve_after: a pass must run
        # then even if nothing else changed.
        self._next_deadline: datetime | None = None
        # The job whose reservation was last audited, so a held reservation is audited
        # once, not on every pass.
        self._reserving: str | None = None
        self._kicked = asyncio.Event()
        # The ledger version after a pass that placed nothing: until the ledger or the
        # queue changes, another pass would place nothing either.
        self._fruitless_at: int | None = None

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
        """Place what fits now; returns how many jobs were placed."""
        async with self._uow() as uow:
            if not forced:
                probe = await store.queue_probe(uow)
                due = self._next_deadline is not None and utcnow() >= self._next_deadline
                if probe.queued == 0 or (
                    probe.unexamined == 0 and probe.ledger_version == self._fruitless_at and not due
                ):
                    return 0
            ledger = await self._keeper.hold(uow)
            now = utcnow()
            usage = usage_of(ledger.allocations.values())
            placed = 0
            newly_waiting: list[tuple[JobRecord, Attempt]] = []
            # Nodes held for the first starving gang: its reservation. Recomputed every
            # pass from the same state, so it lasts while the gang waits, and GPUs freed
            # on those nodes accumulate for it. Later jobs still use every other node
            # (backfill).
            held: frozenset[str] = frozenset()
            reserving: str | None = None
            self._next_deadline = None
            # Priority class first, then DRF across teams, then FIFO.
            for job in fair_order(await store.queued_jobs(uow), ledger, usage):
                waited = now - job.submitted_at
                attempt = self._find(ledger, job, usage, held=held)
                offered = self._fewer(ledger, job, usage, held, waited, attempt)
                if offered is not None:
                    attempt = offered
                if attempt.placement is not None:
                    await self._start(uow, ledger, job, attempt.placement, attempt.borrowed)
                    key = (job.spec.team, attempt.placement.model)
                    usage[key] = usage.get(key, 0) + len(attempt.placement.gpus)
                    placed += 1
                    continue
                if reserving is None and self._reserve_after <= waited < self._starve_after:
                    node = reservation_target(ledger, self._catalog, job, held)
                    if node is not None:
                        held, reserving = held | {node}, job.job_id
                        if self._reserving != job.job_id:
                            await self._audit_reservation(uow, job, node, waited)
                self._note_deadline(job.submitted_at, waited)
                if not job.wait_audited:
                    newly_waiting.append((job, attempt))
            self._reserving = reserving
            for job, attempt in newly_waiting:
                await self._audit_wait(uow, ledger, job, attempt)
            await store.mark_waiting(uow, [job.job_id for job, _ in newly_waiting], now)
            await uow.commit()
        self._fruitless_at = None if placed else self._keeper.version
        if placed:
            log.info("placed %d job(s)", placed)
        return placed

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

    async def _audit_reservation(
        self, uow: UnitOfWork, job: JobRecord, node: str, waited: timedelta
    ) -> None:
        await uow.audit(
            "job.reserving",
            entity=job.job_id,
            reason=(
                f"waited {int(waited.total_seconds())} s for {job.spec.gpus.count} GPUs: "
                f"node {node} is held for it as GPUs free up; other nodes keep serving "
                "smaller jobs"
            ),
            details={"node": node, "waited_s": int(waited.total_seconds())},
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
        try:
            return find(ledger, self._catalog, job, usage, count=count, held=held)
        except LedgerError as exc:
            # One job the ledger refuses must not stop the queue behind it; it stays
            # queued, and its wait is audited.
            log.exception("job %s cannot be placed", job.job_id)
            return Attempt(None, reasons=(f"refused by the ledger: {exc}",))

    async def _start(
        self,
        uow: UnitOfWork,
        ledger: Ledger,
        job: JobRecord,
        placement: Placement,
        borrowed: bool,
    ) -> None:
        granted = ledger.allocate(
            new_allocation_id(),
            placement,
            job.spec.team,
            job.priority_class,
            utcnow(),
            borrowed=borrowed,
        )
        attempt = job.attempt + 1
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
        await store.insert_allocation(uow, granted.allocation, attempt)
        await self._keeper.save(uow, granted.gpus)
        await store.job_started(uow, job.job_id, granted.allocation_id, attempt, warnings, utcnow())
        s = uow.subjects
        host_share = self._catalog.host_share(granted.gpus)
        await uow.emit(
            s.event(uow.source, T.ALLOCATION_GRANTED),
            T.ALLOCATION_GRANTED,
            wire.allocation_granted(granted, job, attempt, ledger, host_share),
            correlation_id=job.job_id,
            trace_headers=job.trace or None,
        )
        await uow.emit(
            s.command("agent", T.START_WORKLOAD),
            T.START_WORKLOAD,
            wire.start_workload(granted, job, attempt, ledger),
            correlation_id=job.job_id,
            trace_headers=job.trace or None,
        )
        await uow.audit(
            "job.placed",
            entity=job.job_id,
            reason=(
                f"{len(granted.gpus)} x {granted.model} free in the {granted.pool} pool"
                + (" (across nodes)" if spans else "")
                + (" (borrowed beyond the team's guaranteed quota)" if borrowed else "")
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
            },
        )

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
