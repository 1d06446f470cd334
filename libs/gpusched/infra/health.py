"""Liveness and readiness of one service process, as its HTTP endpoint reports them.

Liveness is the event loop answering at all: the endpoint is served on the loop
(metrics.HealthServer), so a loop wedged by a blocking call or a runaway task stops
answering and the probe fails, which a thread-served endpoint would hide.

Readiness is what the process has to do its job: it has finished starting (connected,
migrated, built), and every registered check passes now. The runtime registers the
checks every service shares (NATS connected, PostgreSQL answering, each consumer and
loop advancing); a service may add its own (`ServiceRuntime.readiness`). A check
returns None when all is well, else one line saying what is wrong.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["Check", "Health", "Stage", "Verdict", "stalled"]

# Returns None when the part it watches is fine, else what is wrong, in one line.
Check = Callable[[], Awaitable[str | None]]

# A check that has not answered by then counts as failing (a probe must not hang).
CHECK_TIMEOUT_S = 2.0


class Stage(StrEnum):
    """Where a service process is in its life; only RUNNING can be ready."""

    STARTING = "starting"
    CONNECTING = "connecting"
    MIGRATING = "migrating"
    BUILDING = "building"
    RUNNING = "running"
    STOPPING = "stopping"


@dataclass(frozen=True)
class Verdict:
    service: str
    stage: Stage
    problems: tuple[str, ...]

    @property
    def ready(self) -> bool:
        return self.stage is Stage.RUNNING and not self.problems

    def as_json(self) -> dict[str, object]:
        return {
            "service": self.service,
            "ready": self.ready,
            "stage": str(self.stage),
            "problems": list(self.problems),
        }


@dataclass
class Health:
    """The stage a service is in and the checks that decide whether it is ready."""

    service: str
    stage: Stage = Stage.STARTING
    _checks: list[tuple[str, Check]] = field(default_factory=list)

    def add(self, name: str, check: Check) -> None:
        self._checks.append((name, check))

    async def verdict(self) -> Verdict:
        if self.stage is not Stage.RUNNING:
            return Verdict(self.service, self.stage, (f"{self.service} is {self.stage}",))
        answers = await asyncio.gather(*(self._run(name, check) for name, check in self._checks))
        return Verdict(self.service, self.stage, tuple(a for a in answers if a is not None))

    @staticmethod
    async def _run(name: str, check: Check) -> str | None:
        try:
            return await asyncio.wait_for(check(), CHECK_TIMEOUT_S)
        except TimeoutError:
            return f"{name}: no answer within {CHECK_TIMEOUT_S:.0f} s"
        except Exception as exc:  # a broken check is a failing check, never a crash
            return f"{name}: {type(exc).__name__}: {exc}"


def stalled(what: str, last_turn: float, limit_s: float, now: float | None = None) -> str | None:
    """`what` has not turned for longer than `limit_s` (monotonic seconds)."""
    idle = (time.monotonic() if now is None else now) - last_turn
    return f"{what} has not advanced for {idle:.0f} s" if idle > limit_s else None
