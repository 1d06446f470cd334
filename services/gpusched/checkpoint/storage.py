"""The storage adapter: reads what a checkpoint URI actually holds, through fsspec.

The schemes it reads are the ones the deployment names (checkpoint.verify_schemes:
file by default; s3, gs, az with s3fs, gcsfs, adlfs installed), each with the
credentials of its usual environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS,
AZURE_STORAGE_*). Other schemes report None: unverifiable, so refused unless trusted for
the job's class (checkpoint.trusted_schemes).

Hashing is I/O of up to many gigabytes: it runs off the event loop, on threads of its
own (`threads.VerificationThreads`), the files of a manifest in parallel, within a time
budget per GB (`verification.budget_s`); what is not done in time is reported
unfinished, never waited for: the event loop waits for a thread until the deadline (and
a short grace) and then abandons it, whatever it is doing (a read that never returns
on a hung mount, an S3 call in its client's retries). When every thread is stuck so,
a new verification is reported unfinished at once. A store that keeps a
whole-object sha256 (S3 with ChecksumSHA256 of a single-part upload) is trusted for it
instead of reading the object: the store computed and checked it on upload.

Errors of the store become facts (`exists=False` with the error), never exceptions out
of the adapter; an unreachable store is an outage (Unavailable): the consumer waits it
out and verifies the same claim again.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, BinaryIO, Final, Protocol, TypeVar

from gpusched.checkpoint import metrics
from gpusched.checkpoint.threads import VerificationThreads
from gpusched.checkpoint.verification import (
    ClaimCheck,
    ManifestFacts,
    ObjectFacts,
    Verdict,
    budget_s,
    judge,
    judge_manifest,
    uri_scheme,
)
from gpusched.contracts.manifest import (
    MAX_MANIFEST_BYTES,
    MalformedManifest,
    Manifest,
    ManifestFile,
)
from gpusched.contracts.messages import CheckpointKind
from gpusched.contracts.uris import FILE_SCHEME, local_path
from gpusched.domain.saga import CheckpointRef
from gpusched.infra.errors import Unavailable, is_outage

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_CHUNK: Final = 1 << 20
# Library errors that say the store cannot be reached (botocore, aiohttp, google-auth,
# azure-core), checked by name so no store's library has to be installed.
_UNREACHABLE: Final = frozenset(
    {
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "ClientConnectorError",
        "ClientConnectionError",
        "ServerDisconnectedError",
        "ServiceRequestError",
        "TransportError",
    }
)
DEFAULT_BUDGET_S: Final = 30.0
DEFAULT_BUDGET_S_PER_GB: Final = 30.0
DEFAULT_PARALLELISM: Final = 8
# Claims verified at once that never wait for one another's threads (the job-events
# consumer's default concurrency, bus.consumer_concurrency).
DEFAULT_CONCURRENT_CLAIMS: Final = 8
# How long past its deadline a verification still waits for a thread's own answer (a
# thread checks the deadline between chunks, so one that is reading returns by then).
DEFAULT_GRACE_S: Final = 1.0


class CheckpointStorage(Protocol):
    async def verify(self, claim: CheckpointRef, kind: CheckpointKind) -> Verdict | None:
        """The verdict of storage on `claim`, or None if it cannot read its scheme."""


@dataclass(frozen=True)
class Budget:
    base_s: float = DEFAULT_BUDGET_S
    per_gb_s: float = DEFAULT_BUDGET_S_PER_GB

    def for_bytes(self, total: int) -> float:
        return budget_s(total, self.base_s, self.per_gb_s)


class FsspecStorage:
    """Verifies claims on the schemes named in `schemes`, through fsspec.

    Storage is read on a pool of `threads` threads of its own (VerificationThreads),
    never on the event loop's default executor, and each wait for one of them ends at
    the verification's deadline plus `grace_s`: what storage has not answered by then
    is reported unfinished and its thread abandoned. The default pool lets
    DEFAULT_CONCURRENT_CLAIMS claims read `parallelism` files each at once."""

    def __init__(
        self,
        schemes: Iterable[str] = (FILE_SCHEME,),
        *,
        budget: Budget | None = None,
        parallelism: int = DEFAULT_PARALLELISM,
        threads: int | None = None,
        grace_s: float = DEFAULT_GRACE_S,
        file_roots: Iterable[str | os.PathLike[str]] = (),
    ) -> None:
        self._schemes = frozenset(s.lower() for s in schemes)
        # Where file:// claims may lie (links resolved); empty: anywhere readable here.
        self._roots = tuple(os.path.realpath(root) for root in file_roots)
        for scheme in self._schemes:
            require_backend(scheme)
        self._budget = budget or Budget()
        self._parallelism = max(1, parallelism)
        self._threads = VerificationThreads(
            max(1, threads or self._parallelism * DEFAULT_CONCURRENT_CLAIMS)
        )
        self._grace_s = max(0.0, grace_s)

    def close(self) -> None:
        """Take no more work; threads still in storage I/O end when it returns."""
        self._threads.close()

    async def verify(self, claim: CheckpointRef, kind: CheckpointKind) -> Verdict | None:
        if uri_scheme(claim.uri) not in self._schemes:
            return None
        started = time.monotonic()
        if kind is CheckpointKind.MANIFEST:
            return await self._verify_manifest(claim, started)
        budget = self._budget.for_bytes(claim.bytes)
        deadline = started + budget
        found = await self._on_thread(
            lambda stop: _inspect_uri(claim.uri, claim.bytes, deadline, stop, self._roots),
            deadline,
        )
        if found is None or isinstance(found, _Unfinished):
            why = _Unfinished.NOT_IN_TIME if found is None else found
            return Verdict(ClaimCheck.INCOMPLETE, self._unfinished(claim.uri, why, budget))
        return judge(claim, found)

    async def _verify_manifest(self, claim: CheckpointRef, started: float) -> Verdict:
        # The whole verification, manifest and files, is held to the budget of the bytes
        # the manifest lists; the manifest itself (not yet read) to that of its own size.
        budget = self._budget.for_bytes(claim.bytes)
        read = await self._on_thread(
            lambda _: _read_manifest(claim.uri, claim.bytes, self._roots), started + budget
        )
        if isinstance(read, _Unfinished):
            return Verdict(
                ClaimCheck.INCOMPLETE, f"manifest {self._unfinished(claim.uri, read, budget)}"
            )
        facts, location = read
        listed = facts.listed
        if listed is None or location is None:
            return judge_manifest(claim, facts)
        fs, base = location
        budget = self._budget.for_bytes(listed.total_bytes)
        deadline = started + budget
        # At most `parallelism` files of one claim on the pool's threads at once.
        slots = asyncio.Semaphore(self._parallelism)

        async def check(entry: ManifestFile) -> ObjectFacts | _Unfinished:
            async with slots:
                if time.monotonic() > deadline:
                    return _Unfinished.NOT_IN_TIME
                path = f"{base}/{entry.path}"
                found = await self._on_thread(
                    lambda stop: _inspect(fs, path, entry.bytes, deadline, stop, self._roots),
                    deadline,
                )
                return _Unfinished.NOT_IN_TIME if found is None else found

        results = await _all([check(entry) for entry in listed.files])
        checked = [
            (entry, found)
            for entry, found in zip(listed.files, results, strict=True)
            if not isinstance(found, _Unfinished)
        ]
        verdict = judge_manifest(
            claim,
            ManifestFacts(
                manifest=facts.manifest,
                listed=listed,
                files=tuple(checked),
                unfinished=len(listed.files) - len(checked),
                budget_s=budget,
            ),
        )
        if verdict.check is ClaimCheck.INCOMPLETE and _Unfinished.NO_THREAD in results:
            why = self._unfinished(claim.uri, _Unfinished.NO_THREAD, budget)
            return Verdict(verdict.check, f"{verdict.why}; {why}")
        return verdict

    async def _on_thread(
        self, work: Callable[[threading.Event], _T], deadline: float
    ) -> _T | _Unfinished:
        """What `work` returns, run on the pool; unfinished if the pool refuses it or it
        has not returned by `deadline` plus the grace. `work` is given an event that is
        set when nobody waits for it any more (it may stop at its next chunk)."""
        stop = threading.Event()
        future = self._threads.submit(lambda: work(stop))
        if future is None:
            return _Unfinished.NO_THREAD
        waiting = asyncio.wrap_future(future)
        try:
            timeout = max(0.0, deadline - time.monotonic()) + self._grace_s
            done, _ = await asyncio.wait({waiting}, timeout=timeout)
            if waiting in done:
                # Cancelled without this coroutine being cancelled: the pool was closed.
                return _Unfinished.NO_THREAD if waiting.cancelled() else waiting.result()
            return _Unfinished.NOT_IN_TIME
        finally:
            # Never waited for past this point, whatever its thread is doing (also when
            # the verification itself is cancelled).
            if not waiting.done():
                stop.set()
                self._threads.abandon(future)
                waiting.cancel()

    def _unfinished(self, uri: str, why: _Unfinished, budget: float) -> str:
        if why is _Unfinished.NOT_IN_TIME:
            return f"{uri}: not verified within the budget of {budget:.0f}s"
        metrics.VERIFY_REFUSED.inc()
        log.warning(
            "checkpoint claim %s not verified: all %d verification threads are stuck in "
            "storage I/O that has not returned",
            uri,
            self._threads.size,
        )
        return (
            f"{uri}: not verified: all {self._threads.size} verification threads are stuck "
            "in storage I/O that has not returned (storage not answering)"
        )


class _Unfinished(Enum):
    """Why a read of storage has no answer."""

    NOT_IN_TIME = "not_in_time"  # its deadline (and the grace) passed first
    NO_THREAD = "no_thread"  # every verification thread was stuck: refused at once


async def _all(
    checks: list[Coroutine[Any, Any, ObjectFacts | _Unfinished]],
) -> list[ObjectFacts | _Unfinished]:
    """Every check's result; if one raises (an outage), the others are cancelled, so
    none is left waiting for a thread."""
    tasks = [asyncio.ensure_future(check) for check in checks]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


class NoStorage:
    """For a deployment where the service cannot see the jobs' storage (setting
    checkpoint.verify_uris = false): every claim is unverifiable, so only a scheme
    trusted for the job's class is accepted."""

    async def verify(self, claim: CheckpointRef, kind: CheckpointKind) -> Verdict | None:
        return None


