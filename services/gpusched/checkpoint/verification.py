"""Whether a job's checkpoint claim holds: a pure judgement on what storage reported.

The storage adapter (gpusched.checkpoint.storage) does the reading; this module only
compares. A claim that storage contradicts is no confirmation at all: evicting on it
would throw away the only copy of the job's work. A claim this service cannot check
(a scheme it cannot read) counts only where the deployment said to take that scheme on
trust for the job's priority class (checkpoint.trusted_schemes): anyone who can publish
on a job's events subject can claim any URI, and a resume loads what the URI names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Final
from urllib.parse import urlsplit

from gpusched.contracts.manifest import Manifest, ManifestFile
from gpusched.contracts.uris import FILE_SCHEME, local_path
from gpusched.domain.saga import CheckpointRef

# RFC 3986: ALPHA *( ALPHA / DIGIT / "+" / "-" / "." ), compared in lower case.
_SCHEME: Final = re.compile(r"[a-z][a-z0-9+.-]*")


class ClaimCheck(StrEnum):
    VERIFIED = "verified"  # storage holds exactly what the job described
    TRUSTED = "trusted"  # not verifiable here, but its scheme is trusted for the job's class
    UNTRUSTED = "untrusted"  # not verifiable here, and its scheme is not trusted: refused
    MALFORMED = "malformed"  # not a URI, no scheme, or a file URI that is no local path
    FALSE = "false"  # storage contradicts the claim
    # Readable, but the check did not finish within its time budget: not known to hold.
    INCOMPLETE = "incomplete"


@dataclass(frozen=True)
class ObjectFacts:
    """What storage holds at a checkpoint's URI. `sha256` is None when it was not
    computed (the object is missing, unreadable, or its size already disagrees)."""

    exists: bool
    bytes: int | None = None
    sha256: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class ManifestFacts:
    """What storage holds for a manifest claim: the manifest object itself, what it
    lists (None if it could not be read or parsed: `problem` says why), the facts of
    each listed file checked in time, and how many were not checked within `budget_s`."""

    manifest: ObjectFacts
    listed: Manifest | None = None
    problem: str | None = None
    files: tuple[tuple[ManifestFile, ObjectFacts], ...] = ()
    unfinished: int = 0
    budget_s: float = 0.0


@dataclass(frozen=True)
class Verdict:
    check: ClaimCheck
    why: str

    @property
    def counts(self) -> bool:
        """True if the claim may confirm (and be catalogued as) a checkpoint."""
        return self.check in (ClaimCheck.VERIFIED, ClaimCheck.TRUSTED)


class MalformedUri(ValueError):
    """A claim's URI that names no scheme, is not a URI, or no local file."""


def valid_scheme(scheme: str) -> bool:
    return _SCHEME.fullmatch(scheme) is not None


def uri_scheme(uri: str) -> str:
    """The scheme of a claim's URI, in lower case; MalformedUri says why there is none.

    A file URI must name an absolute path on this host (`file:///...`): a relative one
    would be read from wherever each reader runs, and a host name would be ignored."""
    try:
        parts = urlsplit(uri)
    except ValueError as exc:
        raise MalformedUri(f"{uri!r} is not a URI ({exc})") from None
    scheme = parts.scheme.lower()
    if not scheme or not valid_scheme(scheme) or not uri.lower().startswith(f"{scheme}:"):
        raise MalformedUri(f"{uri!r} names no URI scheme (as in file:///... or s3://...)")
    if scheme == FILE_SCHEME:
        try:
            local_path(uri)
        except ValueError as exc:
            raise MalformedUri(str(exc)) from None
    return scheme


def judge(claim: CheckpointRef, facts: ObjectFacts) -> Verdict:
    """A claim against what storage holds at its URI.

    A refusal says what does not match, never what storage holds instead: the verdict
    goes to the audit stream, and a claim may name any object the service can read (a
    file that is no checkpoint), whose size and digest are not the claimant's to learn.
    """
    if not facts.exists:
        detail = f" ({facts.error})" if facts.error else ""
        return Verdict(ClaimCheck.FALSE, f"{claim.uri} does not exist{detail}")
    if facts.bytes != claim.bytes:
        return Verdict(
            ClaimCheck.FALSE,
            f"{claim.uri} does not hold the {claim.bytes} bytes the job claimed",
        )
    if facts.sha256 != claim.sha256:
        return Verdict(
            ClaimCheck.FALSE,
            f"{claim.uri}: its sha256 does not match the one the job claimed",
        )
    return Verdict(ClaimCheck.VERIFIED, f"{claim.uri}: {claim.bytes} bytes, sha256 matches")


