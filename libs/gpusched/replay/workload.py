"""What a replay replays: training jobs, inference services, and the rule that turned a
trace's pods into them.

Pure: the readers in ``traces`` hand over parsed rows; this module classifies them,
places them on the virtual clock and draws what the trace does not say (a Philly run
time for a pod that never ran, each job's checkpoint times) from one seed.

The rule for an openb pod (written in every report):
- ``LS`` (latency-sensitive) is an inference service: its GPU request is its share of
  the inference demand (the *service mix*); the demand curve itself is ``demand``'s.
- ``BE`` (best effort) is preemptible training of class ``p2-offline``; ``Burstable``
  is preemptible training of class ``p1-normal``; ``Guaranteed`` is ``p0-urgent``
  training, never preempted for inference.
- A pod without GPUs is left out (a job of host CPU and memory alone cannot be asked
  through the job API yet), and counted.
- A training job arrives at its pod's ``creation_time``, ``compression`` times sooner
  (seconds since the window opens, divided by ``compression``), and needs its pod's
  run time (``deletion_time - scheduled_time``) of work; a pod never scheduled has no
  run time, so it gets one drawn from the Philly run times.
- Pods created before the window opens (the first percentile of training arrivals,
  ``window_quantile``) arrive when it opens.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from gpusched.domain.ledger import PriorityClass

__all__ = [
    "CheckpointParams",
    "Service",
    "TracePod",
    "TrainingJob",
    "UserRow",
    "Workload",
    "WorkloadError",
    "from_openb",
    "from_user_rows",
]

WHOLE_GPU_MILLI = 1000

# openb's quality-of-service classes and what a replay makes of them.
QOS_CLASS: dict[str, PriorityClass] = {
    "LS": PriorityClass.INFERENCE,
    "BE": PriorityClass.P2_OFFLINE,
    "Burstable": PriorityClass.P1_NORMAL,
    "Guaranteed": PriorityClass.P0_URGENT,
}


class WorkloadError(ValueError):
    """The workload cannot be built as asked; the message says what to fix."""


@dataclass(frozen=True, slots=True)
class CheckpointParams:
    """How each training job checkpoints (parameters: the traces do not say).

    Periodic checkpoints every ``periodic_s`` of its run; asked for one by an eviction,
    a job has it in host memory (snapshotted) after ``snapshot_s`` and durable
    (persisted) after ``persist_base_s + persist_per_gpu_s x GPUs`` (larger jobs train
    larger models). A share ``slow_share`` of jobs (drawn per job) needs
    ``slow_persist_s`` to persist: longer than the saga's default grace.
    """

    periodic_s: float = 1800.0
    snapshot_s: float = 15.0
    persist_base_s: float = 60.0
    persist_per_gpu_s: float = 20.0
    slow_share: float = 0.05
    slow_persist_s: float = 600.0

    def __post_init__(self) -> None:
        for name in ("periodic_s", "snapshot_s", "persist_base_s", "slow_persist_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise WorkloadError(f"checkpoint {name} must be a number > 0, got {value}")
        if not (math.isfinite(self.persist_per_gpu_s) and self.persist_per_gpu_s >= 0):
            raise WorkloadError("checkpoint persist_per_gpu_s must be >= 0")
        if not 0 <= self.slow_share <= 1:
            raise WorkloadError(f"checkpoint slow_share must be within 0..1, got {self.slow_share}")

    def describe(self) -> dict[str, float]:
        return {
            "periodic_s": self.periodic_s,
            "snapshot_s": self.snapshot_s,
            "persist_base_s": self.persist_base_s,
            "persist_per_gpu_s": self.persist_per_gpu_s,
            "slow_share": self.slow_share,
            "slow_persist_s": self.slow_persist_s,
        }


@dataclass(frozen=True, slots=True)
class TrainingJob:
    job_id: str
    name: str
    team: str
    priority: PriorityClass
    arrival_s: float
    work_s: float  # compute time to finish, uninterrupted
    gpus: int  # whole GPUs; 1 for a fraction of one GPU
    milli: int  # per GPU; below 1000 a fraction of one GPU
    snapshot_s: float
    persist_s: float
    source: str  # "trace", "philly" (run time drawn) or "csv"

    @property
    def gpu_share(self) -> float:
        """GPUs the job holds, a fraction counted as its share."""
        return self.gpus * self.milli / WHOLE_GPU_MILLI


@dataclass(frozen=True, slots=True)
class Service:
    name: str
    weight: float  # its share of the inference demand (its GPU request)


@dataclass(frozen=True)
class Workload:
    jobs: tuple[TrainingJob, ...]
    services: tuple[Service, ...]
    # Why rows were left out, and how many.
    left_out: dict[str, int] = field(default_factory=dict)
    rule: str = ""

    @property
    def span_s(self) -> float:
        return max((job.arrival_s for job in self.jobs), default=0.0)

    def offered_gpu_seconds(self) -> float:
        return sum(job.gpu_share * job.work_s for job in self.jobs)

    def completable_gpu_seconds(self, horizon_s: float) -> float:
        """The most training work (GPU-seconds) any policy can get done by the horizon,
        however many GPUs it has: every job started at its arrival and never stopped,
        cut at the horizon. Goodput cannot exceed it."""
        return sum(
            job.gpu_share * min(job.work_s, max(0.0, horizon_s - job.arrival_s))
            for job in self.jobs
        )

    def offered_gpus(self) -> float:
        """GPUs the training jobs would hold on average over their arrival span if each
        started at once and ran uninterrupted (work past the span not counted)."""
        span = self.span_s
        if span <= 0:
            return 0.0
        held = sum(
            job.gpu_share * max(0.0, min(job.arrival_s + job.work_s, span) - job.arrival_s)
            for job in self.jobs
        )
        return held / span

    def describe(self) -> dict[str, object]:
        by_class = Counter(str(job.priority) for job in self.jobs)
        return {
            "training_jobs": len(self.jobs),
            "by_class": dict(sorted(by_class.items())),
            "run_time_drawn_from_philly": sum(job.source == "philly" for job in self.jobs),
            "fractional_jobs": sum(job.milli < WHOLE_GPU_MILLI for job in self.jobs),
            "services": len(self.services),
            "left_out": dict(self.left_out),
            "arrival_span_h": round(self.span_s / 3600, 2),
            "offered_gpu_hours": round(self.offered_gpu_seconds() / 3600, 1),
            "offered_gpus_mean_over_span": round(self.offered_gpus(), 2),
            "rule": self.rule,
        }


@dataclass(frozen=True, slots=True)
class TracePod:
    """One row of an openb pod list, as the trace states it (times in seconds)."""

    name: str
    num_gpu: int
    gpu_milli: int
    qos: str
    creation: float
    deletion: float | None
    scheduled: float | None


@dataclass(frozen=True, slots=True)
class UserRow:
    """One row of a user's CSV (see docs/replay.md for the format)."""

    name: str
    arrival_s: float
    gpus: int
    gpu_milli: int
    run_s: float
    priority: PriorityClass
    team: str


