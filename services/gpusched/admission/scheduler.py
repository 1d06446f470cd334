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

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import T
from gpusched.domain.ledger import (
    Ledger,
    LedgerError,
    Placement,
    PlacementRequest,
    default_pools,
)
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory

from . import store, wire
from .catalog import Catalog
from .keeper import LedgerKeeper
from .queue import new_allocation_id, placement_rank
from .store import JobRecord

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        catalog: Catalog,
        interval_s: float,
    ) -> None:
        self._uow = uow
        self._keeper = keeper
        self._catalog = catalog
        self._interval_s = interval_s
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
                if probe.queued == 0 or (
                    probe.unexamined == 0 and probe.ledger_version == self._fruitless_at
                ):
                    return 0
            ledger = await self._keeper.hold(uow)
            now = utcnow()
            jobs = sorted(
                await store.queued_jobs(uow),
                key=lambda job: (placement_rank(job.priority_class), job.submitted_at, job.job_id),
            )
            placed = 0
            newly_waiting: list[JobRecord] = []
            # Later jobs may take GPUs an earlier one cannot use yet (backfill); a
            # reservation for a waiting gang (DESIGN §7) is a later step.
            for job in jobs:
                placement = self._find(ledger, job)
                if placement is not None:
                    await self._start(uow, ledger, job, placement)
                    placed += 1
                elif not job.wait_audited:
                    newly_waiting.append(job)
            for job in newly_waiting:
                await self._audit_wait(uow, ledger, job)
            await store.mark_waiting(uow, [job.job_id for job in newly_waiting], now)
            await uow.commit()
        self._fruitless_at = None if placed else self._keeper.version
        if placed:
            log.info("placed %d job(s)", placed)
        return placed

    def _find(self, ledger: Ledger, job: JobRecord) -> Placement | None:
        for model in self._catalog.models_to_try(job.spec):
            request = PlacementRequest(job.job_id, job.kind, job.spec.gpus.count, model)
            try:
                placement = ledger.place(request)
            except LedgerError:
                # One job the ledger refuses must not stop the queue behind it; it stays
                # queued, and its wait is audited.
                log.exception("job %s cannot be placed", job.job_id)
                return None
            if placement is not None:
                return placement
        return None

    async def _start(
        self, uow: UnitOfWork, ledger: Ledger, job: JobRecord, placement: Placement
    ) -> None:
        granted = ledger.allocate(
            new_allocation_id(), placement, job.spec.team, job.priority_class, utcnow()
        )
        attempt = job.attempt + 1
        warnings = list(job.warnings)
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
            ),
            details={
                "allocation_id": granted.allocation_id,
                "attempt": attempt,
                "gpus": [str(ref) for ref in granted.gpus],
                "nodes": list(placement.nodes),
                "spans_nodes": spans,
                "warnings": warnings,
                "resume_from": job.resume_from.checkpoint_id if job.resume_from else None,
            },
        )

    async def _audit_wait(self, uow: UnitOfWork, ledger: Ledger, job: JobRecord) -> None:
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
            },
        )
