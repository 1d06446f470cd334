"""The telemetry edge of one ingest replica: its partitions of the stream, folded in memory.

GPU telemetry is the highest-volume input of the system and lives for one window, so
it is not applied message by message (a transaction, an inbox row and an ack each).
Each replica reads the TELEMETRY partitions it owns through a consumer of its own,
without acks, starting `window_s` back in the stream: the window (window.py) is a fold
over the stream's last `window_s` seconds, rebuilt exactly after a restart. Every
`flush_interval_s` the replica writes its partitions' share of each pool in one
transaction (docs/ingest.md).

Bad input changes nothing and stops nothing: a malformed message is dead-lettered and
audited; a sample of a node outside the inventory, or naming a GPU the node does not
have, is refused, counted and dead-lettered once a minute per node (a misconfigured
exporter must not flood the dead-letter stream at its sampling rate); an unknown node
gets a grace period first, since the inventory event may not have reached this replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge, Histogram

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import GpuSample
from gpusched.contracts.subjects import TELEMETRY_PARTITIONS, Subjects, telemetry_partition
from gpusched.infra.bus import SETTLE_TIMEOUT_S, DeadLetters, PullFeed
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import Rejected, is_outage
from gpusched.infra.outages import Outage, describe
from gpusched.infra.settings import IngestSettings
from gpusched.ingest import store
from gpusched.ingest.handlers import UnknownNode, check_indexes
from gpusched.ingest.reader import SampleReader, SampleView
from gpusched.ingest.window import Added, Membership, TelemetryWindow

log = logging.getLogger(__name__)

SAMPLES = Counter(
    "gpusched_ingest_samples_total",
    "GPU node samples offered to this replica's window, by source and outcome",
    ["source", "outcome"],
)
WINDOW_SAMPLES = Gauge("gpusched_ingest_window_samples", "node samples in this replica's window")
WINDOW_NODES = Gauge("gpusched_ingest_window_nodes", "nodes with samples in this replica's window")
FOLD_LAG = Histogram(
    "gpusched_ingest_fold_lag_seconds",
    "from a sample's time to its fold into the window",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0),
)

# Refusals of one node for one reason are dead-lettered at most this often (all counted).
REPORT_EVERY_S = 60.0
# How many nodes' refusals are remembered for that; beyond, the memory starts over.
REMEMBERED_NODES = 100_000
# Samples held per unknown node during its grace.
HELD_PER_NODE = 64
# With no message for this long, make sure the consumer still exists (a NATS server that
# restarted without it answers fetches with silence, not an error).
IDLE_CHECK_S = 10.0
# The server deletes a replica's consumer this long after the replica stopped fetching.
CONSUMER_INACTIVE_S = 30.0

# The consumer its dead letters name: one for all replicas and restarts, so the second
# fold of a message after a restart makes the same dead letter (de-duplicated).
DEAD_LETTER_CONSUMER = "ingest-telemetry"
# Why a sample is refused (the dead letter's reason).
MALFORMED, REJECTED, UNKNOWN_NODE, FAILING = "malformed", "rejected", "unknown_node", "failing"


def owned_partitions(replicas: int, replica: int) -> tuple[int, ...]:
    """The telemetry partitions replica `replica` of `replicas` folds."""
    return tuple(p for p in range(TELEMETRY_PARTITIONS) if p % replicas == replica)


class TelemetryFold:
    """One replica's window over its telemetry partitions, fed by the bus and scrapes."""

    def __init__(
        self,
        nc: NatsClient,
        js: JetStreamContext,
        subjects: Subjects,
        settings: IngestSettings,
        dead_letters: DeadLetters,
        uow: UnitOfWorkFactory,
        *,
        service: str,
        max_clock_skew_s: float,
        monotonic: Callable[[], float] = time.monotonic,
        on_lag: Callable[[float], None] | None = None,
    ) -> None:
        """`on_lag`: called with each folded sample's lag in seconds (the benchmark's
        exact percentiles; the histogram metric has buckets)."""
        self._nc = nc
        self._js = js
        self._subjects = subjects
        self._settings = settings
        self._dlq = dead_letters
        self._uow = uow
        self._service = service
        self._skew = max_clock_skew_s
        self._monotonic = monotonic
        self.on_lag = on_lag
        self.window = TelemetryWindow(settings.window_s)
        self.partitions = owned_partitions(settings.replicas, settings.replica)
        self.membership: Membership | None = None
        self._reader = SampleReader()
        self._unknown_since: dict[str, float] = {}
        # Samples of nodes unknown for less than the grace, folded if the node arrives.
        self._held: dict[str, list[tuple[int, SampleView]]] = {}
        self._reported: dict[tuple[str, str], float] = {}
        self._counted = {
            (source, outcome): SAMPLES.labels(source, outcome)
            for source in ("bus", "scrape")
            for outcome in (
                "accepted",
                "duplicate",
                "late",
                "ignored",
                MALFORMED,
                REJECTED,
                UNKNOWN_NODE,
                FAILING,
            )
        }
        self._stream = subjects.stream("TELEMETRY")
        self._consumer = ""
        self._resume_at: datetime | None = None
        # Each node's newest folded sample: its memory readings, for the GPU gauges.
        self.latest: dict[str, SampleView] = {}

    # --- folding (no I/O) -----------------------------------------------------------
    def take(self, raw: bytes, subject: str, now: datetime) -> tuple[str, str] | None:
        """Fold one stream message; (reason, error) when it is to be dead-lettered now."""
        try:
            sample = self._reader.read(raw, subject, now, max_clock_skew_s=self._skew)
        except MalformedMessage as exc:
            self._counted["bus", MALFORMED].inc()
            return MALFORMED, str(exc)
        if sample is None:
            self._counted["bus", "ignored"].inc()  # a valid message of another type
            return None
        partition = int(subject.split(".")[3])
        refused = self._fold(sample, partition, now, "bus")
        if refused is None:
            return None
        reason = refused[0]
        if reason == UNKNOWN_NODE:
            first = self._unknown_since.setdefault(sample.node, self._monotonic())
            if self._monotonic() - first < self._settings.unknown_node_grace_s:
                # The inventory event may be on its way: fold it once the node is known.
                held = self._held.setdefault(sample.node, [])
                if len(held) < HELD_PER_NODE and len(self._held) <= REMEMBERED_NODES:
                    held.append((partition, sample))
                    return None
            self._held.pop(sample.node, None)
            self._counted["bus", UNKNOWN_NODE].inc()
        return refused if self._due(sample.node, reason) else None

    def fold(
        self, sample: GpuSample, partition: int, now: datetime, source: str
    ) -> tuple[str, str] | None:
        """Fold one valid sample in; (reason, error) if the inventory refuses it."""
        return self._fold(SampleView.of(sample), partition, now, source)

    def _fold(
        self, sample: SampleView, partition: int, now: datetime, source: str
    ) -> tuple[str, str] | None:
        if self.membership is None:
            raise RuntimeError("the pool membership is not loaded yet")
        try:
            gpus = self.membership.nodes.get(sample.node)
            try:
                check_indexes(sample.node, [index for index, _ in sample.readings], gpus)
            except UnknownNode as exc:
                return UNKNOWN_NODE, str(exc)  # counted by the caller, which may hold it
            except Rejected as exc:
                self._counted[source, REJECTED].inc()
                return REJECTED, str(exc)
            assert gpus is not None
            self._unknown_since.pop(sample.node, None)
            at = sample.time.timestamp()
            ts = now.timestamp()
            outcome = self.window.add(sample.node, partition, gpus, at, sample.readings, ts)
            if outcome is Added.ACCEPTED:
                newest = self.latest.get(sample.node)
                if newest is None or newest.time <= sample.time:
                    self.latest[sample.node] = sample
        except Exception as exc:  # a bug must cost one sample, not the replica
            self._counted[source, FAILING].inc()
            log.exception("could not fold a sample of %r", sample.node)
            return FAILING, f"{type(exc).__name__}: {exc}"
        self._counted[source, outcome].inc()
        lag = max(0.0, ts - at)
        FOLD_LAG.observe(lag)
        if self.on_lag is not None:
            self.on_lag(lag)
        return None

    def accept_samples(self, samples: Sequence[GpuSample]) -> dict[str, str]:
        """Fold the samples of a scrape round (not the bus): the refused nodes and why.
        A scrape is no message to dead-letter; an unknown node is refused at once."""
        if self.membership is None:  # a scrape before the replica's start finished
            return {
                x.node: "ingest is starting: the pool membership is not loaded yet" for x in samples
            }
        now = utcnow()
        refused: dict[str, str] = {}
        for sample in samples:
            verdict = self.fold(sample, telemetry_partition(sample.node), now, "scrape")
            if verdict is not None:
                if verdict[0] == UNKNOWN_NODE:
                    self._counted["scrape", UNKNOWN_NODE].inc()
                refused[sample.node] = verdict[1]
        return refused

    def _due(self, node: str, reason: str) -> bool:
        """Whether a refusal of this node for this reason is to be dead-lettered now."""
        now = self._monotonic()
        key = (node, reason)
        last = self._reported.get(key)
        if last is not None and now - last < REPORT_EVERY_S:
            return False
        if len(self._reported) >= REMEMBERED_NODES:
            self._reported.clear()
        if len(self._unknown_since) >= REMEMBERED_NODES:
            self._unknown_since.clear()
        self._reported[key] = now
        return True

    # --- flushing ---------------------------------------------------------------------
    async def flush(self, uow: UnitOfWork, now: datetime) -> None:
        """Write this replica's share of every pool; reload the membership if it changed."""
        version = await store.membership_version(uow)
        if self.membership is None or self.membership.version != version:
            await self._reload(uow)
        assert self.membership is not None
        partials = self.window.partials(now.timestamp(), self.membership, self.partitions)
        await store.write_partials(uow, partials, now, self.membership.version)
        WINDOW_SAMPLES.set(len(self.window))
        WINDOW_NODES.set(self.window.nodes)

    async def _reload(self, uow: UnitOfWork) -> None:
        self.membership = await store.load_membership(uow)
        for node in self.window.node_names() - self.membership.nodes.keys():
            self.window.forget(node)  # removed from the inventory
        for node in self.latest.keys() - self.membership.nodes.keys():
            del self.latest[node]
        known = [node for node in self._held if node in self.membership.nodes]
        now = utcnow()
        for node in known:
            for partition, sample in self._held.pop(node):
                self._fold(sample, partition, now, "bus")

    # --- the stream -------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Fold this replica's partitions until `stop`; outages are waited out."""
        if not await self._load_membership(stop):
            return
        outage = Outage(log, self._service, "telemetry fold")
        subscribed: PullFeed | None = None
        idle_since = self._monotonic()
        try:
            while not stop.is_set():
                try:
                    if subscribed is None:
                        subscribed = await self._subscribe()
                        idle_since = self._monotonic()
                    msgs = await subscribed.next_batch(1.0)
                except (NatsTimeout, TimeoutError):
                    if self._monotonic() - idle_since > IDLE_CHECK_S:
                        idle_since = self._monotonic()
                        if not await self._consumer_exists():
                            log.warning("telemetry consumer %s is gone; again", self._consumer)
                            await self._unsubscribe(subscribed)
                            subscribed = None
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    if stop.is_set():
                        break
                    if is_outage(exc):
                        outage.begin(exc)
                    else:
                        log.warning("telemetry fetch failed: %s; subscribing again", describe(exc))
                    await self._unsubscribe(subscribed)
                    subscribed = None
                    await outage.backoff(stop)
                    continue
                outage.end()
                idle_since = self._monotonic()
                await self._take_all(msgs)
        finally:
            await self._unsubscribe(subscribed)
            await self._delete_consumer()

    async def _take_all(self, msgs: list[Msg]) -> None:
        now = utcnow()
        refusals: list[tuple[Msg, str, str]] = []
        for msg in msgs:
            verdict = self.take(msg.data, msg.subject, now)
            if verdict is not None:
                refusals.append((msg, *verdict))
        if msgs:
            with contextlib.suppress(Exception):
                self._resume_at = msgs[-1].metadata.timestamp
        for msg, reason, error in refusals:
            try:
                await self._dlq.send(
                    msg, DEAD_LETTER_CONSUMER, reason, error, subject=self._published(msg.subject)
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # Counted already; the sample changed nothing. No redelivery without
                # acks: say so rather than hold the fold behind the dead-letter stream.
                log.error("could not dead-letter a sample on %s: %s", msg.subject, describe(exc))

    def _published(self, stored: str) -> str:
        """The public subject a sample was published on (`<p>.telemetry.gpu.<node>`)."""
        tokens = stored.split(".")
        return ".".join(tokens[:3] + tokens[4:]) if len(tokens) == 5 else stored

    async def _load_membership(self, stop: asyncio.Event) -> bool:
        waiting = Outage(log, self._service, "telemetry membership")
        while not stop.is_set():
            try:
                async with self._uow() as uow:
                    await self._reload(uow)
                waiting.end()
                return True
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not is_outage(exc):
                    raise
                waiting.begin(exc)
                await waiting.backoff(stop)
        return False

    async def _subscribe(self) -> PullFeed:
        """A consumer of this replica's partitions from the window's start (or from the
        last message folded, after a lost consumer), under a fresh name."""
        await self._delete_consumer()
        start = utcnow() - timedelta(seconds=self._settings.window_s)
        if self._resume_at is not None:
            start = max(start, self._resume_at)
        self._consumer = f"ingest-{self._settings.replica}-{uuid.uuid4().hex[:12]}"
        config = ConsumerConfig(
            name=self._consumer,
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_TIME,
            opt_start_time=start,
            filter_subjects=[self._subjects.gpu_telemetry_partition(p) for p in self.partitions],
            inactive_threshold=CONSUMER_INACTIVE_S,
            mem_storage=True,
        )
        await self._js.add_consumer(self._stream, config)
        feed = PullFeed(self._nc, self._stream, self._consumer, batch=self._settings.fetch_batch)
        await feed.start()
        return feed

    async def _unsubscribe(self, feed: PullFeed | None) -> None:
        if feed is not None:
            await feed.close()

    async def _consumer_exists(self) -> bool:
        try:
            await asyncio.wait_for(
                self._js.consumer_info(self._stream, self._consumer), SETTLE_TIMEOUT_S
            )
        except NotFoundError:
            return False
        except Exception:
            return True  # unknown (e.g. NATS away): the fetch loop will tell
        return True

    async def _delete_consumer(self) -> None:
        if not self._consumer:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(
                self._js.delete_consumer(self._stream, self._consumer), SETTLE_TIMEOUT_S
            )
        self._consumer = ""
