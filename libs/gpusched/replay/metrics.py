"""What a replay measured: counters and time series as it runs, a summary at the end.

Definitions (the report states them too):
- inference SLO attainment: share of time, and of requests (time weighted by demand),
  during which the serving GPUs give a P99 within the SLO under the simulated cluster's
  latency model (``simcluster.load.LatencyModel``: 200 ms is a utilization of 0.85);
- training queuing time: submit to first start; JCT: submit to completion (jobs that
  completed within the horizon); jobs still waiting at the end are counted apart, and
  in ``queuing_with_unstarted`` at their wait so far (a lower bound on theirs);
- goodput: GPU-hours of training that counted toward completion (run minus lost);
- GPU-hours lost to preemption: work done since the newest checkpoint at eviction;
- cost: the price book on the training allocations and the inference serving fleet
  (its GPUs and requests), credits for the work lost to forced evictions.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal

from gpusched.domain.inventory import Inventory, Pool
from gpusched.domain.ledger import Allocation
from gpusched.domain.pricing import Credit, PriceBook, Usage, UsageKind, build_statements
from gpusched.domain.saga import Outcome

from .workload import WHOLE_GPU_MILLI, TrainingJob

__all__ = ["EPOCH", "SERIES", "Recorder", "RunResult", "percentile"]

# The virtual clock's zero: a Monday, midnight UTC (the demand curve's hours follow it).
EPOCH = datetime(2026, 1, 5, tzinfo=UTC)
SERIES = (
    "t_h",
    "demand",
    "serving",
    "lent",
    "training_gpus",
    "queued",
    "allocated_share",
    "fragmented",
    "lost_gpu_h",
)
REQUESTS_PER_GPU_S = 150.0  # simcluster.load.LatencyModel's throughput per GPU


def percentile(values: Sequence[float], p: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(1, math.ceil(p / 100 * len(ordered))) - 1]


def _stats(values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {"mean_h": math.nan, "p50_h": math.nan, "p99_h": math.nan}
    return {
        "mean_h": sum(values) / len(values) / 3600,
        "p50_h": percentile(values, 50) / 3600,
        "p99_h": percentile(values, 99) / 3600,
    }


@dataclass
class RunResult:
    policy: str
    summary: dict[str, object]
    series: dict[str, list[float]]
    usages: list[Usage] = field(default_factory=list, repr=False)
    credits: list[Credit] = field(default_factory=list, repr=False)
    # The decisions, in order: (seconds, what, job id, detail): "placed" with its GPUs,
    # "victim" with its class, "saga" with its outcome.
    decisions: list[tuple[float, str, str, str]] = field(default_factory=list, repr=False)


class Recorder:
    def __init__(self, policy: str, inventory: Inventory, slo_ms: float) -> None:
        self.policy = policy
        self.inventory = inventory
        self.slo_ms = slo_ms
        self.training_gpus = inventory.gpus_in(Pool.SHARED) + inventory.gpus_in(Pool.TRAINING)
        self.models = {gpu.ref: gpu.model for gpu in inventory.gpus}
        self.waits: list[float] = []
        self.jcts: list[float] = []
        self.unstarted: list[float] = []
        self.arrivals = 0
        self.completions = 0
        self.run_gpu_s = 0.0
        self.lost_gpu_s = 0.0
        self.evictions = 0
        self.forced = 0
        self.sagas = 0
        self.outcomes: Counter[str] = Counter()
        self.changes: Counter[str] = Counter()
        self.lent_changes: Counter[str] = Counter()
        self.shortfalls = 0
        self.parked = 0
        self.time_s = 0.0
        self.time_ok_s = 0.0
        self.time_strict_s = 0.0
        self.work = 0.0
        self.work_ok = 0.0
        self.requests = 0.0
        self.lent_gpu_s: dict[str, float] = {}
        self.series: dict[str, list[float]] = {name: [] for name in SERIES}
        self.usages: list[Usage] = []
        self.credits: list[Credit] = []
        self.decisions: list[tuple[float, str, str, str]] = []

    # --- training -------------------------------------------------------------------------

    def arrived(self, job: TrainingJob) -> None:
        self.arrivals += 1

    def started(self, job: TrainingJob, waited: float) -> None:
        self.waits.append(waited)

    def completed(self, job: TrainingJob, jct: float) -> None:
        self.completions += 1
        self.jcts.append(jct)

    def never_started(self, job: TrainingJob, waited: float) -> None:
        self.unstarted.append(waited)

    def ran(
        self, job: TrainingJob, allocation: Allocation, ran_s: float, lost_s: float, now: float
    ) -> None:
        share = job.gpu_share
        self.run_gpu_s += share * ran_s
        self.lost_gpu_s += share * lost_s
        end = EPOCH + timedelta(seconds=now)
        milli = job.gpus * WHOLE_GPU_MILLI if job.milli >= WHOLE_GPU_MILLI else job.milli
        self.usages.append(
            Usage(
                team=job.team,
                allocation_id=allocation.allocation_id,
                job_id=job.job_id,
                kind=UsageKind.TRAINING,
                start=end - timedelta(seconds=ran_s),
                end=end,
                gpu_model=allocation.model,
                gpu_milli=milli,
            )
        )

    def evicted(self, job: TrainingJob, forced: bool, lost_gpu_s: float) -> None:
        self.evictions += 1
        self.forced += forced

    def credit(self, job: TrainingJob, lost_gpu_s: float, model: str) -> None:
        if not model or not math.isfinite(lost_gpu_s):
            return
        self.credits.append(
            Credit(
                team=job.team,
                job_id=job.job_id,
                allocation_id=job.job_id,
                gpu_model=model,
                lost_gpu_seconds=Decimal(str(round(lost_gpu_s, 3))),
                at=EPOCH,
            )
        )

    def decided(self, t: float, what: str, job_id: str, detail: str) -> None:
        self.decisions.append((t, what, job_id, detail))

    def saga_opened(self) -> None:
        self.sagas += 1

    def saga_ended(self, outcome: Outcome | None) -> None:
        self.outcomes[str(outcome)] += 1

    def pool_change(self, kind: str, gpus: int) -> None:
        self.changes[kind] += 1
        self.lent_changes[kind] += gpus

    def shortfall(self, gpus: int) -> None:
        self.shortfalls += 1

    # --- inference ------------------------------------------------------------------------

    def serving(
        self, t: float, dt: float, demand: float, rho: float, ok: bool, lent: dict[str, int]
    ) -> None:
        self.time_s += dt
        for model, count in lent.items():
            self.lent_gpu_s[model] = self.lent_gpu_s.get(model, 0.0) + count * dt
        self.work += demand * dt
        if ok:
            self.time_ok_s += dt
            self.work_ok += demand * dt
        if rho <= 0.70:
            self.time_strict_s += dt
        served = demand if rho < 1 else demand / rho if rho > 0 else 0.0
        self.requests += served * REQUESTS_PER_GPU_S * dt

    def sample(
        self,
        t: float,
        *,
        demand: float,
        serving: int,
        lent: int,
        training_gpus: int,
        queued: int,
        allocated: int,
        fragmented: int,
    ) -> None:
        values = {
            "t_h": t / 3600,
            "demand": demand,
            "serving": float(serving),
            "lent": float(lent),
            "training_gpus": float(training_gpus),
            "queued": float(queued),
            "allocated_share": allocated / self.training_gpus if self.training_gpus else 0.0,
            "fragmented": float(fragmented),
            "lost_gpu_h": self.lost_gpu_s / 3600,
        }
        for name, value in values.items():
            self.series[name].append(value)

    # --- the end --------------------------------------------------------------------------

    def result(self, horizon_s: float, book: PriceBook) -> RunResult:
        def mean(name: str) -> float:
            values = self.series[name]
            return sum(values) / len(values) if values else math.nan

        summary: dict[str, object] = {
            "policy": self.policy,
            "inference": {
                "slo_time_share": self.time_ok_s / self.time_s if self.time_s else math.nan,
                "slo_request_share": self.work_ok / self.work if self.work else math.nan,
                "time_share_at_or_below_0.70": (
                    self.time_strict_s / self.time_s if self.time_s else math.nan
                ),
                "requests": self.requests,
                "lent_gpu_h_mean": mean("lent"),
                "expansions": self.changes["expand"],
                "shrinks": self.changes["shrink"],
                "shortfall_events": self.shortfalls,
            },
            "training": {
                "arrived": self.arrivals,
                "started": len(self.waits),
                "completed": self.completions,
                "never_started": len(self.unstarted),
                "queuing": _stats(self.waits),
                # The jobs never started counted too, at their wait so far (a lower
                # bound on their queuing): a policy that leaves more jobs waiting at the
                # horizon looks no better for it.
                "queuing_with_unstarted": _stats(self.waits + self.unstarted),
                "jct": _stats(self.jcts),
                "goodput_gpu_h": (self.run_gpu_s - self.lost_gpu_s) / 3600,
                "ran_gpu_h": self.run_gpu_s / 3600,
                "lost_gpu_h": self.lost_gpu_s / 3600,
                "evictions": self.evictions,
                "forced_evictions": self.forced,
                "eviction_requests": self.sagas,
                "saga_outcomes": dict(sorted(self.outcomes.items())),
                "parked": self.parked,
            },
            "cluster": {
                "allocated_share_mean": mean("allocated_share"),
                "fragmented_gpus_mean": mean("fragmented"),
                "queued_mean": mean("queued"),
            },
            "cost": self._price(book, horizon_s),
        }
        return RunResult(
            self.policy, summary, self.series, self.usages, self.credits, self.decisions
        )

    def _price(self, book: PriceBook, horizon_s: float) -> dict[str, str]:
        """Cost and credits from the price book (Decimal end to end): the training
        allocations, the inference fleet (its dedicated GPUs all along, the lent ones
        while they served) and its requests, the credits of forced evictions."""
        fleet: Counter[str] = Counter()
        for node in self.inventory.nodes:
            if node.pool is Pool.INFERENCE:
                for gpu in node.gpus:
                    fleet[gpu.model] += int(horizon_s)
        for model, seconds in self.lent_gpu_s.items():
            fleet[model] += int(seconds)
        return price(self.usages, self.credits, fleet, self.requests, book, horizon_s)


def price(
    training: Sequence[Usage],
    credits: Sequence[Credit],
    fleet: Counter[str],
    requests: float,
    book: PriceBook,
    horizon_s: float,
) -> dict[str, str]:
    end = EPOCH + timedelta(seconds=horizon_s)
    usages = list(training)
    total_fleet = sum(fleet.values()) or 1
    for model, gpu_s in sorted(fleet.items()):
        usages.append(
            Usage(
                team="inference",
                allocation_id=f"fleet-{model}",
                job_id=f"fleet-{model}",
                kind=UsageKind.INFERENCE,
                start=EPOCH,
                end=end,
                gpu_model=model,
                gpu_milli=max(1, round(WHOLE_GPU_MILLI * gpu_s / horizon_s)),
                requests=round(requests * gpu_s / total_fleet),
            )
        )
    statements = build_statements(usages, credits, book, EPOCH, end + timedelta(seconds=1))
    by_kind: dict[str, Decimal] = {kind.value: Decimal(0) for kind in UsageKind}
    for statement in statements:
        for line in statement.lines:
            by_kind[line.kind.value] += line.total
    credit_total = sum((s.credits_total for s in statements), Decimal(0))
    return {
        "currency": book.currency,
        "training": str(by_kind[UsageKind.TRAINING.value].quantize(Decimal("0.01"))),
        "inference": str(by_kind[UsageKind.INFERENCE.value].quantize(Decimal("0.01"))),
        "credits": str(credit_total.quantize(Decimal("0.01"))),
        "total": str(sum((s.total for s in statements), Decimal(0))),
    }
