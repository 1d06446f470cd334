"""Control messages a job receives, as the SDK hands them to a training loop."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from gpusched.contracts import messages as wire
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import StageName, T
from gpusched.sdk.checkpoints import SavedCheckpoint

# ~31 years: far beyond any real deadline, well within what the standard library's
# waits accept (threading.TIMEOUT_MAX and time.sleep go to ~292 years).
MAX_SECONDS_LEFT: Final = 1e9


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    """Save a checkpoint now: the control plane wants these GPUs back by `deadline`."""

    request_id: str
    job_id: str
    reason: str
    deadline: datetime
    stage_required: StageName
    message_id: str | None = None  # the request's envelope id; the confirmation cites it

    def seconds_left(self, now: datetime | None = None) -> float:
        """Seconds until the deadline (negative once it has passed), within
        +-MAX_SECONDS_LEFT: a deadline centuries away stays a number that
        `time.sleep`, `Event.wait` or `asyncio.wait_for` accept."""
        left = (self.deadline - (now or datetime.now(UTC))).total_seconds()
        return max(-MAX_SECONDS_LEFT, min(MAX_SECONDS_LEFT, left))

    def satisfied_by(self, stage: StageName) -> bool:
        """Whether a checkpoint at `stage` is what this request waits for (persisted
        answers a request for snapshotted too)."""
        return stage is StageName.PERSISTED or stage is self.stage_required


@dataclass(frozen=True, slots=True)
class RecentCheckpoint:
    """The newest checkpoint this client confirmed: what, how far, and when (a
    monotonic clock reading, so a wall-clock jump cannot make it look fresh)."""

    saved: SavedCheckpoint
    stage: StageName
    confirmed_at: float


@dataclass(frozen=True, slots=True)
class Freshness:
    """How recent a checkpoint the job already has must be to answer a checkpoint
    request instead of saving anew: at most `max_age_s` seconds old and, if given,
    at most `max_steps` steps behind. The job's own policy: the work since that
    checkpoint is what the eviction throws away."""

    max_age_s: float
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.max_age_s < float("inf")):
            raise ValueError(f"max_age_s must be a finite number >= 0, not {self.max_age_s}")
        if self.max_steps is not None and self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0, not {self.max_steps}")

    def accepts(
        self,
        recent: RecentCheckpoint | None,
        request: CheckpointRequest,
        *,
        now: float,
        step: int | None = None,
    ) -> bool:
        if recent is None or not request.satisfied_by(recent.stage):
            return False
        if now - recent.confirmed_at > self.max_age_s:
            return False
        if self.max_steps is not None:
            return step is not None and step - recent.saved.step <= self.max_steps
        return True


@dataclass(frozen=True, slots=True)
class PreemptionCancelled:
    """The eviction behind `request_id` is off: keep training."""

    request_id: str


@dataclass(frozen=True, slots=True)
class ResumeRequest:
    """Continue from this checkpoint."""

    checkpoint_id: str
    uri: str


ControlMessage = CheckpointRequest | PreemptionCancelled | ResumeRequest


def control_message(envelope: Envelope) -> ControlMessage | None:
    """The SDK view of a control envelope; None for a type this SDK does not know.

    Raises MalformedMessage when a known type's payload does not fit its schema.
    """
    if envelope.type == T.CHECKPOINT_REQUESTED:
        req = envelope.payload(wire.CheckpointRequested)
        return CheckpointRequest(
            request_id=req.request_id,
            job_id=req.job_id,
            reason=req.reason,
            deadline=req.deadline,
            stage_required=req.stage_required,
            message_id=envelope.id,
        )
    if envelope.type == T.PREEMPTION_CANCELLED:
        return PreemptionCancelled(envelope.payload(wire.PreemptionCancelled).request_id)
    if envelope.type == T.RESUME:
        resume = envelope.payload(wire.Resume)
        return ResumeRequest(resume.checkpoint_id, resume.uri)
    return None


class PendingCheckpoint:
    """The checkpoint request a loop still has to answer, readable from any thread.

    A newer request replaces an older one (one checkpoint answers both); a cancellation
    withdraws only the request it names; taking it hands it to exactly one caller.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._request: CheckpointRequest | None = None

    def apply(self, message: ControlMessage) -> None:
        with self._lock:
            if isinstance(message, CheckpointRequest):
                self._request = message
            elif (
                isinstance(message, PreemptionCancelled)
                and self._request is not None
                and self._request.request_id == message.request_id
            ):
                self._request = None

    def peek(self) -> CheckpointRequest | None:
        with self._lock:
            return self._request

    def take(self, request: CheckpointRequest | None) -> None:
        """Mark `request` as being answered (no-op if a newer one has replaced it)."""
        with self._lock:
            if request is not None and self._request == request:
                self._request = None
