"""The scheduling pass's decisions, as a pure function: ``plan(queue, ledger, ...) -> Plan``.

``plan`` reads the queued jobs (a ``QueueIndex``), the capacity ledger, the teams'
usage, the reservations that hold and the time it is given, and says what the pass
does: which jobs get GPUs (``Grant``), which empty MIG GPUs get a new layout, which
starving gang starts holding a node, which jobs are newly waiting and why, and when a
pass must run again even if nothing changes (a job crossing ``reserve_after`` or
``starve_after``, a service's restart back-off ending). It does no I/O and reads no
clock: the admission service writes the Plan (scheduler.py), and a simulator can call
it with its own ledger and time. Its one effect is on the ledger it is handed: it
allocates into it (and changes layouts) as it decides, so each decision sees the ones
before it; a caller that wants to keep its ledger passes a copy.

Order: priority class first, then DRF across teams (the team with the smallest dominant
share goes next), then first in, first out. A pass is either ``full`` (every queued job,
after capacity may have grown) or incremental (``only`` some jobs: the new and changed
ones, when nothing freed since the last pass, so the others would still not fit). An
incremental pass treats every node reserved for another job as held, wherever that job
is in the order: it never takes a node a full pass would have kept.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from gpusched.domain.ledger import (
    AllocationGranted,
    LayoutChanged,
    Ledger,
    Placement,
    default_pools,
)

from . import replicas
from .catalog import Catalog
from .explain import Attempt, find, reservation_target
from .index import FairOrder, QueueIndex
from .parking import Where
from .queue import JobState, Usage, new_allocation_id, shape_of
from .reservations import Reservation, taken_reason
from .store import JobRecord


@dataclass(frozen=True, slots=True)
class Rules:
    """What the pass decides by, besides the ledger: the catalogue (models, quotas,
    sharing) and when a waiting gang reserves a node or is offered fewer GPUs."""

    catalog: Catalog
    reserve_after: timedelta = timedelta(minutes=5)
    starve_after: timedelta = timedelta(minutes=30)


@dataclass(frozen=True, slots=True)
class Grant:
    """GPUs given to a job (or to one replica of a service), already in the ledger."""

    job: JobRecord
    granted: AllocationGranted
    attempt: int
    warnings: tuple[str, ...]
    borrowed: bool
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Relayout:
    """An empty MIG GPU given a new layout for a job, which waits until it is applied."""

    job: JobRecord
    changed: LayoutChanged
    reason: str


@dataclass(frozen=True, slots=True)
class Reserving:
    job: JobRecord
    reservation: Reservation
    waited: timedelta


@dataclass
class Plan:
    grants: list[Grant] = field(default_factory=list)
    relayouts: list[Relayout] = field(default_factory=list)
    # New reservations, and those that end because their gang was placed.
    reserving: list[Reserving] = field(default_factory=list)
    placed_reserved: list[tuple[Reservation, JobRecord]] = field(default_factory=list)
    # Jobs no pass had audited as waiting yet, with why they wait.
    waiting: list[tuple[JobRecord, Attempt]] = field(default_factory=list)
    # Services whose replica counter moved.
    replica_seqs: dict[str, int] = field(default_factory=dict)
    # When a pass must run even if nothing changes (None: no such time): the earliest a
    # waiting job crosses reserve_after or starve_after, and the earliest a service's
    # restart back-off ends.
    next_deadline: datetime | None = None
    retry_at: datetime | None = None
    # Jobs looked at (queued and running services), and jobs placed (a service counts once).
    examined: int = 0
    placed: int = 0


class JobFailed(Exception):
    """Deciding for one job raised: the caller sets the job aside (``where``: None for a
    running service's top-up) and plans again without it. The cause is chained."""

    def __init__(self, job_id: str, where: Where | None) -> None:
        super().__init__(f"planning failed on job {job_id}")
        self.job_id = job_id
        self.where = where


def plan(
    queue: QueueIndex,
    ledger: Ledger,
    usage: Usage,
    reservations: Mapping[str, Reservation],
    now: datetime,
    rules: Rules,
    *,
    only: Collection[str] | None = None,
    services: Sequence[JobRecord] = (),
    allocation_ids: Callable[[], str] = new_allocation_id,
) -> Plan:
    """The pass's decisions for ``queue`` on ``ledger`` at ``now``; see the module doc.

    ``usage``: GPUs each (team, model) holds (changed as jobs are placed);
    ``reservations``: job id -> the reservation that still holds for it (the caller ends
    the others first); ``only``: plan for these queued jobs alone (incremental), None
    for all; ``services``: running inference services below their target, topped up
    after the queue; ``allocation_ids``: makes new allocation ids.
    Raises ``JobFailed`` if deciding for one job raised.
    """
    return _Planner(ledger, rules, now, allocation_ids).run(
        queue, usage, dict(reservations), only, services
    )


def crossed(
    queue: QueueIndex,
    thresholds: Sequence[timedelta],
    since: datetime | None,
    now: datetime,
) -> set[str]:
    """The queued jobs whose wait crossed one of ``thresholds`` (reserve_after,
    starve_after) between the pass at ``since`` and ``now``: an incremental pass plans
    them again, as they may take a reservation or be offered fewer GPUs now.
    O(lines x log n)."""
    if since is None:
        return set()
    return {
        job.job_id
        for threshold in thresholds
        for job in queue.submitted_between(since - threshold, now - threshold)
    }


def _earliest(known: datetime | None, at: datetime) -> datetime:
    return at if known is None or at < known else known


class _Planner:
    def __init__(self, ledger: Ledger, rules: Rules, now: datetime, ids: Callable[[], str]) -> None:
        self.ledger = ledger
        self.rules = rules
        self.now = now
        self.ids = ids
        self.out = Plan()
        # Failed attempts by (shape, team, count), valid until the ledger or the held
        # nodes change: a deep queue of alike jobs costs one search per shape.
        self._failed: dict[tuple[object, ...], Attempt] = {}
        self._held: frozenset[str] = frozenset()
        self._order: FairOrder | None = None

    def run(
        self,
        queue: QueueIndex,
        usage: Usage,
        reserved: dict[str, Reservation],
        only: Collection[str] | None,
        services: Sequence[JobRecord],
    ) -> Plan:
        scope = queue if only is None else queue.subset(only)
        order = self._order = FairOrder.of(scope, self.ledger, usage)
        if only is not None:
            # Incremental: every other job's reserved nodes are held, wherever it is.
            self._hold(
                frozenset(
                    node
                    for job_id, reservation in reserved.items()
                    if job_id not in scope
                    for node in reservation.nodes
                )
            )
        out = self.out
        for job in order:
            out.examined += 1
            where = Where.REPLICAS if job.replicas is not None else Where.PLACEMENT
            try:
                self._one(job, reserved)
            except Exception as exc:
                raise JobFailed(job.job_id, where) from exc
        for service in services:
            out.examined += 1
            try:
                if self._backing_off(service):
                    continue
                batch, _ = self._replicas(service)
            except Exception as exc:
                raise JobFailed(service.job_id, None) from exc
            out.grants.extend(batch)
            out.placed += bool(batch)
        return out

    def _hold(self, nodes: frozenset[str]) -> None:
        if not nodes <= self._held:
            self._held = self._held | nodes
            self._failed.clear()

    def _changed(self) -> None:
        """The ledger changed: an attempt that failed before may succeed now."""
        self._failed.clear()

    def _one(self, job: JobRecord, reserved: dict[str, Reservation]) -> None:
        out, rules, now = self.out, self.rules, self.now
        waited = now - job.submitted_at
        if job.replicas is not None:
            if self._backing_off(job):
                return
            batch, attempt = self._replicas(job)
            if batch:
                out.grants.extend(batch)
                out.placed += 1
                return
        else:
            attempt = self._find(job)
        offered = self._fewer(job, waited, attempt)
        if offered is not None:
            attempt = offered
        if attempt.placement is not None and attempt.placement.layout is not None:
            # A MIG slice that needs a new layout: changed now, placed once the cluster
            # agent reports the layout applied (that report kicks a pass).
            attempt = self._relayout(job, attempt.placement)
        if attempt.placement is not None:
            out.grants.append(self._grant(job, attempt.placement, attempt.borrowed))
            out.placed += 1
            if job.job_id in reserved:
                out.placed_reserved.append((reserved.pop(job.job_id), job))
            return
        if job.job_id in reserved:
            self._hold(frozenset(reserved[job.job_id].nodes))
        elif not reserved and rules.reserve_after <= waited < rules.starve_after:
            taken = self._reservation_for(job, waited)
            if taken is not None:
                reserved[job.job_id] = taken
                self._hold(frozenset(taken.nodes))
                out.reserving.append(Reserving(job, taken, waited))
        self._note_deadline(job.submitted_at, waited)
        if not job.wait_audited:
            out.waiting.append((job, attempt))

    def _find(self, job: JobRecord, count: int | None = None) -> Attempt:
        # A job the ledger refuses with an error raises here: the caller parks it.
        catalog = self.rules.catalog
        team = job.team if catalog.quotas is not None else None
        memo = (shape_of(job), team, count)
        known = self._failed.get(memo)
        if known is not None:
            return known
        attempt = find(self.ledger, catalog, job, self._usage, count=count, held=self._held,
                       now=self.now)  # fmt: skip
        if attempt.placement is None:
            self._failed[memo] = attempt
        return attempt

    @property
    def _usage(self) -> Usage:
        assert self._order is not None
        return self._order.usage

    def _fewer(self, job: JobRecord, waited: timedelta, attempt: Attempt) -> Attempt | None:
        """After starve_after, a job that accepts fewer GPUs gets the most that fit."""
        least = job.gpus.min_count
        if attempt.placement is not None or least is None or waited < self.rules.starve_after:
            return None
        for count in range(job.gpus.count - 1, least - 1, -1):
            fewer = self._find(job, count)
            if fewer.placement is not None:
                return fewer
        return None

    def _backing_off(self, service: JobRecord) -> bool:
        """A failed replica's restart back-off holds the service's placements; a pass
        must run when it ends, whatever else happens."""
        restart_at = service.replica_restart_at
        if restart_at is None or not replicas.backing_off(service, self.now):
            return False
        self.out.retry_at = _earliest(self.out.retry_at, restart_at)
        return True

    def _note_deadline(self, submitted_at: datetime, waited: timedelta) -> None:
        for threshold in (self.rules.reserve_after, self.rules.starve_after):
            if waited < threshold:
                self.out.next_deadline = _earliest(self.out.next_deadline, submitted_at + threshold)

    def _reservation_for(self, job: JobRecord, waited: timedelta) -> Reservation | None:
        ledger = self.ledger
        node = reservation_target(ledger, self.rules.catalog, job, self._held)
        if node is None:
            return None
        free = sum(
            1
            for pool in default_pools(job.kind)
            for ref in ledger.free_gpus(pool)
            if ref.node == node
        )
        return Reservation(job.job_id, (node,), self.now, taken_reason(job, node, free, waited))

    def _relayout(self, job: JobRecord, placement: Placement) -> Attempt:
        """Give an empty MIG GPU the layout ``placement`` needs; the job keeps waiting."""
        assert placement.layout is not None and placement.share is not None
        ref = placement.gpus[0]
        interval = self.rules.catalog.mig_change_interval
        changed = self.ledger.change_layout(ref, placement.layout, self.now, interval)
        self._changed()
        reason = f"job {job.job_id} needs a {placement.share.profile} slice"
        self.out.relayouts.append(Relayout(job, changed, reason))
        return Attempt(
            None,
            reasons=(
                f"mig: GPU {ref} is being given MIG layout {'+'.join(placement.layout)} for "
                "it; it is placed once the cluster agent reports the layout applied",
            ),
        )

    def _grant(
        self,
        job: JobRecord,
        placement: Placement,
        borrowed: bool,
        *,
        allocation_id: str | None = None,
        attempt: int | None = None,
    ) -> Grant:
        """Allocate in the ledger and charge the team (``allocation_id``/``attempt``: a
        service replica's, see replicas.py)."""
        granted = self.ledger.allocate(
            allocation_id or self.ids(), placement, job.team, job.priority_class,
            self.now, borrowed=borrowed,
        )  # fmt: skip
        self._changed()
        assert self._order is not None
        self._order.charge(job.team, granted.model, len(granted.gpus))
        warnings = list(job.warnings)
        if len(placement.gpus) < job.gpus.count:
            warnings.append(
                f"offered {len(placement.gpus)} of {job.gpus.count} GPUs after waiting "
                f"over {int(self.rules.starve_after.total_seconds() // 60)} min (min_count "
                f"{job.gpus.min_count})"
            )
        if granted.spans_nodes:
            warning = f"spans nodes {', '.join(placement.nodes)}: gang traffic crosses the network"
            if warning not in warnings:
                warnings.append(warning)
        return Grant(
            job, granted, attempt or job.attempt + 1, tuple(warnings), borrowed,
            tuple(placement.nodes),
        )  # fmt: skip

    def _replicas(self, service: JobRecord) -> tuple[list[Grant], Attempt]:
        """An inference service's missing replicas, each placed like a job by ``find``:
        up to min all or nothing (while it is queued), then up to its target as they fit."""
        ledger = self.ledger
        live = len(replicas.live_replicas(ledger, service.job_id))
        wanted = service.replicas_wanted - live
        spec = service.replicas
        assert spec is not None  # callers pass services only
        queued = service.state is JobState.QUEUED
        at_least = max(spec.min - live, 0) if queued else 0
        number = service.replica_seq
        attempt_number = service.attempt + 1 if queued else max(service.attempt, 1)
        last = Attempt(None)
        relayout: Placement | None = None

        def place_one() -> Grant | None:
            nonlocal number, last, relayout
            last = self._find(service)
            if last.placement is None:
                return None
            if last.placement.layout is not None:
                # A slice that needs a new MIG layout first: the layout is changed below,
                # and more replicas are placed once the agent reports it applied.
                relayout = last.placement
                return None
            number += 1
            return self._grant(
                service, last.placement, last.borrowed,
                allocation_id=replicas.replica_id(service.job_id, number),
                attempt=attempt_number,
            )  # fmt: skip

        def undo(one: Grant) -> None:
            ledger.release(one.granted.allocation_id, self.now)
            self._changed()
            assert self._order is not None
            self._order.charge(service.team, one.granted.model, -len(one.granted.gpus))

        placed, undone = replicas.place_replicas(at_least, wanted, place_one, undo)
        if undone:
            # A MIG layout changed for an undone replica stays changed: it is stored
            # with every other GPU the ledger's events changed.
            last = Attempt(
                None,
                reasons=(
                    f"replicas: {len(undone)} of the {at_least} needed together fit, so none "
                    "was placed (min replicas are placed all or nothing)",
                ),
            )
        if relayout is not None:
            waiting = self._relayout(service, relayout)
            if not placed:
                last = Attempt(None, reasons=(*last.reasons, *waiting.reasons))
        if placed:
            self.out.replica_seqs[service.job_id] = number
        return placed, last