OPENB_RULE = (
    "LS pods are inference services (their GPU requests give the service mix); BE pods "
    "are p2-offline training, Burstable p1-normal, Guaranteed p0-urgent; pods without "
    "GPUs are left out; arrivals are the pods' creation times divided by the "
    "compression; work is the pod's run time, or a Philly run time for a pod never "
    "scheduled"
)


def from_openb(
    pods: Iterable[TracePod],
    philly_runtimes: Sequence[float],
    *,
    compression: float,
    seed: int,
    checkpoints: CheckpointParams | None = None,
    team: str = "openb",
    window_quantile: float = 0.01,
) -> Workload:
    """The training jobs and services of an openb pod list (the rule: module doc)."""
    if not (math.isfinite(compression) and compression > 0):
        raise WorkloadError(f"compression must be a number > 0, got {compression}")
    ckpt = checkpoints or CheckpointParams()
    rng = random.Random(seed)
    left_out: Counter[str] = Counter()
    services: list[Service] = []
    trained: list[TracePod] = []
    for pod in pods:
        if pod.num_gpu <= 0 or pod.gpu_milli <= 0:
            left_out["no GPU (host CPU and memory only)"] += 1
            continue
        priority = QOS_CLASS.get(pod.qos)
        if priority is None:
            left_out[f"unknown qos {pod.qos!r}"] += 1
            continue
        if priority is PriorityClass.INFERENCE:
            services.append(Service(pod.name, pod.num_gpu * min(pod.gpu_milli, 1000) / 1000))
            continue
        trained.append(pod)
    if not trained:
        raise WorkloadError(
            "the pod list has no training pod with GPUs (BE, Burstable, Guaranteed)"
        )
    usable_philly = [r for r in philly_runtimes if math.isfinite(r) and r > 0]
    arrivals = sorted(pod.creation for pod in trained)
    opens = arrivals[min(len(arrivals) - 1, int(len(arrivals) * window_quantile))]
    jobs: list[TrainingJob] = []
    for pod in sorted(trained, key=lambda p: (p.creation, p.name)):
        if pod.scheduled is not None and pod.deletion is not None:
            work, source = max(1.0, pod.deletion - pod.scheduled), "trace"
        else:
            if not usable_philly:
                raise WorkloadError(
                    f"pod {pod.name} never ran and no Philly run time is there to draw from"
                )
            work, source = rng.choice(usable_philly), "philly"
        milli = min(pod.gpu_milli, WHOLE_GPU_MILLI) if pod.num_gpu == 1 else WHOLE_GPU_MILLI
        jobs.append(
            _job(
                f"job-{pod.name}",
                pod.name,
                team,
                QOS_CLASS[pod.qos],
                max(0.0, pod.creation - opens) / compression,
                work,
                pod.num_gpu,
                milli,
                source,
                ckpt,
                rng,
            )
        )
    return Workload(tuple(jobs), tuple(services), dict(left_out), OPENB_RULE)


