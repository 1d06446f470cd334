"""Directory checkpoints: describe every file by size and sha256 in a manifest.

    saved = write_manifest(directory, checkpoint_id="ckpt-120", step=120)
    job.confirm(request, saved, StageName.PERSISTED)   # kind=manifest: checkpoint.confirmed v2

The manifest (contracts.manifest) is written last, in one atomic write, next to the
files it lists: a manifest that exists names a checkpoint whose files were all written
before it. `describe` hashes files in parallel threads; the ranks of a gang each hash
the files they wrote (sdk.distributed) and only rank 0 writes the manifest.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Final

from gpusched.contracts.manifest import MANIFEST_NAME, Manifest, ManifestFile
from gpusched.contracts.messages import CheckpointKind
from gpusched.sdk.checkpoints import SavedCheckpoint
from gpusched.sdk.errors import CheckpointError
from gpusched.sdk.storage import Location

DEFAULT_PARALLELISM: Final = 8


def describe(
    directory: Location | str | os.PathLike[str],
    paths: Iterable[str] | None = None,
    *,
    parallelism: int = DEFAULT_PARALLELISM,
) -> list[ManifestFile]:
    """Size and sha256 of `paths` (relative to `directory`; default: every file in it but
    a manifest), hashed in up to `parallelism` threads."""
    where = directory if isinstance(directory, Location) else Location.of(directory)
    names = [p for p in (where.files() if paths is None else paths) if p != MANIFEST_NAME]

    def one(name: str) -> ManifestFile:
        size, sha256 = where.child(name).digest()
        return ManifestFile(path=name, bytes=size, sha256=sha256)

    with ThreadPoolExecutor(max(1, min(parallelism, len(names) or 1))) as pool:
        return list(pool.map(one, names))


def write_manifest(
    directory: Location | str | os.PathLike[str],
    *,
    checkpoint_id: str,
    step: int,
    files: Iterable[ManifestFile] | None = None,
    parallelism: int = DEFAULT_PARALLELISM,
) -> SavedCheckpoint:
    """Write the manifest of the checkpoint in `directory` (describing every file in it
    unless `files` already does) and describe the manifest for checkpoint.confirmed."""
    where = directory if isinstance(directory, Location) else Location.of(directory)
    listed = list(files) if files is not None else describe(where, parallelism=parallelism)
    if not listed:
        raise CheckpointError(f"{where.uri} holds no checkpoint files to describe")
    manifest = Manifest(checkpoint_id=checkpoint_id, step=step, files=listed)
    data = manifest.to_bytes()
    target = where.child(MANIFEST_NAME)
    target.write_bytes(data)
    size, sha256 = target.digest()
    if size != len(data):
        raise CheckpointError(f"{target.uri}: wrote {len(data)} bytes, storage holds {size}")
    return SavedCheckpoint(
        checkpoint_id=checkpoint_id,
        step=step,
        uri=target.uri,
        bytes=size,
        sha256=sha256,
        kind=CheckpointKind.MANIFEST,
    )


def read_manifest(uri: str) -> tuple[Location, Manifest]:
    """The checkpoint directory a manifest URI names, and the manifest."""
    target = Location.of(uri)
    try:
        manifest = Manifest.parse(target.read_bytes())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read the checkpoint manifest {uri}: {exc}") from exc
    return target.parent(), manifest


def is_manifest_uri(uri: str) -> bool:
    return uri.rstrip("/").rsplit("/", 1)[-1] == MANIFEST_NAME
