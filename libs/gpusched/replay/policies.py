"""The policies a replay compares, as settings of one engine.

- ``gpusched``: the control plane as it ships: the elastic controller's windows,
  cooldown, min lend and min runtime, victims by least lost work, evictions only after
  a confirmed checkpoint (or forced at the deadline where the class says so).
- ablations of it, one mechanism off each: ``no checkpoint wait`` (every eviction is
  forced at once: work since the last periodic checkpoint is lost), ``no lost-work-
  aware victims`` (victims ranked without their lost work), ``no hysteresis`` (no hold
  windows, no cooldown, no min lend, shrink threshold right under the target).
- ``static``: the inference pool alone serves inference; nothing is ever lent.
- ``kubernetes``: Kubernetes-native priority preemption: an autoscaler (HPA) sizes the
  serving replicas to its target utilization at once (scale-down after a stabilization
  window), a pending replica preempts training at once (lowest priority, then the most
  recently started), the victim gets a SIGTERM grace and loses its work since its last
  periodic checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from enum import StrEnum

from gpusched.checkpoint.policy import ClassPolicy, EvictionPolicies
from gpusched.domain.elastic import ElasticThresholds, VictimCandidate
from gpusched.domain.saga import DeadlinePolicy, Stage
from gpusched.infra.settings import CheckpointSettings, IngestSettings, PreemptionSettings
from gpusched.preemption.policy import ControllerLimits

__all__ = [
    "Kind",
    "KubernetesParams",
    "Policy",
    "ablations",
    "default_evictions",
    "default_limits",
    "kubernetes",
    "most_recent_first",
    "no_lost_work",
]


class Kind(StrEnum):
    GPUSCHED = "gpusched"
    STATIC = "static"
    KUBERNETES = "kubernetes"


@dataclass(frozen=True, slots=True)
class KubernetesParams:
    # terminationGracePeriodSeconds's default; a training job saves nothing in it.
    grace_s: float = 30.0
    # The HorizontalPodAutoscaler's target utilization and scale-down stabilization.
    target: float = 0.70
    scale_down_window_s: float = 300.0


@dataclass(frozen=True)
class Policy:
    name: str
    kind: Kind
    # GPUs of whole nodes dedicated to inference (the rest is the shared pool).
    inference_gpus: int
    limits: ControllerLimits = field(default_factory=lambda: default_limits())
    evictions: EvictionPolicies = field(default_factory=lambda: default_evictions())
    kubernetes: KubernetesParams = field(default_factory=KubernetesParams)
    description: str = ""

    def describe(self) -> dict[str, object]:
        limits, t = self.limits, self.limits.thresholds
        out: dict[str, object] = {
            "name": self.name,
            "kind": self.kind.value,
            "inference_gpus": self.inference_gpus,
            "description": self.description,
        }
        if self.kind is Kind.GPUSCHED:
            out["controller"] = {
                "expand_above": t.expand_above,
                "target": t.target,
                "shrink_below": t.shrink_below,
                "shared_below": t.shared_below,
                "expand_hold_s": limits.signals.expand_hold_s,
                "shrink_hold_s": limits.signals.shrink_hold_s,
                "cooldown_s": limits.cooldown_s,
                "min_lend_s": limits.min_lend_s,
                "min_runtime_s": limits.min_runtime_s,
                "max_evictions_per_min": limits.max_evictions_per_min,
                "victim_order": limits.victim_order.__name__,
            }
            out["evictions"] = {
                "grace_s": self.evictions.grace_s,
                "by_class": {
                    name: {"stage": p.stage_required.value, "on_deadline": p.on_deadline.value}
                    for name, p in sorted(self.evictions.by_class.items())
                },
            }
        if self.kind is Kind.KUBERNETES:
            k = self.kubernetes
            out["kubernetes"] = {
                "grace_s": k.grace_s,
                "hpa_target": k.target,
                "scale_down_window_s": k.scale_down_window_s,
            }
        return out


def default_limits(**changes: object) -> ControllerLimits:
    """The controller's limits from the shipped settings (``preemption.app.limits``),
    with ``changes`` to the settings section applied first."""
    p = PreemptionSettings().model_copy(update=changes)
    return ControllerLimits.from_settings(p, IngestSettings().stale_after_s)


def default_evictions() -> EvictionPolicies:
    return EvictionPolicies.from_settings(CheckpointSettings())


def no_lost_work(candidate: VictimCandidate, now: datetime) -> tuple[float | str, ...]:
    """Within a tier, every candidate alike: what is left of the ranking without lost
    work (borrowed first, whole nodes, whole islands, the larger)."""
    return ()


def most_recent_first(candidate: VictimCandidate, now: datetime) -> tuple[float | str, ...]:
    """kube-scheduler's last tie-break among victims: the most recently started."""
    return (-candidate.started_ts,)


def ablations(base: Policy) -> tuple[Policy, ...]:
    """``base`` with one mechanism switched off in each."""
    forced = EvictionPolicies(
        0.0,
        {
            name: ClassPolicy(Stage.SNAPSHOTTED, DeadlinePolicy.FORCE)
            for name in ("p0-urgent", "p1-normal", "p2-offline")
        },
    )
    t = base.limits.thresholds
    no_band = replace(
        base.limits,
        thresholds=ElasticThresholds(
            expand_above=t.expand_above,
            target=t.target,
            shrink_below=round(t.target - 0.01, 4),
            shared_below=t.shared_below,
        ),
        signals=replace(base.limits.signals, expand_hold_s=0.0, shrink_hold_s=0.0),
        cooldown_s=0.0,
        min_lend_s=0.0,
    )
    return (
        replace(
            base,
            name=f"{base.name}, no checkpoint wait",
            evictions=forced,
            description="every eviction forced at once: the work since the last periodic "
            "checkpoint is lost",
        ),
        replace(
            base,
            name=f"{base.name}, no lost-work-aware victims",
            limits=replace(base.limits, victim_order=no_lost_work),
            description="victims ranked without their lost work",
        ),
        replace(
            base,
            name=f"{base.name}, no hysteresis",
            limits=no_band,
            description="no hold windows, no cooldown, no min lend, shrink just under the target",
        ),
    )


def kubernetes(inference_gpus: int, params: KubernetesParams | None = None) -> Policy:
    return Policy(
        "kubernetes preemption",
        Kind.KUBERNETES,
        inference_gpus,
        kubernetes=params or KubernetesParams(),
        description="HPA-sized serving replicas preempt training at once (SIGTERM grace), "
        "lowest priority then most recently started; work since the last periodic "
        "checkpoint is lost",
    )