def from_user_rows(
    rows: Iterable[UserRow], *, seed: int, checkpoints: CheckpointParams | None = None
) -> Workload:
    """A user's own workload: training rows become jobs, ``inference`` rows services."""
    ckpt = checkpoints or CheckpointParams()
    rng = random.Random(seed)
    jobs: list[TrainingJob] = []
    services: list[Service] = []
    for row in sorted(rows, key=lambda r: (r.arrival_s, r.name)):
        if row.priority is PriorityClass.INFERENCE:
            services.append(Service(row.name, row.gpus * row.gpu_milli / WHOLE_GPU_MILLI))
            continue
        jobs.append(
            _job(
                f"job-{row.name}",
                row.name,
                row.team,
                row.priority,
                row.arrival_s,
                row.run_s,
                row.gpus,
                row.gpu_milli,
                "csv",
                ckpt,
                rng,
            )
        )
    if not jobs:
        raise WorkloadError(
            "the CSV has no training row (class p0-urgent, p1-normal or p2-offline)"
        )
    return Workload(tuple(jobs), tuple(services), {}, "the user's CSV, as written")


def _job(
    job_id: str,
    name: str,
    team: str,
    priority: PriorityClass,
    arrival_s: float,
    work_s: float,
    gpus: int,
    milli: int,
    source: str,
    ckpt: CheckpointParams,
    rng: random.Random,
) -> TrainingJob:
    slow = rng.random() < ckpt.slow_share
    persist = ckpt.slow_persist_s if slow else ckpt.persist_base_s + ckpt.persist_per_gpu_s * gpus
    return TrainingJob(
        job_id,
        name,
        team,
        priority,
        arrival_s,
        work_s,
        gpus,
        milli,
        min(ckpt.snapshot_s, persist),
        persist,
        source,
    )
