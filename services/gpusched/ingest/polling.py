"""What the pull sources of GPU samples (dcgm-exporter scraping, Prometheus queries)
share: the sink they hand each round to, a fixed-rate round loop, a bounded body read,
and logging that says once when a target's state changes instead of once per round."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp
from prometheus_client import Counter

from gpusched.contracts.messages import GpuSample

__all__ = ["BodyTooLarge", "Sink", "StateLog", "hand_over", "read_body", "run_rounds"]

# A round's samples in; the nodes refused (not stored) and why out.
Sink = Callable[[list[GpuSample]], Awaitable[dict[str, str]]]

SINK_FAILURES = Counter(
    "gpusched_ingest_pull_sink_failures_total",
    "rounds of a pull source whose samples the sink did not take in time or raised on",
    ["source", "reason"],
)


async def hand_over(
    sink: Sink, samples: list[GpuSample], budget_s: float, source: str, log: logging.Logger
) -> dict[str, str] | None:
    """The sink's refusals, or None when it did not take the round within `budget_s`
    or raised: that round's readings are lost (the next brings fresh ones), the loop
    is not."""
    try:
        async with asyncio.timeout(max(budget_s, 0.0)):
            return await sink(samples)
    except TimeoutError:
        SINK_FAILURES.labels(source, "timeout").inc()
        log.warning("%s: the sink did not take %d samples in time", source, len(samples))
    except Exception as exc:
        SINK_FAILURES.labels(source, "error").inc()
        log.warning("%s: the sink failed on %d samples: %r", source, len(samples), exc)
    return None


class BodyTooLarge(Exception):
    pass


async def read_body(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or BodyTooLarge as soon as it passes `limit` bytes (counted
    after decompression, so a small gzip bomb is cut off too)."""
    if (resp.content_length or 0) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in resp.content.iter_chunked(256 * 1024):
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


class StateLog:
    """One log line per key whose state changed since the last round, none for a key
    that stays as it was: 1,000 targets down must not mean 1,000 lines every 5 s. When
    many keys change alike in one round (a switch fails, a rack comes back), they share
    one line that names a few of them and counts the rest."""

    NAMED = 5  # changes to one state in a round logged one by one; more share a line

    def __init__(self, log: logging.Logger, what: str, good: str = "ok") -> None:
        self._log = log
        self._what = what
        self._good = good
        self._states: dict[str, str] = {}
        self._changes: dict[str, list[tuple[str, str | None, str]]] = {}

    def note(self, key: str, state: str, detail: str = "") -> None:
        """Record this round's state of `key`; `flush` logs what changed."""
        before = self._states.get(key)
        self._states[key] = state
        if before == state or (before is None and state == self._good):
            return
        self._changes.setdefault(state, []).append((key, before, detail or state))

    def flush(self) -> None:
        for state, changes in self._changes.items():
            if len(changes) <= self.NAMED:
                for key, before, detail in changes:
                    self._line(key, state, before, detail)
                continue
            keys = ", ".join(key for key, _, _ in changes[: self.NAMED])
            more = f" and {len(changes) - self.NAMED} more"
            if state == self._good:
                self._log.info("%d %ss %s again: %s%s", len(changes), self._what, state, keys, more)
            else:
                first, _, detail = changes[0]
                self._log.warning(
                    "%d %ss %s: %s%s (%s: %s)",
                    len(changes), self._what, state, keys, more, first, detail,
                )  # fmt: skip
        self._changes.clear()

    def _line(self, key: str, state: str, before: str | None, detail: str) -> None:
        if state == self._good:
            self._log.info("%s %s: %s again (was %s)", self._what, key, state, before)
        else:
            self._log.warning("%s %s: %s: %s", self._what, key, state, detail)

    def forget_others(self, keys: set[str]) -> None:
        """Drop targets no longer listed, so a node that comes back is logged afresh."""
        for key in self._states.keys() - keys:
            del self._states[key]


async def run_rounds(
    name: str,
    interval_s: float,
    one_round: Callable[[], Awaitable[object]],
    stop: asyncio.Event,
    log: logging.Logger,
) -> None:
    """Call `one_round` every `interval_s` at a fixed rate until `stop` is set.

    A round is expected to bound itself within the interval; one that overran anyway
    skips the ticks it missed rather than running back to back. A round that raises is
    logged and the next one runs: a source's loop never dies of one bad round.
    """
    loop = asyncio.get_running_loop()
    due = loop.time()
    while not stop.is_set():
        try:
            await one_round()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("%s: a round failed; the next one runs as planned", name)
        due += interval_s
        now = loop.time()
        if now > due:
            missed = int((now - due) // interval_s) + 1
            log.warning("%s: a round overran its %.1f s; skipping %d", name, interval_s, missed)
            due += missed * interval_s
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), due - now)
