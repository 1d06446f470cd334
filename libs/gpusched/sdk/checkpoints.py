"""What a saved checkpoint is, and a safe way to write one to a file."""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from gpusched.contracts.messages import CheckpointKind
from gpusched.contracts.uris import local_path
from gpusched.sdk.storage import fsync_dir

_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class SavedCheckpoint:
    """A checkpoint as the control plane records it (checkpoint.confirmed)."""

    checkpoint_id: str
    step: int
    uri: str
    bytes: int
    sha256: str
    # FILE: uri/bytes/sha256 describe the checkpoint; MANIFEST: they describe its
    # manifest (sdk.manifest), which lists every file of a directory checkpoint.
    kind: CheckpointKind = CheckpointKind.FILE


def save_file_checkpoint(
    path: str | os.PathLike[str],
    writer: Callable[[BinaryIO], object],
    *,
    step: int,
    checkpoint_id: str | None = None,
) -> SavedCheckpoint:
    """Write a checkpoint file atomically and describe it.

    `writer` gets a binary file open for writing (e.g. `lambda f: torch.save(state, f)`).
    The data goes to a temporary file in the same directory, is fsynced, then renamed
    over `path`; so a crash leaves either the old file or the new one, never a torn one,
    and a confirmed checkpoint is on disk when the confirmation leaves.
    """
    target = Path(path).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    try:
        with tmp.open("wb") as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(target.parent)
    size, digest = file_digest(target)
    return SavedCheckpoint(
        checkpoint_id=checkpoint_id or uuid.uuid4().hex,
        step=step,
        uri=target.as_uri(),
        bytes=size,
        sha256=digest,
    )


def file_digest(path: str | os.PathLike[str]) -> tuple[int, str]:
    """(size in bytes, sha256 hex) of a file, read in chunks."""
    h = hashlib.sha256()
    size = 0
    with Path(path).open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def checkpoint_path(uri: str) -> Path:
    """The local path of a file:// checkpoint URI (what GPUSCHED_RESUME_URI holds).

    ValueError for another scheme, another host, a relative path."""
    return Path(local_path(uri))
