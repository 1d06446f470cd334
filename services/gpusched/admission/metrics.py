"""Admission's scheduling metrics: the queue and the GPUs, read from memory when scraped.

The queue (the scheduler's QueueIndex) and the ledger are already held in memory by the
replica that runs the scheduling pass, so the gauges cost nothing per submit or message:
they are counted when Prometheus asks (infra.metrics.on_scrape). Only that replica
reports them (a standby's copy is not kept current), so a rule takes `max` over replicas.
Labels are bounded: team, priority class, pool, state; never a job id.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Counter
from prometheus_client.metrics_core import Metric

from gpusched.domain.inventory import Pool
from gpusched.domain.ledger import GpuSlot, GpuStatus, Ledger, PriorityClass
from gpusched.infra.metrics import Build, gauge_family

from .index import QueueIndex
from .queue import Clock

SUBMITS = Counter(
    "gpusched_submits_total",
    "Job submissions answered, by outcome: accepted, or the error code of a refusal",
    ["outcome"],
)
PLACEMENTS = Counter(
    "gpusched_placements_total",
    "Jobs (and inference replicas) placed by the scheduling pass, by pool and class",
    ["pool", "class"],
)
PASS_FAILURES = Counter(
    "gpusched_admission_pass_failures_total",
    "Scheduling passes that failed: parked (a job set aside, the pass ran again without "
    "it), outage (PostgreSQL or NATS away) or error (retried next tick)",
    ["reason"],
)

# At 0 from the start, so the first event of a kind shows in increase() and rate().
for _reason in ("parked", "outage", "error"):
    PASS_FAILURES.labels(_reason)
SUBMITS.labels("accepted")
for _pool in Pool:
    for _class in PriorityClass:
        PLACEMENTS.labels(str(_pool), str(_class))

# The families counted at scrape time (not in the registry until scraped).
SCRAPED_FAMILIES = ("gpusched_queue_jobs", "gpusched_queue_wait_seconds", "gpusched_gpus")

# The GPU states of gpusched_gpus, which partition every GPU of the inventory.
GPU_STATES = ("free", "used", "lent", "reserved", "shared", "unavailable")


def gpu_state(slot: GpuSlot, ledger: Ledger) -> str:
    """free: idle and placeable; used: allocated in its own pool; lent: lent to inference
    and allocated (to inference, or to training being evicted); reserved: lent to
    inference, idle; shared: carries GPU fractions or MIG slices; unavailable: idle on a
    drained or failed node."""
    if slot.reserved_for is not None:
        # Held (by inference, or by training being evicted, whole or in fractions).
        return "reserved" if slot.status is GpuStatus.RESERVED_INFERENCE else "lent"
    if slot.status is GpuStatus.SHARED:
        return "shared"
    if slot.status is GpuStatus.ALLOCATED:
        return "used"
    return "free" if ledger.node_condition(slot.ref.node) is None else "unavailable"


def gpu_counts(ledger: Ledger) -> dict[tuple[str, str], int]:
    """(home pool, state) -> GPUs, every pool of the ledger with every state."""
    counts: dict[tuple[str, str], int] = {}
    for slot in ledger.gpus:
        for state in GPU_STATES:
            counts.setdefault((str(slot.pool), state), 0)
        key = (str(slot.pool), gpu_state(slot, ledger))
        counts[key] += 1
    return counts


def queue_families(queue: QueueIndex, now_s: float) -> list[Metric]:
    """Queued jobs and the oldest one's wait, per team and priority class."""
    depth = gauge_family(
        "gpusched_queue_jobs", "Jobs queued for placement, per team and class", "team", "class"
    )
    wait = gauge_family(
        "gpusched_queue_wait_seconds",
        "How long the oldest queued job of a team and class has waited since its submit",
        "team",
        "class",
    )
    for teams in queue.lines().values():
        for team, line in teams.items():
            if not line:
                continue
            priority_class = str(line[0].priority_class)
            depth.add_metric([team, priority_class], len(line))
            # A team's line is in submission order: its first job waited longest.
            waited = now_s - line[0].submitted_at.timestamp()
            wait.add_metric([team, priority_class], max(0.0, waited))
    return [depth, wait]


def gpu_family(counts: dict[tuple[str, str], int]) -> Metric:
    family = gauge_family(
        "gpusched_gpus",
        "GPUs by home pool and state (free, used, lent, reserved, shared, unavailable)",
        "pool",
        "state",
    )
    for (pool, state), count in sorted(counts.items()):
        family.add_metric([pool, state], count)
    return family


@dataclass
class SchedulerView:
    """What the scheduler exposes to the scrape: set by each pass, read by `families`."""

    clock: Clock
    # Beyond this since its last tick a replica is not the one scheduling (any more).
    leader_for_s: float
    queue: QueueIndex | None = None
    ledger: Ledger | None = None
    ticked_at: float | None = None
    # While a pass plans in its worker thread the ledger is changing: the counts taken
    # before it are reported meanwhile.
    planning: bool = False
    _counts: dict[tuple[str, str], int] | None = None

    def scrape(self) -> Build:
        """On the event loop (the queue and ledger change there): the families, whole;
        they are cheap next to the per-GPU gauges of ingest."""
        families = list(self.families())
        return lambda: families

    def families(self) -> Iterable[Metric]:
        if self.ticked_at is None or time.monotonic() - self.ticked_at > self.leader_for_s:
            return []
        families: list[Metric] = []
        if self.queue is not None:
            families.extend(queue_families(self.queue, self.clock().timestamp()))
        if self.ledger is not None and not self.planning:
            self._counts = gpu_counts(self.ledger)
        if self._counts is not None:
            families.append(gpu_family(self._counts))
        return families
