"""The checkpoint service's metrics: how eviction sagas end, how long they take, the work
forced evictions lose, and what the checkpoint claims were found to be.

Counted when the transaction that decided them commits (UnitOfWork.on_commit), so a
retried message is counted once. Labels are bounded: outcomes and verdicts, never a job.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from gpusched.checkpoint.verification import ClaimCheck
from gpusched.domain.saga import Outcome, Saga

# The saga outcomes (domain) as the four ends an operator reads on a dashboard.
END_OF = {
    Outcome.EVICTED: "completed",
    Outcome.JOB_FINISHED: "cancelled",
    Outcome.NEED_WITHDRAWN: "cancelled",
    Outcome.DEADLINE_ABORTED: "aborted",
    Outcome.CHECKPOINT_FAILED_ABORTED: "aborted",
    Outcome.EVICT_FAILED: "aborted",
    Outcome.DEADLINE_FORCED: "forced",
    Outcome.CHECKPOINT_FAILED_FORCED: "forced",
}

EVICTIONS = Counter(
    "gpusched_evictions_total",
    "Eviction sagas ended, by outcome (completed, forced, aborted, cancelled) and the "
    "saga's reason for it",
    ["outcome", "reason"],
)
SAGA_SECONDS = Histogram(
    "gpusched_eviction_saga_seconds",
    "From an eviction request to its saga's end, by outcome",
    ["outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
LOST_GPU_SECONDS = Counter(
    "gpusched_lost_gpu_seconds_total",
    "Training work thrown away by forced evictions: GPUs x time since the last verified "
    "checkpoint (credited on the bill)",
)
CLAIMS = Counter(
    "gpusched_checkpoint_claims_total",
    "Checkpoint confirmations judged, by verdict: verified, trusted (scheme trusted for "
    "the class, unverified), untrusted, malformed, false",
    ["verdict"],
)
# Not counted at commit: they say what the process's storage threads are doing.
VERIFY_THREADS_STUCK = Gauge(
    "gpusched_checkpoint_verify_threads_stuck",
    "Checkpoint verification threads abandoned in storage I/O that has not returned (a "
    "hung mount, a store that does not answer); at the pool's size every verification "
    "is refused as incomplete at once",
)
VERIFY_REFUSED = Counter(
    "gpusched_checkpoint_verify_refused_total",
    "Checkpoint verifications refused at once (judged incomplete) because every "
    "verification thread was stuck in storage I/O",
)


# Every series at 0 from the start: a counter's first increase is visible to
# increase() and rate() only if the series existed before it.
for _outcome, _end in END_OF.items():
    EVICTIONS.labels(_end, _outcome.value)
    SAGA_SECONDS.labels(_end)
for _check in ClaimCheck:
    CLAIMS.labels(_check.value)


def saga_ended(saga: Saga) -> None:
    """Count a saga that reached its terminal state (call once, after commit)."""
    if saga.outcome is None:
        return
    outcome = END_OF[saga.outcome]
    EVICTIONS.labels(outcome, saga.outcome.value).inc()
    SAGA_SECONDS.labels(outcome).observe(
        max(0.0, (saga.updated_at - saga.created_at).total_seconds())
    )
    if outcome == "forced":
        LOST_GPU_SECONDS.inc(max(0.0, saga.lost_gpu_seconds))


def claim_judged(check: ClaimCheck) -> None:
    CLAIMS.labels(check.value).inc()
