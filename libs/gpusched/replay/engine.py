"""The replay's event loop: one policy, one workload, one demand curve, a virtual clock.

The decisions are the services' own functions; this module is the glue the services
have around them, without the bus and the database:
- admission: the scheduling pass is ``planning.plan`` on the ``Ledger``, full when
  capacity may have grown since the pass before and incremental otherwise (as
  ``scheduler.py`` decides), with the reservations of starving gangs ended by
  ``reservations.lapsed``; lending uses ``lending.to_reserve``/``lent_to_return``, and
  an eviction called off returns ``lending.waiting_for``;
- preemption: each reading is folded into the windows (``signals.fold``) and
  ``policy.decide`` runs on the view its store would give (lent reservations, shared
  GPUs in use, victim candidates, the decision in flight); an aborted eviction gets
  ``policy.replacement``; the cooldown runs from the end of a change;
- checkpoint: one saga per eviction (``saga.begin``/``saga.decide``, the class policies
  of ``checkpoint.policy.EvictionPolicies``), its effects carried out as the services
  would: a checkpoint request is answered by the job after its checkpoint time, an
  evict command stops the workload ``stop_s`` later;
- the cluster: inference demand is served by the GPUs that serve inference (the
  inference pool and the lent GPUs training has left), as the simulated cluster
  models it (``simcluster.load``); a training job progresses while it runs, takes a
  periodic checkpoint every interval, and resumes from its newest checkpoint.

Pure: time is the virtual clock's, nothing is read or written.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from enum import IntEnum
from typing import Any

from gpusched.admission import lending
from gpusched.admission.catalog import Catalog
from gpusched.admission.index import QueueIndex
from gpusched.admission.planning import JobFailed, Rules, crossed, plan
from gpusched.admission.queue import JobState
from gpusched.admission.reservations import Reservation, lapsed
from gpusched.admission.store import JobRecord
from gpusched.contracts.messages import GpuRequest, JobKind, PriorityClassName, SubmitJob
from gpusched.domain import saga as sg
from gpusched.domain.elastic import VictimCandidate, choose_victims
from gpusched.domain.inventory import GpuRef, Inventory, Pool
from gpusched.domain.ledger import GpuStatus, Ledger
from gpusched.domain.placement import fragmented_gpus
from gpusched.domain.pricing import PriceBook
from gpusched.domain.quota import usage_of
from gpusched.infra.settings import AdmissionSettings
from gpusched.preemption import policy as controller
from gpusched.preemption.signals import HeldSignals, PoolFigures, PoolReading, fold
from gpusched.simcluster.load import TRAINING_UTIL, LatencyModel

from .demand import DemandCurve
from .metrics import EPOCH, Recorder, RunResult
from .policies import Kind, Policy, most_recent_first
from .workload import WHOLE_GPU_MILLI, TrainingJob, Workload

__all__ = ["EPOCH", "EngineParams", "replay"]

RATE_WINDOW = timedelta(seconds=controller.EVICTION_RATE_WINDOW_S)


@dataclass(frozen=True, slots=True)
class EngineParams:
    horizon_s: float
    # Readings and controller decisions (the services: a snapshot every 2 s, a decision
    # every second); SLO figures are integrated at this step.
    decide_every_s: float = 30.0
    # Passes coalesce the changes of this long (the service: a kick, or every second).
    pass_every_s: float = 30.0
    sample_every_s: float = 300.0
    # From an evict command to the workload stopped (SIGTERM, exit).
    stop_s: float = 10.0
    slo_ms: float = 200.0
    latency: LatencyModel = field(default_factory=LatencyModel)
    reserve_after_s: float = AdmissionSettings().reserve_after_s
    starve_after_s: float = AdmissionSettings().starve_after_s

    def __post_init__(self) -> None:
        for name in ("horizon_s", "decide_every_s", "pass_every_s", "sample_every_s", "slo_ms"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        if not (math.isfinite(self.stop_s) and self.stop_s >= 0):
            raise ValueError(f"stop_s must be >= 0, got {self.stop_s}")


class Ev(IntEnum):
    # Order among events of one instant: what ends first, then what starts, then decides.
    FINISH = 0
    STOPPED = 1
    KILL = 2
    CONFIRM = 3
    DEADLINE = 4
    ARRIVAL = 5
    PASS = 6
    TICK = 7


@dataclass
class _Job:
    spec: TrainingJob
    record: JobRecord
    attempt: int = 0
    allocation_id: str | None = None
    started_at: float | None = None  # this attempt's start (seconds)
    base: float = 0.0  # progress this attempt resumed from
    # The newest checkpoint taken on request in this attempt: (its time, its progress).
    asked: tuple[float, float] | None = None
    first_started: float | None = None
    finished: float | None = None
    lost_gpu_s: float = 0.0
    ran_gpu_s: float = 0.0
    # The newest verified checkpoint of any attempt (seconds), for victim ranking.
    checkpoint_at: float | None = None

    def progress(self, now: float) -> float:
        assert self.started_at is not None
        return self.base + (now - self.started_at)

    def resume_point(self, now: float, periodic_s: float) -> tuple[float | None, float]:
        """The newest checkpoint at ``now``: (when it was taken, the progress it holds)."""
        assert self.started_at is not None
        ran = now - self.started_at
        taken = math.floor(ran / periodic_s) * periodic_s if ran >= periodic_s else None
        best: tuple[float | None, float] = (None, self.base)
        if taken is not None:
            best = (self.started_at + taken, self.base + taken)
        if self.asked is not None and self.asked[0] <= now and self.asked[1] > best[1]:
            best = self.asked
        return best


@dataclass
class _Eviction:
    request_id: str
    decision_id: str
    allocation_id: str
    job_id: str
    gpus: int
    requested_at: datetime
    open: bool = True
    withdrawn: bool = False


@dataclass
class _Decision:
    decision_id: str
    reservation_id: str | None
    tried: set[str] = field(default_factory=set)


def replay(
    policy: Policy,
    inventory: Inventory,
    workload: Workload,
    demand: DemandCurve,
    params: EngineParams,
    *,
    periodic_s: float,
    book: PriceBook,
    progress: Callable[[float], None] | None = None,
) -> RunResult:
    """Replay ``workload`` under ``policy``; ``progress`` is told the share done."""
    return _Engine(policy, inventory, workload, demand, params, periodic_s, book, progress).run()


class _Engine:
    def __init__(
        self,
        policy: Policy,
        inventory: Inventory,
        workload: Workload,
        demand: DemandCurve,
        params: EngineParams,
        periodic_s: float,
        book: PriceBook,
        progress: Callable[[float], None] | None,
    ) -> None:
        self.policy = policy
        self.book = book
        self.inventory = inventory
        self.demand = demand
        self.p = params
        self.periodic_s = periodic_s
        self.progress = progress
        self.ledger = Ledger.from_inventory(inventory)
        self.rules = Rules(
            Catalog(inventory),
            reserve_after=timedelta(seconds=params.reserve_after_s),
            starve_after=timedelta(seconds=params.starve_after_s),
        )
        self.dedicated = inventory.gpus_in(Pool.INFERENCE)
        self.shared_total = inventory.gpus_in(Pool.SHARED)
        self.queue = QueueIndex()
        self.jobs: dict[str, _Job] = {}
        self.by_allocation: dict[str, str] = {}
        self.events: list[tuple[float, int, int, Ev, Any]] = []
        self.seq = itertools.count()
        self.ids = itertools.count()
        self.now = 0.0
        # Admission: what the next pass must look at.
        self.reservations: dict[str, Reservation] = {}
        self.capacity_grew = True
        self.changed_jobs: set[str] = set()
        self.checked_at: datetime | None = None
        self.pass_at: float | None = None
        # Preemption: the controller's row, decisions and evictions.
        self.held = HeldSignals()
        self.last_change_at: datetime | None = None
        self.last_shortfall_at: datetime | None = None
        self.decision: _Decision | None = None
        self.evictions: dict[str, _Eviction] = {}
        self.recent: deque[datetime] = deque()
        self.lent_at: dict[str, datetime] = {}
        # Checkpoint: the live saga of each allocation.
        self.sagas: dict[str, sg.Saga] = {}
        self.saga_of: dict[str, str] = {}
        # Kubernetes: desired serving GPUs over the stabilization window; victims dying.
        self.desired: deque[tuple[float, int]] = deque()
        self.dying: set[str] = set()
        self.rec = Recorder(policy.name, inventory, params.slo_ms)
        self.ledger_version = 0
        self.lent_cache: tuple[int, dict[str, int]] = (-1, {})
        self.shared_cache: tuple[int, PoolFigures, int] = (-1, PoolFigures(0, 0.0, 0), 0)
        for job in workload.jobs:
            self.jobs[job.job_id] = _Job(job, _record(job))
            self._at(job.arrival_s, Ev.ARRIVAL, job.job_id)
        self._at(0.0, Ev.TICK, None)

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> RunResult:
        horizon = self.p.horizon_s
        reported = -1
        next_sample = 0.0
        while self.events and self.events[0][0] <= horizon:
            t, _, _, kind, payload = heapq.heappop(self.events)
            while next_sample <= t:
                self._sample(next_sample)
                next_sample += self.p.sample_every_s
            self.now = t
            self._handle(kind, payload)
            if self.progress is not None and int(100 * t / horizon) > reported:
                reported = int(100 * t / horizon)
                self.progress(min(1.0, t / horizon))
        while next_sample <= horizon:
            self._sample(next_sample)
            next_sample += self.p.sample_every_s
        self.now = horizon
        return self._finish()

    def _at(self, t: float, kind: Ev, payload: Any) -> None:
        heapq.heappush(self.events, (t, kind.value, next(self.seq), kind, payload))

    def _handle(self, kind: Ev, payload: Any) -> None:
        match kind:
            case Ev.ARRIVAL:
                self._arrive(payload)
            case Ev.FINISH:
                self._finished(*payload)
            case Ev.PASS:
                self.pass_at = None
                self._pass()
            case Ev.TICK:
                self._tick()
                self._at(self.now + self.p.decide_every_s, Ev.TICK, None)
            case Ev.CONFIRM:
                self._confirmed(*payload)
            case Ev.DEADLINE:
                self._saga_input(payload, sg.DeadlineReached(self._time()))
            case Ev.STOPPED:
                self._stopped(payload)
            case Ev.KILL:
                self._killed(payload)

    def _time(self, t: float | None = None) -> datetime:
        return EPOCH + timedelta(seconds=self.now if t is None else t)

    def _kick(self, capacity: bool = False) -> None:
        self.ledger_version += 1
        self.capacity_grew = self.capacity_grew or capacity
        step = self.p.pass_every_s
        at = math.ceil(self.now / step) * step
        if self.pass_at is None or at < self.pass_at:
            self.pass_at = at
            self._at(at, Ev.PASS, None)

    # --- jobs and the scheduling pass (admission) ---------------------------------------

    def _arrive(self, job_id: str) -> None:
        job = self.jobs[job_id]
        self.queue.put(job.record)
        self.changed_jobs.add(job_id)
        self.rec.arrived(job.spec)
        self._kick()

    def _pass(self) -> None:
        now = self._time()
        starve = self.rules.starve_after
        held: dict[str, Reservation] = {}
        ended = False
        for job_id, reservation in list(self.reservations.items()):
            if lapsed(reservation, self.queue.get(job_id), now, starve) is None:
                held[job_id] = reservation
            else:
                ended = True
                del self.reservations[job_id]
        full = self.capacity_grew or ended
        thresholds = (self.rules.reserve_after, starve)
        only = (
            None
            if full
            else self.changed_jobs | crossed(self.queue, thresholds, self.checked_at, now)
        )
        while True:
            try:
                outcome = plan(
                    self.queue,
                    self.ledger,
                    usage_of(self.ledger.allocations.values()),
                    held,
                    now,
                    self.rules,
                    only=only,
                    allocation_ids=self._allocation_id,
                )
                break
            except JobFailed as failed:
                # The service parks the job and plans again without it.
                self.queue.drop(failed.job_id)
                self.rec.parked += 1
        self.capacity_grew = False
        self.changed_jobs.clear()
        self.checked_at = now
        for reserving in outcome.reserving:
            self.reservations[reserving.job.job_id] = reserving.reservation
        for reservation, _ in outcome.placed_reserved:
            self.reservations.pop(reservation.job_id, None)
        for waiting, _ in outcome.waiting:
            marked = replace(waiting, wait_audited=True)
            self.jobs[waiting.job_id].record = marked
            self.queue.put(marked)
        if outcome.grants:
            self.ledger_version += 1
        for grant in outcome.grants:
            self._start(grant.job.job_id, grant.granted.allocation_id)
        if outcome.next_deadline is not None:
            # On the pass grid, so the passes of many waiting jobs' deadlines coalesce.
            step = self.p.pass_every_s
            at = math.ceil((outcome.next_deadline - EPOCH).total_seconds() / step) * step
            if self.pass_at is None or at < self.pass_at:
                self.pass_at = at
                self._at(at, Ev.PASS, None)

    def _allocation_id(self) -> str:
        return f"alloc-{next(self.ids)}"

    def _start(self, job_id: str, allocation_id: str) -> None:
        job = self.jobs[job_id]
        self.queue.drop(job_id)
        job.attempt += 1
        job.allocation_id = allocation_id
        job.started_at = self.now
        job.asked = None
        if job.first_started is None:
            job.first_started = self.now
            self.rec.started(job.spec, self.now - job.spec.arrival_s)
        job.record = replace(
            job.record, state=JobState.RUNNING, attempt=job.attempt, allocation_id=allocation_id
        )
        self.by_allocation[allocation_id] = job_id
        gpus = self.ledger.allocation(allocation_id).gpus
        self.rec.decided(self.now, "placed", job_id, ",".join(map(str, gpus)))
        left = job.spec.work_s - job.base
        self._at(self.now + left, Ev.FINISH, (job_id, job.attempt))

    def _finished(self, job_id: str, attempt: int) -> None:
        job = self.jobs[job_id]
        if job.attempt != attempt or job.allocation_id is None or job.finished is not None:
            return  # an attempt that was evicted before it could finish
        if job.allocation_id in self.dying:
            return  # killed: the kill ends it
        allocation_id = job.allocation_id
        self._end_attempt(job, lost=0.0)
        job.finished = self.now
        self.rec.completed(job.spec, self.now - job.spec.arrival_s)
        request_id = self.saga_of.get(allocation_id)
        if request_id is not None:
            self._saga_input(request_id, sg.JobFinished(job_id, True))

    def _end_attempt(self, job: _Job, lost: float) -> None:
        """Release the attempt's allocation; ``lost``: seconds of its progress thrown away."""
        assert job.allocation_id is not None and job.started_at is not None
        allocation = self.ledger.allocation(job.allocation_id)
        self.ledger.release(job.allocation_id, self._time())
        ran = self.now - job.started_at
        job.ran_gpu_s += job.spec.gpu_share * ran
        job.lost_gpu_s += job.spec.gpu_share * lost
        self.rec.ran(job.spec, allocation, ran, lost, self.now)
        job.base = job.progress(self.now) - lost
        del self.by_allocation[job.allocation_id]
        job.allocation_id = None
        job.started_at = None
        self._kick(capacity=True)

    def _requeue(self, job: _Job) -> None:
        job.record = replace(
            job.record, state=JobState.QUEUED, allocation_id=None, wait_audited=False
        )
        self.queue.put(job.record)
        self.changed_jobs.add(job.spec.job_id)
        self._kick()

    def _evict(self, job: _Job, *, forced: bool) -> None:
        """The workload stops: it resumes from its newest checkpoint."""
        assert job.started_at is not None
        _, kept = job.resume_point(self.now, self.periodic_s)
        lost = job.progress(self.now) - kept
        self._end_attempt(job, lost)
        job.base = kept
        self.rec.evicted(job.spec, forced, lost * job.spec.gpu_share)
        self._requeue(job)

    # --- the cluster's view: what serves inference -----------------------------------------

    def _serving(self) -> int:
        return self.dedicated + sum(self._lent_idle().values())

    def _lent_idle(self) -> dict[str, int]:
        """Lent GPUs training has left, by GPU model: they serve inference. Recounted
        only after the ledger changed (a tick reads it far more often)."""
        version = self.ledger_version
        if self.lent_cache[0] != version:
            counts: dict[str, int] = {}
            for ref in self.ledger.lent_gpus():
                slot = self.ledger.gpu(ref)
                if slot.status is GpuStatus.RESERVED_INFERENCE:
                    counts[slot.model] = counts.get(slot.model, 0) + 1
            self.lent_cache = (version, counts)
        return self.lent_cache[1]

    def _shared_figures(self) -> PoolFigures:
        if self.shared_cache[0] != self.ledger_version:
            gpus = busy = 0
            for slot in self.ledger.gpus:
                if slot.pool is Pool.SHARED and slot.reserved_for is None:
                    gpus += 1
                    busy += slot.status in (GpuStatus.ALLOCATED, GpuStatus.SHARED)
            figures = PoolFigures(gpus, TRAINING_UTIL * busy / gpus if gpus else 0.0, gpus)
            self.shared_cache = (self.ledger_version, figures, self._count_shared_allocated())
        return self.shared_cache[1]

    # --- the reading tick: SLO, and the policy's controller --------------------------------

    def _tick(self) -> None:
        demand = self.demand.at(self.now)
        serving = self._serving()
        rho = demand / serving if serving else (math.inf if demand > 0 else 0.0)
        self.rec.serving(
            self.now,
            self.p.decide_every_s,
            demand,
            rho,
            self.p.latency.p99_ms(rho) <= self.p.slo_ms,
            self._lent_idle(),
        )
        if self.policy.kind is Kind.GPUSCHED:
            self._decide(demand, serving)
        elif self.policy.kind is Kind.KUBERNETES:
            self._autoscale(demand)

    def _decide(self, demand: float, serving: int) -> None:
        now = self._time()
        limits = self.policy.limits
        util = min(1.0, demand / serving) if serving else 1.0
        reading = PoolReading(now, PoolFigures(serving, util, serving), self._shared_figures())
        self.held = fold(self.held, reading, limits.thresholds, limits.signals, self.last_change_at)
        in_flight = self.decision is not None
        wants = not in_flight and controller.expand_due(reading, self.held, limits, now)
        while self.recent and self.recent[0] < now - RATE_WINDOW:
            self.recent.popleft()
        view = controller.ControllerView(
            in_flight=in_flight,
            last_change_at=self.last_change_at,
            last_shortfall_at=self.last_shortfall_at,
            reservations=self._lent(),
            shared_allocated_gpus=self._shared_allocated(),
            candidates=self._candidates() if wants else (),
            withdrawable=tuple(
                e.request_id for e in self.evictions.values() if e.open and not e.withdrawn
            )
            if in_flight
            else (),
            recent_evictions=len(self.recent),
        )
        outcome = controller.decide(reading, self.held, view, limits, now)
        match outcome:
            case controller.Expand():
                self._expand(outcome, now)
            case controller.Shrink():
                for reservation_id, gpus in outcome.returns:
                    chosen = lending.lent_to_return(self.ledger, reservation_id, gpus)
                    if chosen:
                        returned = self.ledger.return_to_shared(gpus=chosen)
                        self._kick(capacity=bool(returned.freed))
                self.last_change_at = now
                self.rec.pool_change("shrink", outcome.gpus)
            case controller.Withdraw():
                for request_id in outcome.request_ids:
                    self.evictions[request_id].withdrawn = True
                    self._saga_input(request_id, sg.NeedWithdrawn(request_id))
            case controller.Hold():
                pass

    def _lent(self) -> tuple[controller.LentReservation, ...]:
        counts: dict[str, int] = {}
        for ref in self.ledger.lent_gpus():
            reservation_id = self.ledger.gpu(ref).reserved_for
            assert reservation_id is not None
            counts[reservation_id] = counts.get(reservation_id, 0) + 1
        return tuple(
            sorted(
                (controller.LentReservation(r, n, self.lent_at[r]) for r, n in counts.items()),
                key=lambda lent: (-lent.lent_at.timestamp(), lent.reservation_id),
            )
        )

    def _shared_allocated(self) -> int:
        self._shared_figures()
        return self.shared_cache[2]

    def _count_shared_allocated(self) -> int:
        """GPUs of the shared pool held by allocations (``store.shared_allocated_gpus``):
        a GPU shared by fractional tenants counts once."""
        whole = 0
        shares: set[GpuRef] = set()
        for allocation in self.ledger.allocations.values():
            if allocation.pool is Pool.SHARED:
                if allocation.share is None:
                    whole += len(allocation.gpus)
                else:
                    shares.update(allocation.gpus)
        return whole + len(shares)

    def _candidates(self) -> tuple[VictimCandidate, ...]:
        """Live allocations not being evicted (``store.candidates``): whole GPUs, and
        fractions with the count of their GPU's tenants (a MIG slice is none)."""
        out: list[VictimCandidate] = []
        shared = self.ledger.shared
        for allocation_id, allocation in sorted(self.ledger.allocations.items()):
            if not allocation.gpus:
                continue
            share, tenants = 1.0, 1
            if allocation.share is not None:
                if allocation.share.profile is not None:
                    continue
                share = min(1.0, allocation.share.milli / WHOLE_GPU_MILLI)
                held = shared.get(allocation.gpus[0])
                tenants = 1 if held is None else len(held.tenants)
            if allocation_id in self.saga_of or allocation_id in self.dying:
                continue
            job = self.jobs[self.by_allocation[allocation_id]]
            checkpoint = job.checkpoint_at
            periodic, _ = job.resume_point(self.now, self.periodic_s)
            if periodic is not None and (checkpoint is None or periodic > checkpoint):
                checkpoint = periodic
            out.append(
                VictimCandidate(
                    allocation_id,
                    job.spec.job_id,
                    allocation.team,
                    allocation.priority_class,
                    len(allocation.gpus),
                    allocation.gpus,
                    allocation.granted_at,
                    None if checkpoint is None else self._time(checkpoint),
                    True,
                    pool=allocation.pool,
                    borrowed=allocation.borrowed,
                    share=share,
                    tenants=tenants,
                )
            )
        return tuple(out)

    def _expand(self, outcome: controller.Expand, now: datetime) -> None:
        decision_id = f"decision-{next(self.ids)}"
        choice = outcome.choice
        if outcome.changes_pools:
            reservation_id = f"reservation-{next(self.ids)}"
            decision = _Decision(decision_id, reservation_id)
            self._reserve(reservation_id, choice.allocation_ids, outcome.free_gpus, now)
            self.last_change_at = now
            self.rec.pool_change("expand", outcome.gpus)
            if choice.victims:
                self.decision = decision
                reasons = dict(choice.reasons)
                for victim in choice.victims:
                    self._request_eviction(decision, victim, reasons[victim.allocation_id], now)
        if outcome.shortfall:
            self.last_shortfall_at = now
            self.rec.shortfall(outcome.shortfall)

    def _reserve(
        self, reservation_id: str, allocation_ids: tuple[str, ...], free: int, now: datetime
    ) -> None:
        chosen = lending.to_reserve(self.ledger, reservation_id, allocation_ids, free)
        if chosen.gpus:
            self.ledger.reserve_for_inference(reservation_id, chosen.gpus)
            self.ledger_version += 1
            self.lent_at[reservation_id] = now

    def _request_eviction(
        self, decision: _Decision, victim: VictimCandidate, reason: str, now: datetime
    ) -> None:
        request_id = f"request-{next(self.ids)}"
        decision.tried.add(victim.allocation_id)
        self.evictions[request_id] = _Eviction(
            request_id,
            decision.decision_id,
            victim.allocation_id,
            victim.job_id,
            victim.gpus,
            now,
        )
        self.recent.append(now)
        self.rec.decided(self.now, "victim", victim.job_id, str(victim.priority_class))
        job = self.jobs[victim.job_id]
        latest = None if job.checkpoint_at is None else self._time(job.checkpoint_at)
        periodic, _ = job.resume_point(self.now, self.periodic_s)
        if periodic is not None and (latest is None or self._time(periodic) > latest):
            latest = self._time(periodic)
        ref = None if latest is None else _ref(job.spec.job_id, latest)
        begin = self.policy.evictions.begin(
            saga_id=f"saga-{request_id}",
            request_id=request_id,
            allocation_id=victim.allocation_id,
            job_id=victim.job_id,
            gpus=victim.gpus,
            started_at=victim.started_at,
            priority_class=str(victim.priority_class),
            reason=reason,
            latest=None if ref is None or latest is None else (ref, latest),
            share_milli=victim.share_milli,
        )
        saga, effects = sg.begin(begin, now)
        self.sagas[request_id] = saga
        self.saga_of[victim.allocation_id] = request_id
        self.rec.saga_opened()
        self._carry_out(saga, tuple(effects))

    # --- the saga's inputs and effects (checkpoint service, jobs, agent) -------------------

    def _saga_input(self, request_id: str, event: sg.SagaInput) -> None:
        saga = self.sagas.get(request_id)
        if saga is None or saga.is_terminal:
            return
        try:
            decision = sg.decide(saga, event, self._time())
        except (sg.IllegalTransition, sg.ForeignMessage):
            return  # the service audits and acks it: nothing changes
        self.sagas[request_id] = decision.saga
        self._carry_out(decision.saga, decision.effects)

    def _carry_out(self, saga: sg.Saga, effects: tuple[sg.SagaEffect, ...]) -> None:
        for effect in effects:
            match effect:
                case sg.SendCheckpointRequest():
                    self._ask_checkpoint(saga, effect)
                case sg.SendEvict():
                    self._at(self.now + self.p.stop_s, Ev.STOPPED, saga.request_id)
                case sg.SendPreemptionCancelled():
                    pass  # the job keeps training
                case sg.EmitEvictionCompleted():
                    self._settled(saga)
                case sg.EmitEvictionForced():
                    self.rec.credit(
                        self.jobs[saga.job_id].spec, effect.lost_gpu_seconds, self._gpu_model(saga)
                    )
                    self._settled(saga)
                case sg.EmitEvictionCancelled():
                    self._called_off(saga)
                    self._settled(saga)
                case sg.EmitEvictionAborted():
                    self._called_off(saga)
                    self._aborted(saga)
        if saga.is_terminal:
            self.rec.saga_ended(saga.outcome)
            self.rec.decided(self.now, "saga", saga.job_id, str(saga.outcome))
            if self.saga_of.get(saga.allocation_id) == saga.request_id:
                del self.saga_of[saga.allocation_id]

    def _gpu_model(self, saga: sg.Saga) -> str:
        allocation = self.ledger.allocations.get(saga.allocation_id)
        return "" if allocation is None else allocation.model

    def _ask_checkpoint(self, saga: sg.Saga, effect: sg.SendCheckpointRequest) -> None:
        job = self.jobs[saga.job_id]
        self._at((saga.deadline - EPOCH).total_seconds(), Ev.DEADLINE, saga.request_id)
        if job.allocation_id != saga.allocation_id:
            return
        taken = self.now + job.spec.snapshot_s
        self._at(taken, Ev.CONFIRM, (saga.request_id, sg.Stage.SNAPSHOTTED, taken))
        self._at(
            self.now + job.spec.persist_s, Ev.CONFIRM, (saga.request_id, sg.Stage.PERSISTED, taken)
        )

    def _confirmed(self, request_id: str, stage: sg.Stage, taken: float) -> None:
        saga = self.sagas[request_id]
        job = self.jobs[saga.job_id]
        if job.allocation_id != saga.allocation_id or job.started_at is None:
            return  # the attempt ended before its checkpoint was done
        progress = job.base + (taken - job.started_at)
        job.asked = (taken, progress)
        if stage is sg.Stage.PERSISTED:
            job.checkpoint_at = taken
        ref = _ref(job.spec.job_id, self._time(taken), stage, int(progress))
        self._saga_input(request_id, sg.CheckpointConfirmed(request_id, job.spec.job_id, ref))

    def _stopped(self, request_id: str) -> None:
        """The agent stopped an evicted workload: admission releases it, the saga ends."""
        saga = self.sagas[request_id]
        job = self.jobs[saga.job_id]
        if job.allocation_id != saga.allocation_id:
            return  # it finished meanwhile
        self._evict(job, forced=saga.state is sg.SagaState.FORCED)
        self._saga_input(request_id, sg.WorkloadStopped(saga.allocation_id, "evicted"))

    def _called_off(self, saga: sg.Saga) -> None:
        """Eviction aborted or cancelled: the victim's GPUs go back to training."""
        waiting = lending.waiting_for(self.ledger, saga.allocation_id)
        if waiting:
            returned = self.ledger.return_to_shared(gpus=waiting)
            self._kick(capacity=bool(returned.freed))

    def _settled(self, saga: sg.Saga) -> None:
        """Completed, forced or cancelled: the eviction is over either way."""
        eviction = self.evictions[saga.request_id]
        if not eviction.open:
            return
        eviction.open = False
        self._settle_decision(eviction.decision_id)

    def _settle_decision(self, decision_id: str) -> None:
        if self.decision is None or self.decision.decision_id != decision_id:
            return
        if any(e.open and e.decision_id == decision_id for e in self.evictions.values()):
            return
        self.decision = None
        # The cooldown runs from the end of a change, not from its start.
        self.last_change_at = self._time()

    def _aborted(self, saga: sg.Saga) -> None:
        eviction = self.evictions[saga.request_id]
        eviction.open = False
        decision = self.decision
        if decision is not None and decision.decision_id == eviction.decision_id:
            now = self._time()
            while self.recent and self.recent[0] < now - RATE_WINDOW:
                self.recent.popleft()
            choice = controller.replacement(
                self._candidates(),
                eviction.gpus,
                now,
                decision.tried,
                self.policy.limits,
                len(self.recent),
            )
            if choice.victims:
                reservation_id = decision.reservation_id or f"reservation-{next(self.ids)}"
                decision.reservation_id = reservation_id
                self._reserve(reservation_id, choice.allocation_ids, 0, now)
                reasons = dict(choice.reasons)
                for victim in choice.victims:
                    self._request_eviction(decision, victim, reasons[victim.allocation_id], now)
            if choice.shortfall:
                self.last_shortfall_at = now
                self.rec.shortfall(choice.shortfall)
        self._settle_decision(eviction.decision_id)

    # --- Kubernetes-native preemption ---------------------------------------------------

    def _autoscale(self, demand: float) -> None:
        k = self.policy.kubernetes
        wanted = math.ceil(round(demand / k.target, 9))
        self.desired.append((self.now, wanted))
        while self.desired and self.desired[0][0] < self.now - k.scale_down_window_s:
            self.desired.popleft()
        # Up at once; down only to the highest recommendation of the window.
        target = max(w for _, w in self.desired)
        lend = max(0, target - self.dedicated)
        lent = len(self.ledger.reservation("k8s"))
        if lend > lent:
            free = lending.free_to_lend(self.ledger, lend - lent, ())
            need = lend - lent - len(free)
            victims: tuple[str, ...] = ()
            if need > 0:
                choice = choose_victims(
                    self._candidates(), need, self._time(), within_tier=most_recent_first
                )
                victims = choice.allocation_ids
                if choice.shortfall:
                    self.rec.shortfall(choice.shortfall)
            chosen = lending.to_reserve(self.ledger, "k8s", victims, len(free))
            if chosen.gpus:
                self.ledger.reserve_for_inference("k8s", chosen.gpus)
                self.ledger_version += 1
                self.rec.pool_change("expand", len(chosen.gpus))
            for allocation_id in victims:
                self.rec.decided(self.now, "victim", self.by_allocation[allocation_id], "")
                self.dying.add(allocation_id)
                self.rec.saga_opened()
                self._at(self.now + k.grace_s, Ev.KILL, allocation_id)
        elif lend < lent:
            chosen_back = lending.lent_to_return(self.ledger, "k8s", lent - lend)
            if chosen_back:
                returned = self.ledger.return_to_shared(gpus=chosen_back)
                self.rec.pool_change("shrink", len(chosen_back))
                self._kick(capacity=bool(returned.freed))

    def _killed(self, allocation_id: str) -> None:
        self.dying.discard(allocation_id)
        job_id = self.by_allocation.get(allocation_id)
        if job_id is None:
            return
        job = self.jobs[job_id]
        if job.started_at is not None and job.progress(self.now) >= job.spec.work_s:
            # It finished inside its grace.
            self._end_attempt(job, lost=0.0)
            job.finished = self.now
            self.rec.completed(job.spec, self.now - job.spec.arrival_s)
            return
        self._evict(job, forced=True)
        self.rec.saga_ended(sg.Outcome.DEADLINE_FORCED)

    # --- samples and the end -------------------------------------------------------------

    def _sample(self, t: float) -> None:
        capacity = self.ledger.capacity()
        shared = capacity[Pool.SHARED]
        serving = self._serving()
        self.rec.sample(
            t,
            demand=self.demand.at(t),
            serving=serving,
            lent=shared.lent,
            training_gpus=sum(
                len(a.gpus) for a in self.ledger.allocations.values() if a.share is None
            )
            + len({a.gpus[0] for a in self.ledger.allocations.values() if a.share}),
            queued=len(self.queue),
            allocated=capacity[Pool.SHARED].allocated + capacity[Pool.TRAINING].allocated,
            fragmented=fragmented_gpus(self.ledger.nodes_free(), 8),
        )

    def _finish(self) -> RunResult:
        for job in self.jobs.values():
            if job.allocation_id is not None and job.started_at is not None:
                allocation = self.ledger.allocation(job.allocation_id)
                ran = self.now - job.started_at
                job.ran_gpu_s += job.spec.gpu_share * ran
                self.rec.ran(job.spec, allocation, ran, 0.0, self.now)
            if job.first_started is None and job.spec.arrival_s <= self.now:
                self.rec.never_started(job.spec, self.now - job.spec.arrival_s)
        return self.rec.result(self.now, self.book)


def _record(job: TrainingJob) -> JobRecord:
    spec = SubmitJob(
        name=job.name[:200],
        team=job.team,
        kind=JobKind.TRAINING,
        priority_class=PriorityClassName(job.priority.value),
        gpus=GpuRequest(count=job.gpus, milli=job.milli if job.milli < WHOLE_GPU_MILLI else None),
    )
    return JobRecord.of(
        job.job_id,
        spec,
        JobState.QUEUED,
        0,
        None,
        None,
        EPOCH + timedelta(seconds=job.arrival_s),
        (),
        False,
        {},
    )


def _ref(
    job_id: str, at: datetime, stage: sg.Stage = sg.Stage.PERSISTED, step: int = 0
) -> sg.CheckpointRef:
    stamp = int(at.timestamp())
    return sg.CheckpointRef(f"{job_id}-{stamp}", step, f"sim://{job_id}/{stamp}", 0, "", stage)
