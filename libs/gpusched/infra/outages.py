"""Waiting out an outage: one warning when it starts, one line when it ends, a backoff.

An outage (`errors.is_outage`: PostgreSQL or NATS unreachable) is not the fault of the
message or the tick that met it. Whoever meets one keeps its work in hand, backs off
and tries again; nothing is dead-lettered and no traceback is logged per retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time

from gpusched.infra import metrics

# The first retry comes soon (a dropped connection is often back at once); later ones
# double up to the longest, so a long outage costs a server a try every few seconds.
FIRST_BACKOFF_S = 0.2
LONGEST_BACKOFF_S = 5.0


class Outage:
    """The outage state of one component of a service (a consumer, the relay, a loop).

    `begin` on every failure that is an outage (logs only the first), `end` on the next
    success (logs once, if an outage was on), `backoff` between tries.
    """

    def __init__(
        self,
        log: logging.Logger,
        service: str,
        component: str,
        *,
        first_s: float = FIRST_BACKOFF_S,
        longest_s: float = LONGEST_BACKOFF_S,
    ) -> None:
        self._log = log
        self._service = service
        self.component = component
        self._first = first_s
        self._longest = longest_s
        self._delay = first_s
        self._since: float | None = None
        self._over = asyncio.Event()
        self._over.set()

    @property
    def active(self) -> bool:
        return self._since is not None

    def begin(self, exc: BaseException) -> None:
        if self._since is not None:
            return
        self._since = time.monotonic()
        self._delay = self._first
        self._over.clear()
        metrics.OUTAGES.labels(self._service, self.component).inc()
        metrics.OUTAGE_ACTIVE.labels(self._service, self.component).set(1)
        self._log.warning(
            "%s: server unreachable (%s); waiting for it, retrying with backoff",
            self.component,
            describe(exc),
        )

    def end(self) -> None:
        if self._since is None:
            return
        lasted = time.monotonic() - self._since
        self._since = None
        self._over.set()
        metrics.OUTAGE_ACTIVE.labels(self._service, self.component).set(0)
        self._log.warning("%s: server reachable again after %.1f s", self.component, lasted)

    def next_delay(self) -> float:
        """The pause before the next try: doubling up to the longest, with jitter (so
        replicas and consumers do not retry in step)."""
        delay = self._delay
        self._delay = min(self._delay * 2, self._longest)
        return delay * random.uniform(0.8, 1.2)

    async def backoff(self, stop: asyncio.Event | None = None) -> None:
        """Sleep the next delay; returns early when `stop` is set."""
        delay = self.next_delay()
        if stop is None:
            await asyncio.sleep(delay)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), delay)

    async def over(self) -> None:
        """Wait until no outage is on."""
        await self._over.wait()


def describe(exc: BaseException) -> str:
    """One line naming an error and its root cause, for a log line without a traceback."""
    text = _first_line(exc)
    cause = exc.__cause__ or exc.__context__
    if cause is not None and cause is not exc:
        text += f" <- {_first_line(cause)}"
    return text[:300]


def _first_line(exc: BaseException) -> str:
    # SQLAlchemy appends the statement and its parameters on further lines.
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
