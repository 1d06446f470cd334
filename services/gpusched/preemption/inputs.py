"""The controller's inputs, read so that one bad item never stops a decision (DESIGN §5).

A pool snapshot is read item by item: a service reading that is missing a figure or
holds an absurd one (a P99 that is not a finite number of milliseconds under a day, a
negative queue) is left out, and the snapshot is used for the rest. So is a pool this
version does not need with figures that do not parse. Only a snapshot without usable
inference and shared pool figures says nothing, and is dead-lettered.

Each item left out is a `SkippedInput`. `Skips` counts every one in a metric and says
which are new (so the caller logs and audits a bad item once, not on every snapshot).
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, Final

from prometheus_client import Counter
from pydantic import ValidationError

from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import PoolSnapshot, PoolState, ServiceState
from gpusched.domain.elastic import VictimCandidate
from gpusched.domain.inventory import Pool

log = logging.getLogger(__name__)

# A P99 above a day is no latency but a broken exporter or clock.
MAX_P99_MS: Final = 86_400_000.0
# How many distinct skipped items a process remembers as already reported.
REMEMBERED: Final = 1024
_NEEDED_POOLS: Final = frozenset({Pool.INFERENCE.value, Pool.SHARED.value})

INPUTS_SKIPPED = Counter(
    "gpusched_preemption_inputs_skipped",
    "Controller inputs left out of a decision because they could not be read "
    "(a service reading, a pool, an allocation or a victim candidate)",
    ["kind"],
)


class InputKind(StrEnum):
    SERVICE_READING = "service_reading"
    POOL_READING = "pool_reading"
    ALLOCATION = "allocation"
    CANDIDATE = "candidate"


@dataclass(frozen=True, slots=True)
class SkippedInput:
    kind: InputKind
    key: str  # the service, pool or allocation id
    reason: str

    def describe(self) -> dict[str, str]:
        return {"kind": self.kind.value, "key": self.key, "reason": self.reason}


def read_snapshot(data: Mapping[str, Any]) -> tuple[PoolSnapshot, tuple[SkippedInput, ...]]:
    """The snapshot with every unreadable service and unneeded pool left out, and what
    was left out. MalformedMessage if what remains is no snapshot."""
    skipped: list[SkippedInput] = []
    services = data.get("services")
    pools = data.get("pools")
    cleaned = dict(data)
    if isinstance(services, list):
        cleaned["services"] = [s for s in services if _keep_service(s, skipped)]
    if isinstance(pools, list):
        cleaned["pools"] = [p for p in pools if _keep_pool(p, skipped)]
    try:
        return PoolSnapshot.model_validate(cleaned), tuple(skipped)
    except ValidationError as exc:
        raise MalformedMessage(f"pool.snapshot: {_first_error(exc)}") from exc


def _keep_service(raw: object, skipped: list[SkippedInput]) -> bool:
    name = raw.get("service") if isinstance(raw, Mapping) else None
    key = name if isinstance(name, str) else "?"
    try:
        service = ServiceState.model_validate(raw)
    except ValidationError as exc:
        skipped.append(SkippedInput(InputKind.SERVICE_READING, key, _first_error(exc)))
        return False
    why = _absurd(service)
    if why is not None:
        skipped.append(SkippedInput(InputKind.SERVICE_READING, key, why))
        return False
    return True


def _absurd(service: ServiceState) -> str | None:
    if not math.isfinite(service.p99_ms) or not 0 <= service.p99_ms <= MAX_P99_MS:
        return f"p99_ms {service.p99_ms!r} is not between 0 and {MAX_P99_MS:.0f}"
    if service.queue_depth < 0 or service.requests < 0:
        return f"negative counts (queue_depth {service.queue_depth}, requests {service.requests})"
    return None


def _keep_pool(raw: object, skipped: list[SkippedInput]) -> bool:
    name = raw.get("pool") if isinstance(raw, Mapping) else None
    if name in _NEEDED_POOLS:
        return True  # needed: if it does not parse, the snapshot does not either
    try:
        pool = PoolState.model_validate(raw)
    except ValidationError as exc:
        key = name if isinstance(name, str) else "?"
        skipped.append(SkippedInput(InputKind.POOL_READING, key, _first_error(exc)))
        return False
    if not math.isfinite(pool.util):
        skipped.append(SkippedInput(InputKind.POOL_READING, pool.pool, "util is not finite"))
        return False
    return True


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the message"
    return f"{where}: {error['msg']}"


def vet_candidates(
    candidates: Iterable[VictimCandidate], now: datetime
) -> tuple[tuple[VictimCandidate, ...], tuple[SkippedInput, ...]]:
    """The candidates a victim choice can rank at `now`, and those whose data cannot be
    ranked (a time it cannot compare, lost work that is not a number): each is tried on
    its own, so one of them cannot fail the choice for all."""
    usable: list[VictimCandidate] = []
    skipped: list[SkippedInput] = []
    for candidate in candidates:
        try:
            runtime_s = (now - candidate.started_at).total_seconds()
            lost = candidate.lost_work_gpu_seconds(now)
            rank = candidate.priority_class.preemption_rank
            if not (math.isfinite(runtime_s) and math.isfinite(lost)) or rank is None:
                raise ValueError(f"runtime {runtime_s!r} s, lost work {lost!r} GPU-seconds")
        except Exception as exc:  # any of its data: isolated, reported, never fatal
            why = f"cannot be ranked: {type(exc).__name__}: {exc}"
            skipped.append(SkippedInput(InputKind.CANDIDATE, candidate.allocation_id, why))
            continue
        usable.append(candidate)
    return tuple(usable), tuple(skipped)


class Skips:
    """Counts skipped inputs and remembers the recent ones, so each distinct bad item
    (kind, key, reason) is reported once per process, however often it comes back."""

    def __init__(self, remembered: int = REMEMBERED) -> None:
        self._seen: OrderedDict[SkippedInput, None] = OrderedDict()
        self._remembered = remembered

    def new(self, skipped: tuple[SkippedInput, ...] | list[SkippedInput]) -> list[SkippedInput]:
        """Count every one; return those not reported before (and log them)."""
        fresh: list[SkippedInput] = []
        for item in skipped:
            INPUTS_SKIPPED.labels(item.kind.value).inc()
            if item in self._seen:
                self._seen.move_to_end(item)
                continue
            self._seen[item] = None
            if len(self._seen) > self._remembered:
                self._seen.popitem(last=False)
            log.warning("controller input skipped: %s %s: %s", item.kind, item.key, item.reason)
            fresh.append(item)
        return fresh
