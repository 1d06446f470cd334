"""The virtual training loop's arithmetic: step pacing, a loss curve, checkpoint contents.

`time_scale` is virtual seconds per real second: a 1 s step under time_scale 60 takes
1/60 s of wall time, so a demo plays hours of training in minutes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass


class CheckpointContentError(ValueError):
    """A checkpoint file that is not what the virtual loop wrote."""


@dataclass(frozen=True, slots=True)
class VirtualLoop:
    steps: int
    step_seconds: float
    checkpoint_seconds: float
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.step_seconds <= 0 or self.time_scale <= 0:
            raise ValueError("steps >= 1, step_seconds > 0 and time_scale > 0 are required")
        if self.checkpoint_seconds < 0:
            raise ValueError("checkpoint_seconds must be >= 0")

    @property
    def step_interval_s(self) -> float:
        """Wall-clock seconds per step."""
        return self.step_seconds / self.time_scale

    @property
    def checkpoint_interval_s(self) -> float:
        """Wall-clock seconds to make a checkpoint durable."""
        return self.checkpoint_seconds / self.time_scale

    @property
    def progress_every(self) -> int:
        """Report progress about once per wall-clock second, and at least every step
        when steps are slower than that, so the bus carries a steady trickle."""
        interval = self.step_interval_s
        # Capped at the whole run (reported at its last step anyway): a step too short
        # for a float (1 / interval is infinite, or the interval is 0) still has a count.
        if interval <= 0 or 1.0 / interval >= self.steps:
            return self.steps
        return max(1, math.ceil(1.0 / interval))

    def steps_due(self, step: int, late_s: float) -> int:
        """How many steps to take at once when the clock is `late_s` seconds past the
        time the next step was due: that step and one more per whole interval since,
        never beyond the last step. 0 while the next step is not yet due.

        Arithmetic rather than one step at a time, so catching up costs the same however
        short a step is (a step that adds nothing to a float clock included)."""
        left = self.steps - step
        if late_s < 0 or left <= 0:
            return 0
        interval = self.step_interval_s
        due = late_s / interval + 1.0 if interval > 0 else math.inf
        # Compared as a float before it becomes an int: the count may be infinite.
        return left if due >= left else math.floor(due)

    def reports_progress(self, step: int) -> bool:
        return step % self.progress_every == 0 or step >= self.steps

    def is_done(self, step: int) -> bool:
        return step >= self.steps

    def loss(self, step: int) -> float:
        """A plausible decaying loss curve, so dashboards show something that learns."""
        return round(0.1 + 2.4 * math.exp(-3.0 * step / self.steps), 6)


def checkpoint_document(job_id: str, step: int) -> bytes:
    return json.dumps({"job_id": job_id, "step": step}, sort_keys=True).encode()


def checkpoint_step(document: bytes, job_id: str) -> int:
    """The step a virtual checkpoint holds; refuses another job's checkpoint."""
    try:
        data = json.loads(document)
        step = data["step"]
        owner = data["job_id"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointContentError(f"not a virtual checkpoint: {exc}") from exc
    if owner != job_id:
        raise CheckpointContentError(f"checkpoint belongs to job {owner!r}, not {job_id!r}")
    if not isinstance(step, int) or step < 0:
        raise CheckpointContentError(f"checkpoint step {step!r} is not a step number")
    return step
