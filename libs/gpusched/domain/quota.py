"""Teams, their GPU quotas per model, priority governance, and DRF fair share.

Pure: the quota book is parsed from already-loaded YAML data; usage comes from the
ledger's live allocations. Vocabulary:
- guaranteed: GPUs of a model the team may always hold; an allocation within it is not
  borrowed.
- max: the most the team may hold by borrowing idle GPUs beyond its guarantee. An
  allocation that takes the team above its guarantee is *borrowed*; preemption
  reclaims borrowed allocations first.
- max priority: the highest priority class the team may use; above it a submission is
  rejected or held for an operator's approval (``above_max``).
- allow_process: whether the team may submit ``process`` workloads (a command the
  cluster agent runs); off unless the operator turns it on.
- dominant share (DRF): a team's largest share of any GPU model's capacity; among
  equally urgent jobs the team with the smallest dominant share goes first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from gpusched.domain.ledger import Allocation, PriorityClass

__all__ = [
    "ANY_MODEL",
    "AboveMax",
    "ModelQuota",
    "QuotaBook",
    "QuotaDecision",
    "QuotaError",
    "QuotaVerdict",
    "TeamPolicy",
    "dominant_shares",
    "parse_quotas",
    "usage_of",
]

E = TypeVar("E", bound=StrEnum)

# The quota entry that applies to every model a team's entry does not name.
ANY_MODEL = "*"

# Training classes from least to most urgent: "above the max" compares on this order.
_URGENCY = (PriorityClass.P2_OFFLINE, PriorityClass.P1_NORMAL, PriorityClass.P0_URGENT)


class QuotaError(ValueError):
    """The quota file is malformed; the message names the offending entry."""


class AboveMax(StrEnum):
    """What happens to a submission above the team's max priority class."""

    REJECT = "reject"
    HOLD = "hold"  # queued only once an operator approves it


@dataclass(frozen=True, slots=True)
class ModelQuota:
    guaranteed: int
    max: int


@dataclass(frozen=True, slots=True)
class TeamPolicy:
    name: str
    quotas: Mapping[str, ModelQuota]
    max_priority: PriorityClass = PriorityClass.P1_NORMAL
    above_max: AboveMax = AboveMax.REJECT
    # Inference services are governed by quota too, but their class is fixed.
    may_serve_inference: bool = True
    # A `process` workload runs the team's own command on the cluster: an operator's
    # decision per team, never a default.
    allow_process: bool = False

    def quota(self, model: str) -> ModelQuota:
        return self.quotas.get(model) or self.quotas.get(ANY_MODEL) or ModelQuota(0, 0)

    def allows(self, priority: PriorityClass) -> bool:
        """Whether the team may use ``priority`` without an operator's approval."""
        if priority is PriorityClass.INFERENCE:
            return self.may_serve_inference
        return _URGENCY.index(priority) <= _URGENCY.index(self.max_priority)

    def largest_max(self, models: Iterable[str]) -> int:
        return max((self.quota(model).max for model in models), default=0)


class QuotaVerdict(StrEnum):
    GUARANTEED = "guaranteed"
    BORROWED = "borrowed"
    OVER_MAX = "over_max"


@dataclass(frozen=True, slots=True)
class QuotaDecision:
    verdict: QuotaVerdict
    used: int  # GPUs of the model the team held before this allocation
    quota: ModelQuota

    @property
    def allowed(self) -> bool:
        return self.verdict is not QuotaVerdict.OVER_MAX

    @property
    def borrowed(self) -> bool:
        return self.verdict is QuotaVerdict.BORROWED


@dataclass(frozen=True, slots=True)
class QuotaBook:
    teams: Mapping[str, TeamPolicy]

    def team(self, name: str) -> TeamPolicy | None:
        return self.teams.get(name)

    def decide(
        self, team: str, model: str, gpus: int, usage: Mapping[tuple[str, str], int]
    ) -> QuotaDecision:
        """May ``team`` take ``gpus`` more GPUs of ``model``, and are they borrowed?"""
        policy = self.teams.get(team)
        quota = policy.quota(model) if policy is not None else ModelQuota(0, 0)
        used = usage.get((team, model), 0)
        if used + gpus <= quota.guaranteed:
            verdict = QuotaVerdict.GUARANTEED
        elif used + gpus <= quota.max:
            verdict = QuotaVerdict.BORROWED
        else:
            verdict = QuotaVerdict.OVER_MAX
        return QuotaDecision(verdict, used, quota)