def require_backend(scheme: str) -> None:
    """Raise ValueError (saying what to install) if fsspec cannot read `scheme`."""
    import fsspec

    try:
        fsspec.get_filesystem_class(scheme)
    except (ImportError, ValueError) as exc:
        raise ValueError(
            f"checkpoint.verify_schemes names {scheme!r}, which this installation cannot "
            f"read: {exc}"
        ) from None


def _locate(uri: str) -> tuple[Any, str]:
    """The filesystem of a URI and the path on it (a file URI is percent-decoded, as
    Path.as_uri encoded it)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if uri_scheme(uri) == FILE_SCHEME:
        return LocalFileSystem(), local_path(uri)
    fs, path = url_to_fs(uri)
    return fs, str(path)


def _inspect_uri(
    uri: str,
    expected_bytes: int,
    deadline: float,
    stop: threading.Event,
    roots: tuple[str, ...] = (),
) -> ObjectFacts | None:
    """`_inspect` of the object a URI names."""
    try:
        fs, path = _locate(uri)
    except Exception as exc:
        return _failure(exc)
    return _inspect(fs, path, expected_bytes, deadline, stop, roots)


def _read_manifest(
    uri: str, expected_bytes: int, roots: tuple[str, ...] = ()
) -> tuple[ManifestFacts, tuple[Any, str] | None]:
    """A manifest claim's manifest: its facts, what it lists, and the filesystem and
    directory its files are in (None when it lists nothing to check)."""
    try:
        fs, path = _locate(uri)
    except Exception as exc:
        return ManifestFacts(manifest=_failure(exc)), None
    raw, facts = _read_small(fs, path, expected_bytes, roots)
    if raw is None:
        return ManifestFacts(manifest=facts), None
    try:
        listed = Manifest.parse(raw)
    except MalformedManifest as exc:
        return ManifestFacts(manifest=facts, problem=str(exc)), None
    return ManifestFacts(manifest=facts, listed=listed), (fs, path.rsplit("/", 1)[0])


def _read_small(
    fs: Any, path: str, expected_bytes: int, roots: tuple[str, ...] = ()
) -> tuple[bytes | None, ObjectFacts]:
    """A manifest's bytes and facts; no bytes when it is missing or its size is not the
    claimed one (or too large to be a manifest)."""
    try:
        size = _size(fs, path, roots)
        if size is None:
            return None, ObjectFacts(exists=False)
        if size != expected_bytes or size > MAX_MANIFEST_BYTES:
            return None, ObjectFacts(exists=True, bytes=size)
        # One byte more than the size stated: a file that grew since is not read on.
        with _open(fs, path, roots) as f:
            raw = f.read(size + 1)
    except FileNotFoundError:
        return None, ObjectFacts(exists=False)
    except Exception as exc:
        return None, _failure(exc)
    if not isinstance(raw, bytes):
        raw = bytes(raw)
    if len(raw) != size:
        return None, ObjectFacts(exists=True, bytes=len(raw))  # changed while being read
    return raw, ObjectFacts(exists=True, bytes=len(raw), sha256=hashlib.sha256(raw).hexdigest())


def _inspect(
    fs: Any,
    path: str,
    expected_bytes: int,
    deadline: float,
    stop: threading.Event,
    roots: tuple[str, ...] = (),
) -> ObjectFacts | None:
    """What one object holds; None if the deadline passed (or `stop` was set) first."""
    try:
        size = _size(fs, path, roots)
        if size is None:
            return ObjectFacts(exists=False)
        if size != expected_bytes:
            # The claim is already false; do not read gigabytes to say so twice.
            return ObjectFacts(exists=True, bytes=size)
        if (stored := _stored_sha256(fs, path)) is not None:
            return ObjectFacts(exists=True, bytes=size, sha256=stored)
        digest = hashlib.sha256()
        read = 0
        with _open(fs, path, roots) as f:
            # Never past one byte more than the size stated: a file that grows while it
            # is read (or one that reports a size it does not hold) ends the reading.
            while chunk := f.read(min(_CHUNK, size + 1 - read)):
                if stop.is_set() or time.monotonic() > deadline:
                    return None
                digest.update(chunk)
                read += len(chunk)
        if read != size:
            return ObjectFacts(exists=True, bytes=read)  # changed while being read
        return ObjectFacts(exists=True, bytes=size, sha256=digest.hexdigest())
    except FileNotFoundError:
        return ObjectFacts(exists=False)
    except Exception as exc:
        return _failure(exc)


def _size(fs: Any, path: str, roots: tuple[str, ...] = ()) -> int | None:
    """The size of a plain object or file; None if there is none (a directory is none).
    A local file outside `roots` (when given) is refused before anything is asked of it."""
    _confine(fs, path, roots)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return None
    kind = info.get("type")
    if kind == "other":
        # A device, FIFO or socket (/dev/zero, a named pipe): reading one could block
        # or never end, and it is no checkpoint. Refused without being opened.
        raise _NotPlain(f"{path} is not a regular file (not read)")
    if kind != "file":
        return None
    if info.get("islink"):
        # A link would let a claim make the service read (and report the size and
        # digest of) any file it can see; a checkpoint's files are plain files.
        raise _NotPlain(f"{path} is a symbolic link (not followed)")
    size = info.get("size")
    return int(size) if isinstance(size, int) else None


class _NotPlain(Exception):
    """What a claim names is no plain file: refused without being read."""


def _confine(fs: Any, path: str, roots: tuple[str, ...]) -> None:
    """Refuse a local path outside `roots` (its directories' links resolved; its last
    component is never followed). Not a local filesystem, or no roots: nothing to do."""
    from fsspec.implementations.local import LocalFileSystem

    if roots and isinstance(fs, LocalFileSystem):
        directory, name = os.path.split(path)
        _check_inside(path, os.path.join(os.path.realpath(directory), name), roots)


def _check_inside(path: str, real: str, roots: tuple[str, ...]) -> None:
    if not any(real.startswith(root.rstrip("/") + "/") for root in roots):
        raise _NotPlain(
            f"{path} is outside the checkpoint directories (checkpoint.file_roots: "
            f"{', '.join(roots)}; not read)"
        )


def _open(fs: Any, path: str, roots: tuple[str, ...] = ()) -> BinaryIO:
    """`path` open for reading. A local file is opened without following a link and
    without blocking, and must be a regular file once open: it may have been swapped
    for a link or a FIFO (whose open would wait for a writer) since `_size` looked; and
    what was opened must lie in `roots` (a directory of its path may have been swapped
    for a link since)."""
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        opened: BinaryIO = fs.open(path, "rb", block_size=_CHUNK)
        return opened
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _NotPlain(f"{path} is not a regular file (not read)")
        if roots:
            opened_as = Path(f"/proc/self/fd/{fd}")
            if opened_as.is_symlink():  # Linux: the path the kernel resolved
                _check_inside(path, os.readlink(opened_as), roots)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _stored_sha256(fs: Any, path: str) -> str | None:
    """The whole-object sha256 the store itself computed and checked, if it keeps one."""
    if "s3" not in _protocols(fs):
        return None
    bucket, _, key = path.partition("/")
    head = fs.call_s3("head_object", Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    value = head.get("ChecksumSHA256")
    # A multipart upload's checksum is a checksum of the parts' checksums ("...-N").
    if not isinstance(value, str) or "-" in value or head.get("ChecksumType") == "COMPOSITE":
        return None
    try:
        return base64.b64decode(value, validate=True).hex()
    except ValueError:
        return None


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _failure(exc: BaseException) -> ObjectFacts:
    if isinstance(exc, _NotPlain):
        return ObjectFacts(exists=False, error=str(exc))
    if is_outage(exc) or _unreachable(exc):
        raise Unavailable(f"checkpoint storage unreachable: {type(exc).__name__}: {exc}") from exc
    return ObjectFacts(exists=False, error=f"{type(exc).__name__}: {exc}")


def _unreachable(exc: BaseException) -> bool:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ in _UNREACHABLE:
            return True
        current = current.__cause__ or current.__context__
    return False
