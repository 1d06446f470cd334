"""The storage adapter: reads what a checkpoint URI actually holds.

Only file:// is readable here (a local or shared filesystem the service sees); other
schemes report None: unverifiable, so refused unless trusted for the job's class
(checkpoint.trusted_schemes). Filesystem errors become facts (`exists=False` with the
error), never exceptions out of the adapter.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Final, Protocol
from urllib.parse import unquote, urlparse

from gpusched.checkpoint.verification import FILE_SCHEME, ObjectFacts

_CHUNK: Final = 1 << 20


class CheckpointStorage(Protocol):
    async def inspect(self, uri: str, expected_bytes: int) -> ObjectFacts | None:
        """What `uri` holds, or None if this storage cannot read that scheme."""


class FileStorage:
    async def inspect(self, uri: str, expected_bytes: int) -> ObjectFacts | None:
        parsed = urlparse(uri)
        if parsed.scheme != FILE_SCHEME:
            return None
        # Hashing a large file is seconds of I/O: off the event loop.
        return await asyncio.to_thread(_inspect_file, Path(unquote(parsed.path)), expected_bytes)


class NoStorage:
    """For a deployment where the service cannot see the jobs' storage (setting
    checkpoint.verify_uris = false): every claim is unverifiable, so only a scheme
    trusted for the job's class is accepted."""

    async def inspect(self, uri: str, expected_bytes: int) -> ObjectFacts | None:
        return None


def _inspect_file(path: Path, expected_bytes: int) -> ObjectFacts:
    try:
        if not path.is_file():
            return ObjectFacts(exists=False)
        size = path.stat().st_size
        if size != expected_bytes:
            # The claim is already false; do not read gigabytes to say so twice.
            return ObjectFacts(exists=True, bytes=size)
        digest = hashlib.sha256()
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        return ObjectFacts(exists=True, bytes=size, sha256=digest.hexdigest())
    except OSError as exc:
        return ObjectFacts(exists=False, error=f"{type(exc).__name__}: {exc}")
