"""The asyncio job client: publish job events, receive control messages.

    async with AsyncJobClient(nats_url, job_id, attempt) as job:
        await job.started(resumed_from=None)
        for step in range(steps):
            await train_step()
            if (request := job.checkpoint_requested) is not None:
                await job.handle_checkpoint(request, lambda: save_file_checkpoint(...))
        await job.completed(step)

Events go to `<p>.jobs.<job_id>.events` through JetStream with Nats-Msg-Id = envelope
id, so a retried publish is stored once. They pass through a bounded in-memory buffer
(sdk.delivery): while the control plane is unreachable they wait there and go out, in
order, once it is back; an event method never blocks longer than `publish_wait_s` and
never fails because NATS is away. `connection_state` says whether events are waiting.

Control messages come from an ordered consumer on `<p>.jobs.<job_id>.control` that
starts after the newest message at connect time: requests addressed to an earlier
attempt of the job are not replayed to this one. When NATS restarts, the consumer
(kept in the server's memory) is recreated from the last message seen, and the
client reconnects for as long as the job runs.

Job credentials are short-lived: the cluster agent rewrites the credentials file with
each renewal, and nats-server drops a connection whose credentials expired (nats-py
then closes the client for good). So the client follows the file: a renewal makes it
reconnect with the new credentials, well before the old ones expire; a connection the
server closed anyway (the renewals stopped longer than a lifetime, e.g. while
admission was away) is opened again once a renewal arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import secrets
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, TypeAlias, TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import Error as JetStreamError
from pydantic import BaseModel, ValidationError

from gpusched.contracts import messages as wire
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import CheckpointKind, StageName, T
from gpusched.contracts.subjects import Subjects
from gpusched.contracts.validation import printable
from gpusched.infra.errors import is_outage
from gpusched.infra.natsauth import CLIENT_MAX_PAYLOAD, AuthError, connect_options
from gpusched.infra.tasks import cancel_and_wait
from gpusched.infra.tls import server_name
from gpusched.infra.watchdog import FLUSH_TIMEOUT_S, ConnectionWatchdog
from gpusched.sdk.checkpoints import SavedCheckpoint
from gpusched.sdk.control import (
    CheckpointRequest,
    ControlMessage,
    Freshness,
    PendingCheckpoint,
    RecentCheckpoint,
    control_message,
)
from gpusched.sdk.delivery import (
    DEFAULT_CAPACITY,
    DEFAULT_WAIT_S,
    DeliveryState,
    EventBuffer,
    Outgoing,
)
from gpusched.sdk.environment import (
    DEFAULT_PREFIX,
    EnvVar,
    JobEnvironment,
    without_credentials,
)
from gpusched.sdk.errors import CheckpointError, JobClientError

log = logging.getLogger(__name__)

V = TypeVar("V")
MaybeAwaitable: TypeAlias = V | Awaitable[V]
SaveFn = Callable[[], MaybeAwaitable[SavedCheckpoint]]
PersistFn = Callable[[SavedCheckpoint], MaybeAwaitable[SavedCheckpoint]]
ControlCallback = Callable[[ControlMessage], MaybeAwaitable[None]]
CheckpointCallback = Callable[[CheckpointRequest], MaybeAwaitable[None]]

# Bounded waits on the network: each connect attempt, the first connect as a whole
# (retried within it), and each control-plane request.
_CONNECT_TIMEOUT_S = 5  # nats-py takes whole seconds here
FIRST_CONNECT_S = 5.0
_REQUEST_TIMEOUT_S = 5.0
# Error texts travel made printable (no control characters) and bounded.
_ERROR_MAX = 2000
# How often the server signals an idle control consumer is alive; two missed beats and
# the client recreates the consumer (it is lost when NATS restarts).
_CONTROL_HEARTBEAT_S = 1.0
# A job's control consumer is removed by the server this long after nobody listens.
_CONTROL_INACTIVE_S = 120.0
# How often the credentials file is looked at for a renewal (a third of the shortest
# credential lifetime, 2 s, leaves time to reconnect).
_CREDENTIALS_POLL_S = 0.5
DEFAULT_FLUSH_TIMEOUT_S = 10.0
A = TypeVar("A")


class _Closed:
    """Marks the end of the control stream in the inbox."""


_CLOSED = _Closed()


class AsyncJobClient:
    """One job attempt's link to the control plane (an async context manager).

    `connection` shares an existing NATS connection (the simulated cluster runs many
    jobs over one); the client then leaves it open when it closes. `tls` is the context
    of a NATS that requires TLS (`from_env` builds it from GPUSCHED_NATS_TLS__*).
    """

    def __init__(
        self,
        nats_url: str,
        job_id: str,
        attempt: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        source: str = "job",
        connection: NatsClient | None = None,
        buffer_capacity: int = DEFAULT_CAPACITY,
        publish_wait_s: float = DEFAULT_WAIT_S,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
        credentials: Path | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.subjects = Subjects(prefix)
        self._tls = tls
        self.job_id = job_id
        self.attempt = attempt
        self._events_subject = self.subjects.job_events(job_id)  # validates the job id
        self._control_subject = self.subjects.job_control(job_id)
        self._nats_url = nats_url
        self._source = source
        self._nc = connection
        self._owns_connection = connection is None
        self._js: JetStreamContext | None = None
        self._sub: Subscription | None = None
        self._events: EventBuffer | None = None
        self._buffer_capacity = buffer_capacity
        self._publish_wait_s = publish_wait_s
        self._flush_timeout_s = flush_timeout_s
        self._credentials = credentials
        # Control messages are read from the stream from when this attempt first
        # listened; after a reconnect, from the one after the last seen.
        self._listening_since: datetime | None = None
        self._last_seq = 0
        self._closing = False
        self._inbox: asyncio.Queue[ControlMessage | _Closed] = asyncio.Queue()
        self._pending = PendingCheckpoint()
        self._on_control: list[ControlCallback] = []
        self._on_checkpoint: list[CheckpointCallback] = []
        self._callback_tasks: set[asyncio.Task[None]] = set()
        self._recent: RecentCheckpoint | None = None
        self._renewals: asyncio.Task[None] | None = None
        self._reconnecting_for_renewal = False
        # What NATS last said went wrong (a refused connect, a failed reconnect).
        self._last_error: Exception | None = None

    @classmethod
    def from_env(cls, environment: JobEnvironment | None = None) -> AsyncJobClient:
        env = environment or JobEnvironment.from_environ()
        return cls(
            env.nats_url,
            env.job_id,
            env.attempt,
            prefix=env.prefix,
            credentials=env.credentials,
            tls=env.nats_tls_context(),
        )

    # --- lifecycle ----------------------------------------------------------------------
    async def __aenter__(self) -> AsyncJobClient:
        await self.connect()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _open(self) -> NatsClient:
        """A connection that retries until it is made, and reconnects for ever after."""
        nc = NatsClient()
        await self._connect(nc)
        return nc

    async def _open_first(self) -> NatsClient:
        """The first connection, given FIRST_CONNECT_S: with unlimited reconnects nats-py
        would retry a first connect for ever, and a job pointed at a NATS it cannot reach
        (a wrong URL, no server, refused credentials) must be told, not hang."""
        nc = NatsClient()
        try:
            await asyncio.wait_for(self._connect(nc), FIRST_CONNECT_S)
        except BaseException as exc:
            # Whatever the attempts left behind (a socket, nats-py's tasks) goes too.
            with contextlib.suppress(Exception):
                await nc.close()
            if not isinstance(exc, TimeoutError):
                raise
            raise JobClientError(
                f"cannot connect to NATS at {without_credentials(self._nats_url)} within "
                f"{FIRST_CONNECT_S:g} s (last error: {self._last_error!r}); check the URL "
                f"({EnvVar.NATS_URL} for a job), that NATS is running and reachable from "
                "here, and the job's credentials and TLS settings"
            ) from self._last_error
        return nc

    async def _connect(self, nc: NatsClient) -> None:
        # A NATS that goes silent without closing the connection is left and reconnected
        # to, never waited on without end (gpusched.infra.watchdog).
        watchdog = ConnectionWatchdog(f"job {self.job_id}", log)

        async def on_closed() -> None:
            watchdog.stop()

        await nc.connect(
            self._nats_url,
            name=f"gpusched-job-{self.job_id}",
            # A job outlives any control-plane outage: reconnect for ever.
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # seconds; a float works
            connect_timeout=_CONNECT_TIMEOUT_S,
            flush_timeout=FLUSH_TIMEOUT_S,
            error_cb=self._on_nats_error,
            disconnected_cb=self._on_disconnected,
            reconnected_cb=self._on_reconnected,
            closed_cb=on_closed,
            **connect_options(self._credentials),  # type: ignore[arg-type]
            tls=self._tls,
            tls_hostname=server_name(self._tls),
        )
        watchdog.start(nc)

    async def connect(self) -> None:
        try:
            if self._nc is None:
                self._nc = await self._open_first()
            self._js = self._nc.jetstream(timeout=_REQUEST_TIMEOUT_S)
            self._events = EventBuffer(
                self._nc,
                self._js,
                name=f"job {self.job_id}",
                capacity=self._buffer_capacity,
                wait_s=self._publish_wait_s,
                max_payload=CLIENT_MAX_PAYLOAD,
            )
            self._listening_since = datetime.now(UTC)
            if self._owns_connection:
                await self._listen()
                if self._credentials is not None:
                    self._renewals = asyncio.create_task(
                        self._follow_credentials(self._credentials),
                        name=f"job-{self.job_id}-credentials",
                    )
            else:
                await self._follow_shared()
        except JobClientError:
            await self.close()
            raise
        except (NatsError, JetStreamError, OSError, TimeoutError, AuthError) as exc:
            await self.close()
            raise JobClientError(
                f"cannot listen on {self._control_subject}: {exc!r} "
                "(is the control plane running with this subject prefix?)"
            ) from exc

    @property
    def connection_state(self) -> DeliveryState:
        """Connected or not, how many events wait to be delivered, how many were dropped."""
        if self._events is None:
            return DeliveryState(connected=False, buffered=0, dropped=0)
        return self._events.state

    async def flush(self, timeout: float | None = None) -> int:  # noqa: ASYNC109
        """Wait (at most `timeout` s, default `flush_timeout_s`) until every buffered
        event is delivered; returns how many are still waiting."""
        if self._events is None:
            return 0
        return await self._events.flush(self._flush_timeout_s if timeout is None else timeout)

    async def close(self, timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Deliver what is buffered (at most `timeout` s, default `flush_timeout_s`),
        stop listening, and close the connection if the client opened it."""
        self._closing = True
        if self._renewals is not None:
            await cancel_and_wait(self._renewals)
            self._renewals = None
        events, self._events = self._events, None
        if events is not None:
            await events.close(self._flush_timeout_s if timeout is None else timeout)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._sub.unsubscribe(), _REQUEST_TIMEOUT_S)
            self._sub = None
        await asyncio.gather(*(cancel_and_wait(task) for task in list(self._callback_tasks)))
        if self._nc is not None and self._owns_connection:
            nc, self._nc = self._nc, None
            try:
                await asyncio.wait_for(nc.drain(), _REQUEST_TIMEOUT_S)
            except Exception:
                with contextlib.suppress(Exception):
                    await nc.close()
        self._js = None
        self._inbox.put_nowait(_CLOSED)

    async def _on_nats_error(self, exc: Exception) -> None:
        # The connection reports every failed reconnect; the buffer says it once per
        # outage. The last one explains a first connect that never succeeded.
        # A server's own answer (an authorization violation) says more than the reset of
        # the connection it then closes: a bare connection error does not replace it.
        if not (
            is_outage(exc) and self._last_error is not None and not is_outage(self._last_error)
        ):
            self._last_error = exc
        log.debug("NATS: %r", exc)

    async def _on_disconnected(self) -> None:
        if self._closing or self._reconnecting_for_renewal or self._nc is None:
            return  # (no connection yet: a first connect that failed says so itself)
        log.warning("job %s: lost the control plane; events are buffered", self.job_id)

    async def _follow_credentials(self, path: Path) -> None:
        """Reconnect with each renewal written to `path` (see the module docstring)."""
        seen = _read_quietly(path)
        while not self._closing:
            await asyncio.sleep(_CREDENTIALS_POLL_S)
            text = _read_quietly(path)
            if text is None or text == seen:
                continue
            seen = text
            try:
                await self._use_renewed_credentials()
            except (NatsError, JetStreamError, OSError, TimeoutError, AuthError) as exc:
                log.warning("job %s: cannot use renewed credentials yet: %r", self.job_id, exc)
                seen = None  # try again at the next look

    async def _use_renewed_credentials(self) -> None:
        nc = self._nc
        if nc is None or self._closing:
            return
        if not nc.is_closed:
            # nats-py reads the credentials file at every (re)connect. Not an outage: the
            # disconnect it makes is not reported as one (the reconnect clears the mark).
            self._reconnecting_for_renewal = True
            await nc.force_reconnect()
            return
        # The server closed it (its credentials expired before a renewal came): a new
        # connection, which the event buffer and the control consumer move to.
        log.warning("job %s: connecting again with renewed credentials", self.job_id)
        fresh = await self._open()
        self._nc = fresh
        self._js = fresh.jetstream(timeout=_REQUEST_TIMEOUT_S)
        if self._events is not None:
            self._events.rebind(fresh, self._js)
        self._sub = None
        await self._listen()

    async def _on_reconnected(self) -> None:
        if self._reconnecting_for_renewal:
            self._reconnecting_for_renewal = False
            log.debug("job %s: reconnected with renewed credentials", self.job_id)
        else:
            log.info("job %s: reconnected to the control plane", self.job_id)
        if self._sub is None or self._closing:
            return
        # The consumer may be gone with the server (it lives in memory); listen again
        # from the message after the last one seen, so nothing sent meanwhile is lost.
        old, self._sub = self._sub, None
        with contextlib.suppress(Exception):
            await asyncio.wait_for(old.unsubscribe(), _REQUEST_TIMEOUT_S)
        try:
            await self._listen()
        except (NatsError, JetStreamError, OSError, TimeoutError) as exc:
            log.warning("job %s: cannot listen again after a reconnect: %r", self.job_id, exc)

    async def _follow_shared(self) -> None:
        """On a shared connection (the simulated cluster's, a trusted service that may
        read the whole stream): an ordered consumer, which nats-py itself recreates
        after a gap or a reconnect."""
        assert self._js is not None
        stream = self.subjects.stream("JOBS")
        info = await self._js.stream_info(stream)
        # Only what is sent from now on; a message that lands between this read and
        # the subscription is delivered, not skipped.
        self._last_seq = info.state.last_seq
        self._sub = await self._js.subscribe(
            self._control_subject,
            stream=stream,
            cb=self._on_message,
            ordered_consumer=True,
            idle_heartbeat=_CONTROL_HEARTBEAT_S,
            config=ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self._last_seq + 1,
            ),
        )

    async def _listen(self) -> None:
        """An ephemeral push consumer of this job's control subject. It is named, so the
        server sees the filter in the create subject: a job's credentials allow only a
        consumer of its own control subject (infra.natsauth)."""
        assert self._js is not None and self._listening_since is not None
        if self._last_seq:
            start = {
                "deliver_policy": DeliverPolicy.BY_START_SEQUENCE,
                "opt_start_seq": self._last_seq + 1,
            }
        else:
            start = {
                "deliver_policy": DeliverPolicy.BY_START_TIME,
                "opt_start_time": self._listening_since.isoformat().replace("+00:00", "Z"),
            }
        config = ConsumerConfig(
            name=f"ctl-{secrets.token_hex(8)}",
            filter_subject=self._control_subject,
            ack_policy=AckPolicy.NONE,
            inactive_threshold=_CONTROL_INACTIVE_S,
            mem_storage=True,
            num_replicas=1,
            **start,  # type: ignore[arg-type]
        )
        self._sub = await self._js.subscribe(
            self._control_subject,
            stream=self.subjects.stream("JOBS"),
            cb=self._on_message,
            manual_ack=True,  # nothing to ack (AckPolicy.NONE); a job may not publish acks
            config=config,
        )

    # --- job events -------------------------------------------------------------------
    async def started(self, resumed_from: str | None = None) -> None:
        await self._publish(
            T.JOB_STARTED,
            wire.JobStarted(job_id=self.job_id, attempt=self.attempt, resumed_from=resumed_from),
        )

    async def progress(self, step: int, **metrics: Any) -> None:
        """Report `step` and any metrics. A metric the contract refuses (NaN or an
        infinite loss, a value that is not JSON) is left out, never raised to the loop."""
        finite = {
            name: value
            for name, value in metrics.items()
            if not (isinstance(value, float) and not math.isfinite(value))
        }
        try:
            progress = wire.JobProgress.model_validate({**finite, "step": step})
        except ValidationError as exc:
            log.warning("job %s: progress metrics left out: %s", self.job_id, exc.errors()[0])
            progress = wire.JobProgress(step=step)
        # Progress is superseded by newer progress: the first thing a full buffer drops.
        await self._publish(T.JOB_PROGRESS, progress, droppable=True)

    async def checkpoint_confirmed(
        self,
        *,
        request_id: str | None,
        checkpoint_id: str,
        step: int,
        uri: str,
        bytes: int,  # the field's name on the wire
        sha256: str,
        stage: StageName,
        causation_id: str | None = None,
        kind: CheckpointKind = CheckpointKind.FILE,
    ) -> None:
        confirmed = wire.CheckpointConfirmed(
            request_id=request_id,
            checkpoint_id=checkpoint_id,
            step=step,
            uri=uri,
            bytes=bytes,
            sha256=sha256,
            stage=stage,
            kind=kind,
        )
        await self._publish(
            T.CHECKPOINT_CONFIRMED,
            confirmed,
            causation_id=causation_id,
            version=confirmed.version,
        )

    async def confirm(
        self, request: CheckpointRequest | None, saved: SavedCheckpoint, stage: StageName
    ) -> None:
        """Confirm `saved` at `stage` for `request` (None: a periodic checkpoint)."""
        await self.checkpoint_confirmed(
            request_id=request.request_id if request else None,
            checkpoint_id=saved.checkpoint_id,
            step=saved.step,
            uri=saved.uri,
            bytes=saved.bytes,
            sha256=saved.sha256,
            stage=stage,
            causation_id=request.message_id if request else None,
            kind=saved.kind,
        )
        recent = self._recent
        if recent is None or recent.saved != saved:
            self._recent = RecentCheckpoint(saved, stage, time.monotonic())
        elif stage is StageName.PERSISTED:
            # The same checkpoint, now durable: as old as when it was first confirmed.
            self._recent = RecentCheckpoint(saved, stage, recent.confirmed_at)

    @property
    def recent_checkpoint(self) -> RecentCheckpoint | None:
        """The newest checkpoint this client confirmed (periodic or requested)."""
        return self._recent

    async def answer_with_recent(
        self, request: CheckpointRequest, freshness: Freshness, *, step: int | None = None
    ) -> SavedCheckpoint | None:
        """Confirm the newest checkpoint already confirmed for `request`, if `freshness`
        accepts it (the job saves periodically anyway); None: save a new one instead.
        The control plane verifies it like any other claim."""
        recent = self._recent
        if not freshness.accepts(recent, request, now=time.monotonic(), step=step):
            return None
        assert recent is not None
        self._pending.take(request)
        await self.confirm(request, recent.saved, recent.stage)
        return recent.saved

    async def checkpoint_failed(
        self, request_id: str | None, error: str, *, causation_id: str | None = None
    ) -> None:
        await self._publish(
            T.CHECKPOINT_FAILED,
            wire.CheckpointFailed(request_id=request_id, error=printable(error, _ERROR_MAX)),
            causation_id=causation_id,
        )

    async def completed(self, step: int | None = None) -> None:
        await self._publish(T.JOB_COMPLETED, wire.JobCompleted(job_id=self.job_id, step=step))

    async def failed(self, error: str) -> None:
        await self._publish(
            T.JOB_FAILED, wire.JobFailed(job_id=self.job_id, error=printable(error, _ERROR_MAX))
        )

    # --- control messages ---------------------------------------------------------------
    @property
    def checkpoint_requested(self) -> CheckpointRequest | None:
        """The checkpoint request still to be answered, if any (cancelled ones vanish)."""
        return self._pending.peek()

    def on_checkpoint_requested(self, callback: CheckpointCallback) -> None:
        """Call `callback(request)` for each checkpoint request (sync or async)."""
        self._on_checkpoint.append(callback)

    def on_control(self, callback: ControlCallback) -> None:
        """Call `callback(message)` for every control message (sync or async)."""
        self._on_control.append(callback)

    def poll_control(self) -> ControlMessage | None:
        """The oldest control message not yet taken, without waiting."""
        try:
            item = self._inbox.get_nowait()
        except asyncio.QueueEmpty:
            return None
        return self._unwrap(item)

    async def next_control(
        self,
        timeout: float | None = None,  # noqa: ASYNC109 - a bounded poll reads best in a loop
    ) -> ControlMessage | None:
        """The next control message; None after `timeout` seconds or once closed."""
        if not self._inbox.empty():
            return self._unwrap(self._inbox.get_nowait())
        try:
            item = await asyncio.wait_for(self._inbox.get(), timeout)
        except TimeoutError:
            return None
        return self._unwrap(item)

    async def control_messages(self) -> AsyncIterator[ControlMessage]:
        """Every control message in arrival order, until the client closes."""
        while (message := await self.next_control()) is not None:
            yield message

    def _unwrap(self, item: ControlMessage | _Closed) -> ControlMessage | None:
        if isinstance(item, _Closed):
            self._inbox.put_nowait(item)  # every later reader sees the end too
            return None
        return item

    # --- checkpointing ------------------------------------------------------------------
    async def handle_checkpoint(
        self,
        request: CheckpointRequest | None,
        save: SaveFn,
        *,
        persist: PersistFn | None = None,
    ) -> SavedCheckpoint:
        """Save, then confirm the checkpoint twice: snapshotted, then persisted.

        `save()` captures the training state (sync or async) and returns what it wrote;
        `persist(saved)`, if given, makes it durable elsewhere (e.g. uploads it) and
        returns the durable copy. Without `persist`, what `save` wrote is taken to be
        durable already (save_file_checkpoint fsyncs). A failure publishes
        checkpoint.failed and raises CheckpointError. `request=None` is a periodic
        checkpoint.
        """
        self._pending.take(request)
        saved = await self._attempt(request, "save", save)
        await self.confirm(request, saved, StageName.SNAPSHOTTED)
        if persist is not None:
            snapshot = saved
            saved = await self._attempt(request, "persist", lambda: persist(snapshot))
        await self.confirm(request, saved, StageName.PERSISTED)
        return saved

    def take_checkpoint_request(self, request: CheckpointRequest | None) -> None:
        """Mark `request` as being answered (what handle_checkpoint does first)."""
        self._pending.take(request)

    async def _attempt(
        self,
        request: CheckpointRequest | None,
        what: str,
        fn: Callable[[], MaybeAwaitable[SavedCheckpoint]],
    ) -> SavedCheckpoint:
        try:
            result = fn()
            saved = await result if inspect.isawaitable(result) else result
            if not isinstance(saved, SavedCheckpoint):
                raise TypeError(f"{what} returned {type(saved).__name__}, not SavedCheckpoint")
        except Exception as exc:
            await self.checkpoint_failed(
                request.request_id if request else None,
                f"{what} failed: {type(exc).__name__}: {exc}",
                causation_id=request.message_id if request else None,
            )
            raise CheckpointError(f"checkpoint {what} failed: {exc}") from exc
        return saved

    # --- plumbing -----------------------------------------------------------------------
    async def _publish(
        self,
        message_type: str,
        payload: BaseModel,
        *,
        causation_id: str | None = None,
        droppable: bool = False,
        version: int = 1,
    ) -> None:
        if self._events is None:
            raise JobClientError("the job client is not connected (use `async with`)")
        envelope = make_envelope(
            message_type,
            payload,
            source=self._source,
            correlation_id=self.job_id,
            causation_id=causation_id,
        )
        if version != envelope.version:
            envelope = envelope.model_copy(update={"version": version})
        # The same envelope id on every retry lets JetStream drop a duplicate.
        await self._events.send(
            Outgoing(
                self._events_subject,
                envelope.to_bytes(),
                envelope.id,
                message_type,
                droppable=droppable,
            )
        )

    async def _on_message(self, msg: Msg) -> None:
        if (seq := _stream_sequence(msg)) is not None:
            if seq <= self._last_seq:
                return  # replayed by a consumer made again after a reconnect
            self._last_seq = seq
        try:
            message = control_message(Envelope.from_bytes(msg.data))
        except MalformedMessage as exc:
            log.warning("ignoring a malformed control message on %s: %s", msg.subject, exc)
            return
        if message is None:
            return  # a control type newer than this SDK
        if isinstance(message, CheckpointRequest) and message.job_id != self.job_id:
            log.warning("ignoring a checkpoint request for job %s", message.job_id)
            return
        self._pending.apply(message)
        self._inbox.put_nowait(message)
        for on_control in self._on_control:
            self._run_callback(on_control, message)
        if isinstance(message, CheckpointRequest):
            for on_checkpoint in self._on_checkpoint:
                self._run_callback(on_checkpoint, message)

    def _run_callback(self, callback: Callable[[A], MaybeAwaitable[None]], arg: A) -> None:
        try:
            result = callback(arg)
        except Exception:
            log.exception("control callback failed")
            return
        if inspect.isawaitable(result):
            # A callback may checkpoint for minutes; it must not hold up delivery.
            task = asyncio.ensure_future(_logged(result))
            self._callback_tasks.add(task)
            task.add_done_callback(self._callback_tasks.discard)


async def _logged(result: Awaitable[None]) -> None:
    try:
        await result
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("control callback failed")


def _stream_sequence(msg: Msg) -> int | None:
    try:
        return msg.metadata.sequence.stream
    except Exception:
        return None  # not a JetStream delivery: nothing to compare


def _read_quietly(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None