def judge_unverifiable(
    job_id: str, scheme: str, priority_class: str | None, trusted: bool
) -> Verdict:
    """A claim storage here cannot check: counts only if `trusted` (its scheme is trusted
    for the job's class). `priority_class` is None while the job's class is unknown."""
    unread = f"{scheme}:// cannot be verified by the checkpoint service"
    if trusted:
        return Verdict(
            ClaimCheck.TRUSTED,
            f"{unread}; trusted without verification for class {priority_class} "
            "(checkpoint.trusted_schemes)",
        )
    if priority_class is None:
        return Verdict(
            ClaimCheck.UNTRUSTED,
            f"{unread}, and the priority class of job {job_id} is not known to it (no "
            "allocation or eviction of the job seen yet), so no trust applies",
        )
    return Verdict(
        ClaimCheck.UNTRUSTED,
        f"{unread} and is not trusted for class {priority_class}; an operator may trust it "
        f'with checkpoint.trusted_schemes (e.g. {{"{priority_class}": ["{scheme}"]}})',
    )


def judge_manifest(claim: CheckpointRef, facts: ManifestFacts) -> Verdict:
    """A directory checkpoint's claim: the manifest against the claim, then every file
    the manifest lists against the manifest. One file that storage contradicts makes
    the whole checkpoint false: a resume would load it."""
    manifest = judge(claim, facts.manifest)
    if manifest.check is not ClaimCheck.VERIFIED:
        return Verdict(manifest.check, f"manifest {manifest.why}")
    listed = facts.listed
    if listed is None:
        return Verdict(ClaimCheck.FALSE, f"{claim.uri} is no checkpoint manifest: {facts.problem}")
    if (listed.checkpoint_id, listed.step) != (claim.checkpoint_id, claim.step):
        return Verdict(
            ClaimCheck.FALSE,
            f"{claim.uri} is the manifest of checkpoint {listed.checkpoint_id} at step "
            f"{listed.step}, the job claimed {claim.checkpoint_id} at step {claim.step}",
        )
    wrong = [
        f"{entry.path}: {why}"
        for entry, seen in facts.files
        if (why := judge_file(entry, seen)) is not None
    ]
    total = len(listed.files)
    if wrong:
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        return Verdict(
            ClaimCheck.FALSE,
            f"{claim.uri}: {len(wrong)} of {total} listed files do not match: {wrong[0]}{more}",
        )
    if facts.unfinished or len(facts.files) < total:
        unchecked = max(facts.unfinished, total - len(facts.files))
        return Verdict(
            ClaimCheck.INCOMPLETE,
            f"{claim.uri}: {unchecked} of {total} listed files ({listed.total_bytes} bytes in "
            f"all) were not verified within the budget of {facts.budget_s:.0f}s "
            "(checkpoint.verify_budget_s + verify_budget_s_per_gb per GB)",
        )
    return Verdict(
        ClaimCheck.VERIFIED,
        f"{claim.uri}: manifest and its {total} files ({listed.total_bytes} bytes) match",
    )


def judge_file(entry: ManifestFile, facts: ObjectFacts) -> str | None:
    """Why one listed file does not hold what the manifest says; None if it does."""
    if not facts.exists:
        return "missing" + (f" ({facts.error})" if facts.error else "")
    if facts.bytes != entry.bytes:
        return f"does not hold the {entry.bytes} bytes the manifest says"
    if facts.sha256 != entry.sha256:
        return "its sha256 does not match the manifest's"
    return None


def budget_s(total_bytes: int, base_s: float, per_gb_s: float) -> float:
    """The time a verification may take: a base plus so much per GB (10^9 bytes) listed."""
    return base_s + per_gb_s * total_bytes / 1e9
