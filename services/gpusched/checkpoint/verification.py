"""Whether a job's checkpoint claim holds: a pure judgement on what storage reported.

The storage adapter (gpusched.checkpoint.storage) does the reading; this module only
compares. A claim that storage contradicts is no confirmation at all: evicting on it
would throw away the only copy of the job's work.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpusched.domain.saga import CheckpointRef


class ClaimCheck(StrEnum):
    VERIFIED = "verified"  # storage holds exactly what the job described
    UNVERIFIABLE = "unverifiable"  # a scheme this service cannot read: taken on trust
    FALSE = "false"  # storage contradicts the claim


@dataclass(frozen=True)
class ObjectFacts:
    """What storage holds at a checkpoint's URI. `sha256` is None when it was not
    computed (the object is missing, unreadable, or its size already disagrees)."""

    exists: bool
    bytes: int | None = None
    sha256: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Verdict:
    check: ClaimCheck
    why: str

    @property
    def counts(self) -> bool:
        """True if the claim may confirm a checkpoint."""
        return self.check is not ClaimCheck.FALSE


def judge(claim: CheckpointRef, facts: ObjectFacts | None) -> Verdict:
    """`facts` is None when storage cannot be inspected for this URI's scheme."""
    if facts is None:
        return Verdict(ClaimCheck.UNVERIFIABLE, f"{claim.uri}: storage not readable from here")
    if not facts.exists:
        detail = f" ({facts.error})" if facts.error else ""
        return Verdict(ClaimCheck.FALSE, f"{claim.uri} does not exist{detail}")
    if facts.bytes != claim.bytes:
        return Verdict(
            ClaimCheck.FALSE,
            f"{claim.uri} holds {facts.bytes} bytes, the job claimed {claim.bytes}",
        )
    if facts.sha256 != claim.sha256:
        return Verdict(
            ClaimCheck.FALSE,
            f"{claim.uri} has sha256 {facts.sha256}, the job claimed {claim.sha256}",
        )
    return Verdict(ClaimCheck.VERIFIED, f"{claim.uri}: {claim.bytes} bytes, sha256 matches")
