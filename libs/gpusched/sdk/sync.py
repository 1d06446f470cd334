"""The job client for a plain synchronous training loop (e.g. a PyTorch script).

    with JobClient.from_env() as job:
        job.started(resumed_from=job.resume_checkpoint_id)
        for step in range(start, steps):
            train_step()
            if (request := job.checkpoint_requested) is not None:
                job.checkpoint(request, lambda: save_file_checkpoint(path, write, step=step))
        job.completed(step)

Events are buffered while the control plane is unreachable and sent once it is back
(see AsyncJobClient): an event method returns within a couple of seconds whatever the
network does. A background thread owns an event loop and the AsyncJobClient; every method hands
its work to that loop and waits for it, so the methods may be called from any thread.
The loop checks for requests between steps: a checkpoint is taken at a step boundary,
never in the middle of an optimizer update. `save` and `persist` run in the caller's
thread, where the training state lives.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

from gpusched.contracts.messages import StageName
from gpusched.sdk.checkpoints import SavedCheckpoint
from gpusched.sdk.client import DEFAULT_FLUSH_TIMEOUT_S, AsyncJobClient
from gpusched.sdk.control import CheckpointRequest, ControlMessage, Freshness, RecentCheckpoint
from gpusched.sdk.delivery import DEFAULT_CAPACITY, DEFAULT_WAIT_S, DeliveryState
from gpusched.sdk.environment import DEFAULT_PREFIX, JobEnvironment
from gpusched.sdk.errors import CheckpointError, JobClientError

R = TypeVar("R")


class JobClient:
    def __init__(
        self,
        nats_url: str,
        job_id: str,
        attempt: int,
        *,
        prefix: str = DEFAULT_PREFIX,
        source: str = "job",
        timeout_s: float = 30.0,
        environment: JobEnvironment | None = None,
        buffer_capacity: int = DEFAULT_CAPACITY,
        publish_wait_s: float = DEFAULT_WAIT_S,
        flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.job_id = job_id
        self._tls = tls
        self.attempt = attempt
        self.environment = environment
        self._args = (nats_url, job_id, attempt)
        self._prefix = prefix
        self._source = source
        self._timeout = timeout_s
        self._buffer_capacity = buffer_capacity
        self._publish_wait_s = publish_wait_s
        self._flush_timeout_s = flush_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: AsyncJobClient | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **kwargs: Any) -> JobClient:
        """A client for the job the agent launched this process for (GPUSCHED_* variables)."""
        env = JobEnvironment.from_environ(environ)
        if "tls" not in kwargs:
            kwargs["tls"] = env.nats_tls_context()
        return cls(
            env.nats_url, env.job_id, env.attempt, prefix=env.prefix, environment=env, **kwargs
        )

    @property
    def resume_uri(self) -> str | None:
        return self.environment.resume_uri if self.environment else None

    @property
    def resume_checkpoint_id(self) -> str | None:
        return self.environment.resume_checkpoint_id if self.environment else None

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.environment.checkpoint_dir if self.environment else None

    # --- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> JobClient:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> None:
        with self._lock:
            if self._thread is not None:
                return
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            self._loop = loop
            self._thread = threading.Thread(
                target=run, name=f"gpusched-job-{self.job_id}", daemon=True
            )
            self._thread.start()
            ready.wait()
        try:
            self._client = self._call(self._open())
        except BaseException:
            self._stop_loop()
            raise

    async def _open(self) -> AsyncJobClient:
        client = AsyncJobClient(
            *self._args,
            prefix=self._prefix,
            source=self._source,
            buffer_capacity=self._buffer_capacity,
            publish_wait_s=self._publish_wait_s,
            flush_timeout_s=self._flush_timeout_s,
            credentials=self.environment.credentials if self.environment else None,
            tls=self._tls,
        )
        await client.connect()
        return client

    @property
    def connection_state(self) -> DeliveryState:
        """Connected or not, and how many events wait for the control plane (see
        AsyncJobClient.connection_state); e.g. `str(job.connection_state)`."""
        client = self._client
        if client is None:
            return DeliveryState(connected=False, buffered=0, dropped=0)
        return client.connection_state

    def flush(self, timeout: float) -> int:
        """Wait at most `timeout` seconds for buffered events to be delivered; how many
        are still waiting."""
        return self._call(self._async().flush(timeout), wait_s=timeout + 1.0)

    def close(self) -> None:
        """Deliver what is buffered (bounded, see AsyncJobClient.close), then stop."""
        client, self._client = self._client, None
        if client is not None and self._loop is not None:
            try:
                # Delivering the buffer, then unsubscribing and draining (bounded each).
                self._call(client.close(), wait_s=self._flush_timeout_s + 15.0)
            finally:
                self._stop_loop()

    def _stop_loop(self) -> None:
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(self._timeout)
        if not thread.is_alive():
            loop.close()

    def _call(self, coro: Coroutine[Any, Any, R], *, wait_s: float | None = None) -> R:
        loop = self._loop
        if loop is None:
            coro.close()
            raise JobClientError("the job client is not started (use `with JobClient(...)`)")
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        limit = max(self._timeout, wait_s or 0.0)
        try:
            return future.result(limit)
        except FutureTimeout:
            future.cancel()
            raise JobClientError(f"no answer from the job client in {limit}s") from None

    def _async(self) -> AsyncJobClient:
        if self._client is None:
            raise JobClientError("the job client is not started (use `with JobClient(...)`)")
        return self._client

    # --- job events -------------------------------------------------------------------
    def started(self, resumed_from: str | None = None) -> None:
        self._call(self._async().started(resumed_from))

    def progress(self, step: int, **metrics: Any) -> None:
        self._call(self._async().progress(step, **metrics))

    def checkpoint_confirmed(
        self, request: CheckpointRequest | None, saved: SavedCheckpoint, stage: StageName
    ) -> None:
        self._call(self._async().confirm(request, saved, stage))

    def checkpoint_failed(self, request_id: str | None, error: str) -> None:
        self._call(self._async().checkpoint_failed(request_id, error))

    def completed(self, step: int | None = None) -> None:
        self._call(self._async().completed(step))

    def failed(self, error: str) -> None:
        self._call(self._async().failed(error))

    # --- control messages ---------------------------------------------------------------
    @property
    def checkpoint_requested(self) -> CheckpointRequest | None:
        """The checkpoint request to answer after this step, if any."""
        return self._async().checkpoint_requested

    def on_checkpoint_requested(self, callback: Callable[[CheckpointRequest], None]) -> None:
        """Call `callback(request)` as soon as a checkpoint request arrives, e.g. to tell
        a framework to save at its next step boundary. It runs in the client's own thread:
        keep it short and thread-safe (set a flag); save in the training thread."""
        self._async().on_checkpoint_requested(callback)

    @property
    def recent_checkpoint(self) -> RecentCheckpoint | None:
        """The newest checkpoint this client confirmed (see answer_with_recent)."""
        return self._async().recent_checkpoint

    def answer_with_recent(
        self, request: CheckpointRequest, freshness: Freshness, *, step: int | None = None
    ) -> SavedCheckpoint | None:
        """Confirm the newest checkpoint already confirmed for `request` if `freshness`
        accepts it; None if not (then save a new one)."""
        return self._call(self._async().answer_with_recent(request, freshness, step=step))

    def poll_control(self) -> ControlMessage | None:
        """The oldest control message not yet taken, without waiting."""
        client = self._async()

        async def poll() -> ControlMessage | None:
            return client.poll_control()

        return self._call(poll())

    def wait_control(self, timeout: float) -> ControlMessage | None:
        """The next control message, or None after `timeout` seconds."""
        return self._call(self._async().next_control(timeout))

    def take(self, request: CheckpointRequest | None) -> None:
        """Mark `request` as being answered: checkpoint_requested no longer shows it."""
        self._async().take_checkpoint_request(request)

    def checkpoint(
        self,
        request: CheckpointRequest | None,
        save: Callable[[], SavedCheckpoint],
        *,
        persist: Callable[[SavedCheckpoint], SavedCheckpoint] | None = None,
    ) -> SavedCheckpoint:
        """Save in this thread, then confirm snapshotted and persisted (see
        AsyncJobClient.handle_checkpoint). Raises CheckpointError after publishing
        checkpoint.failed when `save` or `persist` raises."""
        client = self._async()
        client.take_checkpoint_request(request)
        saved = self._attempt(request, "save", save)
        self._call(client.confirm(request, saved, StageName.SNAPSHOTTED))
        if persist is not None:
            snapshot = saved
            saved = self._attempt(request, "persist", lambda: persist(snapshot))
        self._call(client.confirm(request, saved, StageName.PERSISTED))
        return saved

    def _attempt(
        self, request: CheckpointRequest | None, what: str, fn: Callable[[], SavedCheckpoint]
    ) -> SavedCheckpoint:
        try:
            saved = fn()
            if not isinstance(saved, SavedCheckpoint):
                raise TypeError(f"{what} returned {type(saved).__name__}, not SavedCheckpoint")
        except Exception as exc:
            self._call(
                self._async().checkpoint_failed(
                    request.request_id if request else None,
                    f"{what} failed: {type(exc).__name__}: {exc}",
                    causation_id=request.message_id if request else None,
                )
            )
            raise CheckpointError(f"checkpoint {what} failed: {exc}") from exc
        return saved
