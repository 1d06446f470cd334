"""One experiment: the workload, the cluster, the demand and the policies, sized by rules
stated before any policy runs, then every policy replayed on the same inputs.

The rules (docs/replay.md says why):
- pressure: the openb pods' arrivals are compressed ``compression`` times; the
  cluster is the openb GPU node list with the share of its nodes (same mix of models
  and node sizes) that gives the static split's shared pool the training demand's
  mean load divided by ``load`` (``load`` 0.9: training asks 90% of its partition on
  average, more in busy hours);
- the static split: 3 of 8 GPUs dedicated to inference (the seeds' 24:40), nothing
  lent; the diurnal peak of the demand is sized so that this pool serves it at the
  controller's target utilization (0.70): surges beyond that are what it cannot
  absorb;
- gpusched's dedicated pool, by DESIGN §7: the P95 of the daily peak load of a demand
  history (28 days of the same curve with another seed), in GPUs of work; a second
  sizing, the base load (the history's P5 over the controller's expand threshold),
  and gpusched at the static split, are replayed too, so each effect shows apart;
- the controller as shipped, with the shrink gate on the shared pool lifted
  (``shared_below`` 1.0, as the elastic controller's docs advise for a saturated shared
  pool: a training backlog keeps it above 0.60, and the lent GPUs would never return);
  the shipped gate is replayed as its own row.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpusched.domain.inventory import Inventory, Pool
from gpusched.domain.pricing import PriceBook

from . import pools, traces
from .demand import DemandCurve, DemandParams, daily_peaks, percentile
from .engine import EngineParams, replay
from .metrics import RunResult
from .policies import Kind, Policy, ablations, default_limits, kubernetes
from .workload import CheckpointParams, Workload, from_openb, from_user_rows

__all__ = ["Comparison", "Experiment", "Prepared", "prepare", "run"]

STATIC_SHARE = 3 / 8
HISTORY_DAYS = 28
# A longer replay is a mistake (a compression below 1 on a long trace): it would only
# take memory and hours.
MAX_HORIZON_DAYS = 400


@dataclass(frozen=True)
class Experiment:
    traces_dir: Path
    pod_list: str = "openb_pod_list_default"
    # A user's own CSV instead of the openb pod list (docs/replay.md: the format).
    csv: Path | None = None
    # A user's own inventory (YAML as deploy/inventory/, every node SHARED or not).
    inventory: Path | None = None
    compression: float = 5.0
    load: float = 0.9
    # None: sized by ``load``; else the share of the openb nodes kept.
    node_share: float | None = None
    seed: int = 2023
    # The static split's inference share of the GPUs (the seeds' 3:5).
    static_share: float = STATIC_SHARE
    # gpusched's dedicated pool in GPUs (None: DESIGN §7's rule, from the demand).
    dedicated_gpus: int | None = None
    # A measured demand curve (``t_s,gpus``, docs/replay.md) instead of the drawn one,
    # whose shape ``trough`` and ``surges_per_day`` set.
    demand: Path | None = None
    trough: float = 0.4
    surges_per_day: float = 1.0
    drain_s: float = 86_400.0
    checkpoints: CheckpointParams = field(default_factory=CheckpointParams)
    price_book: Path = Path("deploy/prices.yaml")
    # Limit to these policy names (None: all).
    only: tuple[str, ...] | None = None
    decide_every_s: float = 30.0

    def describe(self) -> dict[str, object]:
        return {
            "pod_list": None if self.csv is not None else self.pod_list,
            "csv": None if self.csv is None else self.csv.name,
            "compression": self.compression,
            "load": self.load,
            "node_share": self.node_share,
            "seed": self.seed,
            "static_share": self.static_share,
            "dedicated_gpus": self.dedicated_gpus,
            "demand": None if self.demand is None else self.demand.name,
            "drain_h": self.drain_s / 3600,
            "checkpoints": self.checkpoints.describe(),
            "decide_every_s": self.decide_every_s,
        }


@dataclass(frozen=True)
class Prepared:
    experiment: Experiment
    inventory: Inventory
    workload: Workload
    demand: DemandCurve
    params: EngineParams
    policies: tuple[Policy, ...]
    book: PriceBook
    sizing: dict[str, object]


@dataclass
class Comparison:
    prepared: Prepared
    results: list[RunResult]
    # Wall-clock seconds of each policy's replay, and the CPU seconds this process spent
    # on it (on a shared machine the wall clock also counts others' work).
    seconds: dict[str, float]
    cpu_seconds: dict[str, float] = field(default_factory=dict)


def prepare(experiment: Experiment) -> Prepared:
    """Read the inputs and size the experiment by the rules of the module doc."""
    files = traces.TraceFiles(experiment.traces_dir, experiment.pod_list)
    if experiment.csv is None:
        files.check()
        workload = from_openb(
            traces.read_openb_pods(files.pods),
            traces.read_philly(files.philly),
            compression=experiment.compression,
            seed=experiment.seed,
            checkpoints=experiment.checkpoints,
        )
    else:
        workload = from_user_rows(
            traces.read_user_csv(experiment.csv),
            seed=experiment.seed,
            checkpoints=experiment.checkpoints,
        )
    if experiment.inventory is not None:
        full = traces.read_inventory(experiment.inventory)
        share = 1.0
    else:
        if not files.nodes.is_file():
            raise traces.TraceError(f"no openb node list at {files.nodes}: {traces.DOWNLOAD_HINT}")
        full = traces.read_openb_nodes(files.nodes)
        share = experiment.node_share or _node_share(full, workload, experiment.load)
    cluster = pools.sample(full, share) if share < 1 else full
    if not cluster.nodes:
        raise traces.TraceError(
            f"a share of {share:.2g} of the {len(full.nodes)} openb nodes keeps none: the "
            "workload asks too few GPUs to size a cluster by --load. Give your cluster with "
            f"--inventory, or --node-share {pools.smallest_share(full):.2g} or more"
        )
    total = cluster.total_gpus
    if not 0 < experiment.static_share < 1:
        raise ValueError(f"the static share must be within (0, 1), got {experiment.static_share}")
    static_gpus = round(experiment.static_share * total)
    static = pools.split(cluster, static_gpus)
    static_inference = static.gpus_in(Pool.INFERENCE)
    horizon = workload.span_s + experiment.drain_s
    if horizon > MAX_HORIZON_DAYS * 86_400:
        raise ValueError(
            f"the replay would span {horizon / 86_400:.0f} days (at most {MAX_HORIZON_DAYS}): "
            "raise --compression or shorten the workload"
        )
    if experiment.demand is None:
        params_demand = DemandParams(
            peak_gpus=0.70 * static_inference,
            trough=experiment.trough,
            surges_per_day=experiment.surges_per_day,
        )
        demand = DemandCurve(params_demand, horizon, experiment.seed)
        history = DemandCurve(params_demand, HISTORY_DAYS * 86_400.0, experiment.seed + 1)
        described: dict[str, object] = params_demand.describe()
    else:
        # A measured curve is its own history: DESIGN §7 sizes from the past it shows.
        demand = history = measured_demand(experiment.demand, workload.span_s)
        described = {
            "measured": experiment.demand.name,
            "peak_gpus": round(max(demand.values), 3),
            "step_s": demand.step_s,
            "hours": round(len(demand.values) * demand.step_s / 3600, 2),
        }
    limits = default_limits(shared_below=1.0)
    # A measured curve shorter than a day: its peak stands for the daily peak.
    peaks = daily_peaks(history) or [max(history.values)]
    design_gpus = math.ceil(percentile(peaks, 95))
    base_gpus = math.ceil(percentile(history.values, 5) / limits.thresholds.expand_above)
    if experiment.dedicated_gpus is not None:
        if not 0 <= experiment.dedicated_gpus <= total:
            raise ValueError(
                f"the dedicated pool of {experiment.dedicated_gpus} GPUs is not within the "
                f"cluster's 0..{total}"
            )
        design_gpus = experiment.dedicated_gpus
    design = pools.split(cluster, min(design_gpus, total)).gpus_in(Pool.INFERENCE)
    base = pools.split(cluster, min(base_gpus, total)).gpus_in(Pool.INFERENCE)
    design_rule = (
        "DESIGN §7 (P95 of the daily peak load)"
        if experiment.dedicated_gpus is None
        else f"given ({experiment.dedicated_gpus} GPUs asked, whole nodes)"
    )
    gpusched = Policy(
        "gpusched",
        Kind.GPUSCHED,
        design,
        limits=limits,
        description=f"dedicated pool by {design_rule}, the "
        "controller as shipped with the shrink gate lifted (shared_below 1.0)",
    )
    policies = (
        gpusched,
        replace(
            gpusched,
            name="gpusched, shipped shrink gate",
            limits=default_limits(),
            description="as gpusched, with the shipped shared_below 0.60",
        ),
        replace(
            gpusched,
            name="gpusched at the static split",
            inference_gpus=static_inference,
            description="as gpusched, on the static split's pools",
        ),
        replace(
            gpusched,
            name="gpusched, base-load pool",
            inference_gpus=base,
            description="as gpusched, dedicated pool at the base load (P5 of the "
            "history over the expand threshold)",
        ),
        Policy(
            "static split",
            Kind.STATIC,
            static_inference,
            description=f"{static_inference} of {total} GPUs for inference, nothing lent",
        ),
        kubernetes(design),
        *ablations(gpusched),
    )
    if experiment.only is not None:
        unknown = sorted(set(experiment.only) - {p.name for p in policies})
        if unknown:
            raise ValueError(
                f"no policy {', '.join(map(repr, unknown))}; the policies are "
                + ", ".join(repr(p.name) for p in policies)
            )
        policies = tuple(p for p in policies if p.name in experiment.only)
    offered = workload.offered_gpus()
    params = EngineParams(horizon_s=horizon, decide_every_s=experiment.decide_every_s)
    sizing = {
        "cluster_gpus": total,
        "cluster_nodes": len(cluster.nodes),
        "node_share": round(share, 5),
        "static_inference_gpus": static_inference,
        "gpusched_inference_gpus": design,
        "gpusched_inference_gpus_rule": design_rule,
        "base_load_inference_gpus": base,
        "training_offered_gpus_mean": round(offered, 2),
        "demand": described,
        "demand_p95_daily_peak_history": round(percentile(peaks, 95), 2),
        "surges": len(demand.surges),
        "horizon_h": round(horizon / 3600, 2),
        "static_training_capacity_gpu_h": round((total - static_inference) * horizon / 3600, 1),
        "training_ceiling_gpu_h": round(training_ceiling_gpu_h(total, demand, horizon, params), 1),
        "gpusched_training_ceiling_gpu_h": round(
            training_ceiling_gpu_h(total, demand, horizon, params, dedicated=design), 1
        ),
        "training_work_bound_gpu_h": round(workload.completable_gpu_seconds(horizon) / 3600, 1),
    }
    book = traces.read_price_book(experiment.price_book)
    return Prepared(experiment, cluster, workload, demand, params, policies, book, sizing)


def run(prepared: Prepared, progress: Callable[[str, float], None] | None = None) -> Comparison:
    """Every policy on the same inputs, one after the other."""
    import time

    results: list[RunResult] = []
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for policy in prepared.policies:
        inventory = pools.split(prepared.inventory, policy.inference_gpus)
        started, cpu_started = time.perf_counter(), time.process_time()
        tell = None if progress is None else _teller(progress, policy.name)
        results.append(
            replay(
                policy,
                inventory,
                prepared.workload,
                prepared.demand,
                prepared.params,
                periodic_s=prepared.experiment.checkpoints.periodic_s,
                book=prepared.book,
                progress=tell,
            )
        )
        seconds[policy.name] = time.perf_counter() - started
        cpu[policy.name] = time.process_time() - cpu_started
    return Comparison(prepared, results, seconds, cpu)


def measured_demand(path: Path, span_s: float) -> DemandCurve:
    """A measured demand curve (``traces.read_demand_csv``) that covers the workload's
    arrivals; past its end its last value holds (the drain after the arrivals)."""
    values, step_s = traces.read_demand_csv(path)
    covers = len(values) * step_s
    if covers < span_s:
        raise traces.TraceError(
            f"{path.name} covers {covers / 3600:.1f} h of demand, the workload's arrivals "
            f"{span_s / 3600:.1f} h: give a demand for the whole span (or a higher "
            "--compression)"
        )
    return DemandCurve.of(values, step_s)


def training_ceiling_gpu_h(
    cluster_gpus: int,
    demand: DemandCurve,
    horizon_s: float,
    params: EngineParams,
    dedicated: int = 0,
) -> float:
    """The most GPU-hours any policy could give training: at every step of the demand
    curve, every GPU that inference does not need to meet its SLO (the demand over the
    highest utilization within it, in whole GPUs), packed without a gap. A policy that
    keeps headroom, packs fractions imperfectly or loses work gets less. ``dedicated``:
    GPUs training never gets (gpusched's dedicated pool), idle or not."""
    rho = params.latency.highest_rho(params.slo_ms)
    if rho <= 0:
        return 0.0  # no utilization meets the SLO: inference would need every GPU
    steps = int(horizon_s // demand.step_s)
    free = sum(
        max(0, cluster_gpus - max(dedicated, math.ceil(demand.at(i * demand.step_s) / rho)))
        for i in range(steps)
    )
    return free * demand.step_s / 3600


def _teller(progress: Callable[[str, float], None], name: str) -> Callable[[float], None]:
    return lambda done: progress(name, done)


def _node_share(full: Inventory, workload: Workload, load: float) -> float:
    if not 0 < load <= 2:
        raise ValueError(f"load must be within (0, 2], got {load}")
    offered = workload.offered_gpus()
    wanted_total = offered / load / (1 - STATIC_SHARE)
    return min(1.0, max(wanted_total / full.total_gpus, 1e-4))


def names(policies: Sequence[Policy]) -> list[str]:
    return [policy.name for policy in policies]
