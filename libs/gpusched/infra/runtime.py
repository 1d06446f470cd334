"""The process runtime every service shares: connect, migrate, relay, consume, stop.

A service's app module (its composition root) builds its handlers and registers
them here; nothing connects at import time (STYLE 8). Shutdown is graceful: stop
fetching, finish the messages in hand, drain the outbox once more, close (STYLE 9).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus, metrics, stalls, tls, tracing
from gpusched.infra.db import UnitOfWorkFactory, create_engine
from gpusched.infra.errors import is_outage
from gpusched.infra.health import Check, Health, Stage, stalled
from gpusched.infra.leader import LeaderLease
from gpusched.infra.migrations import migrate
from gpusched.infra.outages import Outage, describe
from gpusched.infra.outbox import OutboxRelay
from gpusched.infra.settings import Settings
from gpusched.infra.tasks import cancel_and_wait

log = logging.getLogger(__name__)

Tick = Callable[[], Awaitable[None]]
# A task that runs for the life of the service and returns once the event is set.
Background = Callable[[asyncio.Event], Coroutine[Any, Any, None]]

# Readiness: a consumer's fetch loop turns at least every second when idle (its fetch
# waits 1 s), so one that has not turned for this long is stuck on a message.
CONSUMER_STALL_S = 60.0
# A loop may legitimately take long for one tick (admission's first pass over a deep
# queue): stuck means several times its interval and at least this.
LOOP_STALL_S = 120.0
# How long a PostgreSQL answer counts for readiness, so probes do not each cost a query.
DATABASE_CHECK_TTL_S = 2.0


@dataclass
class _Loop:
    name: str
    interval_s: float
    tick: Tick
    singleton: bool
    last_turn: float = field(default_factory=time.monotonic)


@dataclass
class ServiceRuntime:
    """Owns the connections of one service process and the tasks that use them."""

    name: str
    schema: str
    settings: Settings
    migrations: Path | None
    subjects: Subjects = field(init=False)
    nc: NatsClient = field(init=False)
    js: JetStreamContext = field(init=False)
    engine: AsyncEngine = field(init=False)
    uow: UnitOfWorkFactory = field(init=False)  # only for services with a schema
    _consumers: list[bus.ConsumerRunner] = field(default_factory=list, init=False)
    _endpoints: list[tuple[str, bus.RequestHandler]] = field(default_factory=list, init=False)
    _loops: list[_Loop] = field(default_factory=list, init=False)
    _on_close: list[Tick] = field(default_factory=list, init=False)
    _background: list[tuple[str, Background]] = field(default_factory=list, init=False)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)
    _relay: OutboxRelay | None = field(default=None, init=False)
    _stop: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _database_tls: ssl.SSLContext | None = field(default=None, init=False)
    health: Health = field(init=False)
    _server: metrics.HealthServer = field(init=False)
    _database_ok_at: float = field(default=-DATABASE_CHECK_TTL_S, init=False)

    def __post_init__(self) -> None:
        self.health = Health(self.name)
        self._server = metrics.HealthServer(self.health)

    async def start(self) -> None:
        """Connect, create streams and run migrations. Handlers register after this.

        The health endpoint answers from the first moment (liveness while a long
        migration runs; readiness says which stage the service is in)."""
        nats_url, db_url = self.settings.require_urls()
        self.subjects = Subjects(self.settings.subject_prefix)
        await self._server.start(self.settings.metrics_host, self.settings.metrics_port)
        self.health.stage = Stage.CONNECTING
        tracing.setup(self.name, self.settings.trace_file)
        nats_tls = tls.nats_context(self.settings)
        self._database_tls = tls.database_context(self.settings)
        self.nc = await bus.connect(
            nats_url, f"gpusched-{self.name}", self.credentials, tls=nats_tls
        )
        self.js = self.nc.jetstream(publish_async_max_pending=self.settings.outbox.max_pending_acks)
        await bus.ensure_streams(
            self.js, self.subjects.streams(), replicas=self.settings.bus.stream_replicas
        )
        # A keyed consumer holds up to `consumer_concurrency` connections at once.
        pool_size = max(self.settings.db_pool_size, self.settings.bus.consumer_concurrency)
        self.engine = create_engine(db_url, pool_size=pool_size, tls=self._database_tls)
        tracing.instrument_engine(self.engine)
        if self.migrations is not None:
            self.health.stage = Stage.MIGRATING
            await migrate(self.engine, self.schema, self.migrations)
            self.uow = UnitOfWorkFactory(self.engine, self.schema, self.name, self.subjects)
        self._dead_letters = bus.DeadLetters(self.js, self.subjects, self.name)
        if self.migrations is not None:
            self._relay = OutboxRelay(
                self.js,
                db_url,
                self.schema,
                service=self.name,
                batch=self.settings.outbox.batch,
                poll_interval_s=self.settings.outbox.poll_interval_s,
                nats_connected=lambda: self.nc.is_connected,
                tls=self._database_tls,
                subjects=self.subjects,
            )
        self._register_health_checks()
        self.health.stage = Stage.BUILDING

    def _register_health_checks(self) -> None:
        async def nats_connected() -> str | None:
            return None if self.nc.is_connected else "NATS is not connected (reconnecting)"

        async def consumers() -> str | None:
            now = time.monotonic()
            for runner in self._consumers:
                name = f"consumer {runner.durable}"
                if runner.waiting_out_outage:
                    return f"{name} waits out an outage of PostgreSQL or NATS"
                if not runner.subscribed:
                    return f"{name} is not subscribed yet"
                problem = stalled(name, runner.last_turn, CONSUMER_STALL_S, now)
                if problem is not None:
                    return problem
            return None

        async def loops() -> str | None:
            now = time.monotonic()
            for spec in self._loops:
                limit = max(LOOP_STALL_S, 4 * spec.interval_s)
                problem = stalled(f"loop {spec.name}", spec.last_turn, limit, now)
                if problem is not None:
                    return problem
            return None

        self.health.add("nats", nats_connected)
        if self.migrations is not None:
            self.health.add("postgres", self._database_answers)
        self.health.add("consumers", consumers)
        self.health.add("loops", loops)

    async def _database_answers(self) -> str | None:
        if time.monotonic() - self._database_ok_at < DATABASE_CHECK_TTL_S:
            return None
        try:
            async with self.engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
        except Exception as exc:
            return f"PostgreSQL does not answer: {describe(exc)}"
        self._database_ok_at = time.monotonic()
        return None

    def readiness(self, name: str, check: Check) -> None:
        """Add a check of this service's own to its readiness (health.Check: None when
        fine, else one line saying what is wrong)."""
        self.health.add(name, check)

    @property
    def credentials(self) -> Path | None:
        """This service's NATS identity: GPUSCHED_NATS_CREDENTIALS, else its own file in
        the installation's bundle (`<auth_dir>/creds/<service>.creds`)."""
        if self.settings.nats_credentials is not None:
            return self.settings.nats_credentials
        auth_dir = self.settings.security.auth_dir
        return None if auth_dir is None else auth_dir / "creds" / f"{self.name}.creds"

    @property
    def dead_letters(self) -> bus.DeadLetters:
        """Where this service's unusable messages go (with an audit record each)."""
        return self._dead_letters

    def consume(self, consumer: bus.Consumer) -> None:
        b = self.settings.bus
        self._consumers.append(
            bus.ConsumerRunner(
                self.js,
                consumer,
                self.uow if self.migrations is not None else None,
                self._dead_letters,
                service=self.name,
                max_deliver=b.max_deliver,
                ack_wait_s=b.ack_wait_s,
                fetch_batch=b.fetch_batch,
                nak_delay_s=b.nak_delay_s,
                max_clock_skew_s=b.max_clock_skew_s,
                concurrency=b.consumer_concurrency,
            )
        )

    def serve(self, subject: str, handler: bus.RequestHandler) -> None:
        self._endpoints.append((subject, handler))

    def every(self, name: str, interval_s: float, tick: Tick, *, singleton: bool = False) -> None:
        """Run `tick` periodically; a singleton loop runs only on the elected leader."""
        self._loops.append(_Loop(name, interval_s, tick, singleton))

    def background(self, name: str, run: Background) -> None:
        """Run `run(stopping)` while the service runs (e.g. ingest's telemetry fold, which
        reads the stream without acks); it must return soon after `stopping` is set."""
        self._background.append((name, run))

    def on_close(self, callback: Tick) -> None:
        """Run `callback` when the service stops, after it stops taking messages and
        before the connections close (e.g. the agent stopping its workloads)."""
        self._on_close.append(callback)

    def request_stop(self) -> None:
        self._stop.set()

    async def run(self, *, handle_signals: bool = False) -> None:
        """Run every registered part until `request_stop()`.

        With `handle_signals` (a service process: `run_service`), SIGTERM and SIGINT
        stop it gracefully too. A runtime started inside another program (a test)
        leaves the process's signals alone, so Ctrl-C and a test timeout still work."""
        loop = asyncio.get_running_loop()
        handled: list[signal.Signals] = []
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                with contextlib.suppress(NotImplementedError, RuntimeError):
                    loop.add_signal_handler(sig, self._stop.set)
                    handled.append(sig)
        try:
            await self._run_until_stopped()
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)

    async def _run_until_stopped(self) -> None:
        # A runtime started without start() (a test's) still serves, if configured.
        await self._server.start(self.settings.metrics_host, self.settings.metrics_port)
        metrics.UP.labels(self.name).set(1)
        self._tasks.append(
            asyncio.create_task(stalls.watch_event_loop(self.name, self._stop), name="loop-lag")
        )
        if self._relay is not None:
            self._tasks.append(asyncio.create_task(self._relay.run(), name="outbox-relay"))
        for runner in self._consumers:
            self._tasks.append(asyncio.create_task(runner.run()))
        for subject, handler in self._endpoints:
            await bus.serve_requests(
                self.nc,
                subject,
                handler,
                service=self.name,
                queue=self.name,
                clients_account=self.settings.security.clients_account,
            )
        for spec in self._loops:
            self._tasks.append(asyncio.create_task(self._run_loop(spec), name=spec.name))
        for name, run in self._background:
            self._tasks.append(asyncio.create_task(run(self._stop), name=name))
        self.health.stage = Stage.RUNNING
        log.info("%s running", self.name)
        stop_wait = asyncio.create_task(self._stop.wait())
        done, _ = await asyncio.wait([stop_wait, *self._tasks], return_when=asyncio.FIRST_COMPLETED)
        crashed = [t for t in done if t is not stop_wait and t.exception() is not None]
        await self.close()
        if crashed:
            raise RuntimeError(f"{self.name}: a task failed") from crashed[0].exception()

    async def _run_loop(self, spec: _Loop) -> None:
        lease = LeaderLease(
            self.settings.require_urls()[1], f"{self.name}.{spec.name}", tls=self._database_tls
        )
        outage = Outage(log, self.name, f"loop {spec.name}")
        try:
            while not self._stop.is_set():
                spec.last_turn = time.monotonic()
                if not spec.singleton or await lease.try_acquire():
                    try:
                        await spec.tick()
                        outage.end()
                    except asyncio.CancelledError:
                        raise
                    except Exception as exc:
                        # A failing tick is retried next interval; state is in the DB.
                        # An outage is one warning while it lasts, not a traceback a tick.
                        if is_outage(exc):
                            outage.begin(exc)
                        else:
                            log.exception("%s tick failed", spec.name)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), spec.interval_s)
        finally:
            await lease.release()

    async def close(self) -> None:
        self._stop.set()
        self.health.stage = Stage.STOPPING
        for runner in self._consumers:
            runner.stop()
        for callback in self._on_close:
            try:
                await callback()
            except Exception:
                log.exception("%s: a shutdown step failed", self.name)
        if self._relay is not None:
            self._relay.stop()
        # Consumers finish the messages they fetched; the relay drains what is committed.
        _, pending = await asyncio.wait(self._tasks, timeout=5) if self._tasks else (set(), set())
        await asyncio.gather(*(cancel_and_wait(task, 10.0, settle_s=2.0) for task in pending))
        # Bounded: a server that is away must not keep the service from stopping.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.nc.drain(), 10)
        if not self.nc.is_closed:
            # Bounded too: close() flushes to the socket first, which a server that
            # stopped reading never empties.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.nc.close(), 10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.engine.dispose(), 10)
        metrics.UP.labels(self.name).set(0)
        await self._server.stop()
        log.info("%s stopped", self.name)


def run_service(
    runtime: ServiceRuntime, build: Callable[[ServiceRuntime], Awaitable[object]]
) -> None:
    """Entry point of a service process."""
    logging.basicConfig(
        level=runtime.settings.log_level,
        format=f"%(asctime)s {runtime.name} %(levelname)s %(name)s: %(message)s",
    )

    async def main() -> None:
        await runtime.start()
        await build(runtime)
        # Everything built so far (modules, the ORM's caches, schemas, the handlers)
        # lives as long as the process: keep it out of the collector's generations, so a
        # full collection scans only what messages create, not the whole heap (such a
        # scan stalled every message in flight for about 70 ms, every 20 s or so under
        # load).
        gc.collect()
        gc.freeze()
        # Only in a service process: an exception a signal raises inside a collector
        # callback is lost, and there its signals reach the event loop, not Python code
        # (a runtime inside a test leaves pytest's Ctrl-C and timeouts alone).
        stalls.time_gc_pauses()
        await runtime.run(handle_signals=True)

    asyncio.run(main())
