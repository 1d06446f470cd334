"""Per priority class: which checkpoint stage an eviction waits for, what its deadline
does, and which URI schemes a checkpoint claim may use unverified.

Read once from Settings().checkpoint at start, so a misspelt stage, policy, class or
scheme stops the service at once instead of failing the first eviction of that class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime

from gpusched.checkpoint.verification import valid_scheme
from gpusched.contracts.messages import PriorityClassName
from gpusched.domain.saga import Begin, CheckpointRef, DeadlinePolicy, Stage
from gpusched.infra.settings import CheckpointSettings


@dataclass(frozen=True)
class ClassPolicy:
    stage_required: Stage
    on_deadline: DeadlinePolicy


# A class the settings do not name gets the policy that never loses work: wait for a
# durable checkpoint and give up on the eviction rather than force it.
SAFEST: ClassPolicy = ClassPolicy(Stage.PERSISTED, DeadlinePolicy.ABORT)


@dataclass(frozen=True)
class EvictionPolicies:
    grace_s: float
    by_class: Mapping[str, ClassPolicy]

    @classmethod
    def from_settings(cls, settings: CheckpointSettings) -> EvictionPolicies:
        classes = set(settings.stage_required) | set(settings.deadline_policy)
        by_class: dict[str, ClassPolicy] = {}
        for name in classes:
            try:
                stage = Stage(settings.stage_required.get(name, SAFEST.stage_required))
                on_deadline = DeadlinePolicy(settings.deadline_policy.get(name, SAFEST.on_deadline))
            except ValueError as exc:
                raise ValueError(f"checkpoint settings for class {name!r}: {exc}") from exc
            by_class[name] = ClassPolicy(stage, on_deadline)
        return cls(settings.grace_s, by_class)

    def for_class(self, priority_class: str) -> ClassPolicy:
        return self.by_class.get(priority_class, SAFEST)

    def begin(
        self,
        *,
        saga_id: str,
        request_id: str,
        allocation_id: str,
        job_id: str,
        gpus: int,
        started_at: datetime,
        priority_class: str,
        reason: str,
        latest: tuple[CheckpointRef, datetime] | None,
        share_milli: int = 1000,
    ) -> Begin:
        """The saga's opening for an eviction request: the class's stage and deadline
        policy, and the job's newest verified checkpoint (``latest``: the checkpoint and
        when it was confirmed) as the lost-work baseline."""
        policy = self.for_class(priority_class)
        return Begin(
            saga_id=saga_id,
            request_id=request_id,
            allocation_id=allocation_id,
            job_id=job_id,
            gpus=gpus,
            started_at=started_at,
            grace_s=self.grace_s,
            policy=policy.on_deadline,
            stage_required=policy.stage_required,
            reason=reason,
            last_confirmed=None if latest is None else latest[0],
            # A checkpoint from an earlier allocation is where this one resumed from: no
            # work is lost from before this allocation started.
            last_confirmed_at=None if latest is None else max(latest[1], started_at),
            share_milli=share_milli,
        )


@dataclass(frozen=True)
class TrustPolicy:
    """The URI schemes taken on trust, without verification, per priority class. Empty
    by default: only what the service can verify counts (file://, unless verify_uris is
    off)."""

    by_class: Mapping[str, frozenset[str]]

    @classmethod
    def from_settings(cls, settings: CheckpointSettings) -> TrustPolicy:
        classes = {c.value for c in PriorityClassName}
        by_class: dict[str, frozenset[str]] = {}
        for name, schemes in settings.trusted_schemes.items():
            where = f"checkpoint.trusted_schemes[{name!r}]"
            if name not in classes:
                raise ValueError(f"{where}: not a priority class ({', '.join(sorted(classes))})")
            wrong = [s for s in schemes if not valid_scheme(s.lower())]
            if wrong:
                raise ValueError(
                    f"{where}: {', '.join(map(repr, wrong))} is not a URI scheme (write s3, "
                    "not s3:// or s3://bucket)"
                )
            by_class[name] = frozenset(s.lower() for s in schemes)
        if not settings.verify_uris and not any(by_class.values()):
            # Before, verify_uris=false took every claim on trust; now trust is named.
            raise ValueError(
                "checkpoint.verify_uris=false verifies no checkpoint claim and "
                "checkpoint.trusted_schemes trusts none, so every claim would be refused: "
                "name the schemes to take on trust per priority class, e.g. "
                'GPUSCHED_CHECKPOINT__TRUSTED_SCHEMES=\'{"p2-offline": ["file"]}\''
            )
        return cls(by_class)

    def trusts(self, priority_class: str | None, scheme: str) -> bool:
        """Whether a claim of a job of `priority_class` (None: not known) with a URI of
        `scheme` is taken on trust when it cannot be verified."""
        return priority_class is not None and scheme in self.by_class.get(priority_class, ())
