"""The threads checkpoint verification reads storage on: a pool of its own, bounded.

Storage I/O has no time limit a thread can be held to: a read on a hung NFS or Lustre
mount blocks in the kernel until the mount answers, an S3 call until the client's own
retries give up. The waiting side (the event loop) therefore waits for a thread at most
a verification's budget and then abandons it. An abandoned thread that is still
running is *stuck*: it keeps its place in the pool until its I/O returns, so stuck
reads can take at most this pool's threads, never the event loop's default executor
(which also resolves host names for reconnects and serves nothing else of ours).

When every thread of the pool is stuck, `submit` refuses new work at once (None): a
verification is then reported unfinished, not queued behind reads that may never end.

The threads are daemon threads, unlike a ThreadPoolExecutor's (which the interpreter
joins at exit): a thread stuck on a dead mount must not keep the process from exiting.
Idle threads end after `idle_s`, so a pool costs no thread while nothing is verified.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Final, TypeVar

from gpusched.checkpoint import metrics

log = logging.getLogger(__name__)

T = TypeVar("T")
IDLE_S: Final = 10.0

_Job = tuple[Future[Any], Callable[[], Any]]


class VerificationThreads:
    """At most `size` daemon threads; work waits in a queue for a free one."""

    def __init__(self, size: int, *, idle_s: float = IDLE_S) -> None:
        if size < 1:
            raise ValueError("a verification pool needs at least one thread")
        self.size = size
        self._idle_s = idle_s
        self._ready = threading.Condition()
        self._jobs: deque[_Job] = deque()
        self._threads = 0
        self._waiting = 0  # threads waiting for a job
        self._stuck = 0  # abandoned and still running
        self._closed = False

    def submit(self, work: Callable[[], T]) -> Future[T] | None:
        """Run `work` on a thread of the pool; None (refused at once) when every thread
        is stuck, or the pool is closed."""
        future: Future[T] = Future()
        with self._ready:
            if self._closed or self._stuck >= self.size:
                return None
            self._jobs.append((future, work))
            if self._waiting >= len(self._jobs):
                self._ready.notify()
            elif self._threads < self.size:
                self._threads += 1
                threading.Thread(
                    target=self._serve, name=f"checkpoint-verify-{self._threads}", daemon=True
                ).start()
            # Otherwise every thread is busy: the first to finish takes it.
        return future

    def abandon(self, future: Future[Any]) -> None:
        """The waiting side gives up on `future`: dropped if it has not started, else its
        thread counts as stuck until the work returns (whatever it returns is ignored)."""
        if future.cancel() or future.done():
            return
        with self._ready:
            self._stuck += 1
            stuck = self._stuck
        metrics.VERIFY_THREADS_STUCK.inc()
        log.warning(
            "checkpoint verification gave up waiting for storage: its thread is abandoned "
            "in I/O (%d of %d verification threads stuck)",
            stuck,
            self.size,
        )
        # Runs at once if the work ended meanwhile, else on the thread when it ends.
        future.add_done_callback(self._returned)

    def _returned(self, _: Future[Any]) -> None:
        with self._ready:
            self._stuck -= 1
            stuck = self._stuck
        metrics.VERIFY_THREADS_STUCK.dec()
        log.info("an abandoned checkpoint verification thread returned (%d stuck)", stuck)

    def close(self) -> None:
        """Refuse new work and let idle threads end; a stuck thread ends when its I/O
        returns (it is a daemon: it never holds up the process's exit)."""
        with self._ready:
            self._closed = True
            for future, _ in self._jobs:
                future.cancel()
            self._jobs.clear()
            self._ready.notify_all()

    def _serve(self) -> None:
        with self._ready:
            while True:
                while not self._jobs:
                    if self._closed:
                        self._threads -= 1
                        return
                    self._waiting += 1
                    notified = self._ready.wait(self._idle_s)
                    self._waiting -= 1
                    if not notified and not self._jobs:
                        self._threads -= 1
                        return
                future, work = self._jobs.popleft()
                self._ready.release()
                try:
                    _run(future, work)
                finally:
                    del future, work  # no reference to a result kept while idle
                    self._ready.acquire()


def _run(future: Future[Any], work: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = work()
    except BaseException as exc:
        future.set_exception(exc)
    else:
        future.set_result(result)
