"""Per priority class: which checkpoint stage an eviction waits for, and what its deadline does.

Read once from Settings().checkpoint at start, so a misspelt stage or policy stops the
service at once instead of failing the first eviction of that class.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpusched.domain.saga import DeadlinePolicy, Stage
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
