"""The lost-work rule (DESIGN §7): what an interruption of a training run destroys.

One rule for every place that counts it: a forced eviction (the saga's FORCED exit,
credited in billing), a node failure (admission's `work.lost`) and the victim choice
(preemption ranks candidates by the work an eviction would lose). Pure: time comes in.

Lost work is GPUs x the time since the run's last verified checkpoint. A checkpoint
older than the run's start is the one the run resumed from, so the run's start bounds
the loss; a run with no checkpoint, or one that cannot checkpoint, loses all of it.
Only checkpoints the checkpoint service verified count (a claim it could not verify
saves nothing).
"""

from __future__ import annotations

from datetime import datetime

__all__ = ["lost_gpu_seconds", "lost_gpu_seconds_at", "lost_work_since"]


def lost_work_since(
    run_started_at: datetime,
    last_checkpoint_at: datetime | None,
    *,
    checkpointable: bool = True,
) -> datetime:
    """From when an interruption now would lose the run's work."""
    if not checkpointable or last_checkpoint_at is None:
        return run_started_at
    return max(last_checkpoint_at, run_started_at)


def lost_gpu_seconds_at(gpus: int, since_ts: float, now_ts: float) -> float:
    """The rule on epoch seconds: a victim choice ranks thousands of candidates, and
    float arithmetic is what keeps it within its time budget."""
    return gpus * max(0.0, now_ts - since_ts)


def lost_gpu_seconds(
    gpus: int,
    run_started_at: datetime,
    last_checkpoint_at: datetime | None,
    now: datetime,
    *,
    checkpointable: bool = True,
) -> float:
    """GPU-seconds of the run an interruption at `now` destroys (never negative)."""
    since = lost_work_since(run_started_at, last_checkpoint_at, checkpointable=checkpointable)
    return lost_gpu_seconds_at(gpus, since.timestamp(), now.timestamp())