def usage_of(allocations: Iterable[Allocation]) -> dict[tuple[str, str], int]:
    """GPUs held per (team, model) by live allocations."""
    usage: dict[tuple[str, str], int] = {}
    for allocation in allocations:
        key = (allocation.team, allocation.model)
        usage[key] = usage.get(key, 0) + len(allocation.gpus)
    return usage


def dominant_shares(
    usage: Mapping[tuple[str, str], int], capacity: Mapping[str, int]
) -> dict[str, float]:
    """Each team's largest share of any model's GPUs (DRF's dominant share)."""
    shares: dict[str, float] = {}
    for (team, model), used in usage.items():
        total = capacity.get(model, 0)
        share = used / total if total else 0.0
        shares[team] = max(shares.get(team, 0.0), share)
    return shares


# --- the YAML file ----------------------------------------------------------------------


def parse_quotas(data: Mapping[str, Any]) -> QuotaBook:
    """Build the book from ``{teams: {name: {max_priority, above_max, inference,
    allow_process, gpus: {model: {guaranteed, max}}}}}``; ``max`` defaults to
    ``guaranteed`` (no borrowing), ``allow_process`` to false."""
    teams = data.get("teams")
    if not isinstance(teams, Mapping) or not teams:
        raise QuotaError("quotas need a non-empty 'teams' mapping")
    book: dict[str, TeamPolicy] = {}
    for name, entry in teams.items():
        where = f"teams.{name}"
        if not isinstance(entry, Mapping):
            raise QuotaError(f"{where}: expected a mapping")
        unknown = sorted(set(entry) - _TEAM_FIELDS)
        if unknown:
            raise QuotaError(f"{where}: unknown field(s) {', '.join(unknown)}")
        book[str(name)] = TeamPolicy(
            name=str(name),
            quotas=_parse_gpus(entry.get("gpus", {}), where),
            max_priority=_parse_class(entry.get("max_priority", "p1-normal"), where),
            above_max=_parse_enum(AboveMax, entry.get("above_max", "reject"), where, "above_max"),
            may_serve_inference=_parse_bool(entry.get("inference", True), where, "inference"),
            allow_process=_parse_bool(entry.get("allow_process", False), where, "allow_process"),
        )
    return QuotaBook(book)


_TEAM_FIELDS = frozenset({"max_priority", "above_max", "gpus", "inference", "allow_process"})


def _parse_gpus(value: object, where: str) -> dict[str, ModelQuota]:
    if not isinstance(value, Mapping):
        raise QuotaError(f"{where}.gpus: expected a mapping of GPU model to quota")
    quotas: dict[str, ModelQuota] = {}
    for model, entry in value.items():
        at = f"{where}.gpus.{model}"
        if not isinstance(entry, Mapping) or "guaranteed" not in entry:
            raise QuotaError(f"{at}: expected {{guaranteed: N, max: M}}")
        guaranteed = _count(entry["guaranteed"], f"{at}.guaranteed")
        most = _count(entry.get("max", guaranteed), f"{at}.max")
        if most < guaranteed:
            raise QuotaError(f"{at}: max {most} is below guaranteed {guaranteed}")
        quotas[str(model)] = ModelQuota(guaranteed, most)
    return quotas


def _count(value: object, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise QuotaError(f"{where}: expected a whole number >= 0, got {value!r}")
    return value


def _parse_class(value: object, where: str) -> PriorityClass:
    priority = _parse_enum(PriorityClass, value, where, "max_priority")
    if priority is PriorityClass.INFERENCE:
        raise QuotaError(f"{where}.max_priority: must be a training class, not inference")
    return priority


def _parse_enum(kind: type[E], value: object, where: str, field: str) -> E:
    try:
        return kind(str(value))
    except ValueError:
        allowed = ", ".join(member.value for member in kind)
        raise QuotaError(f"{where}.{field}: {value!r} is not one of {allowed}") from None


def _parse_bool(value: object, where: str, field: str) -> bool:
    if not isinstance(value, bool):
        raise QuotaError(f"{where}.{field}: expected true or false, got {value!r}")
    return value
