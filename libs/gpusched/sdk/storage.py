"""Where checkpoints go: a local or shared filesystem, or object storage, through fsspec.

A location is a URI (`file:///shared/ckpt`, `s3://bucket/job`, `gs://...`, `az://...`)
or a local path. Each store takes its credentials from its usual environment (AWS_*,
including AWS_ENDPOINT_URL for an S3-compatible store; GOOGLE_APPLICATION_CREDENTIALS;
AZURE_STORAGE_*), exactly as the checkpoint service does when it verifies.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from gpusched.contracts.uris import FILE_SCHEME, local_path
from gpusched.sdk.errors import CheckpointError

_CHUNK: Final = 1 << 20


def _refuse_a_mistyped_uri(text: str) -> None:
    """A path that begins with a store's scheme and one slash (`s3:/bucket/job`) is a
    mistyped URI, not a local directory named `s3:`."""
    head, colon, _ = text.partition(":")
    if not colon or "/" in head:
        return
    from fsspec.registry import known_implementations

    if head.lower() in known_implementations:
        raise CheckpointError(
            f"{text!r} is no URI: write {head}://... (for a local directory of that name: ./{text})"
        )


@dataclass(frozen=True)
class Location:
    """A directory or object on some filesystem: the fsspec filesystem, the path on it,
    and the URI that names it for the control plane."""

    fs: Any
    path: str
    uri: str

    @classmethod
    def of(cls, where: str | os.PathLike[str]) -> Location:
        """The location a URI or local path names. CheckpointError for a file URI that
        names another host or no absolute path, and for a store's scheme written
        without `//` (`s3:/bucket`: it would be a local directory named `s3:`)."""
        text = os.fspath(where)
        scheme = urlsplit(text).scheme.lower() if "://" in text or text.startswith("file:") else ""
        if not scheme:
            _refuse_a_mistyped_uri(text)
        if scheme in ("", FILE_SCHEME):
            from fsspec.implementations.local import LocalFileSystem

            try:
                path = Path(local_path(text) if scheme else text).resolve()
            except ValueError as exc:
                raise CheckpointError(str(exc)) from None
            return cls(LocalFileSystem(), str(path), path.as_uri())
        try:
            from fsspec.core import url_to_fs

            fs, path = url_to_fs(text)
        except (ImportError, ValueError) as exc:
            raise CheckpointError(
                f"cannot write checkpoints to {text!r}: {exc} (s3 needs gpusched[s3])"
            ) from None
        return cls(fs, str(path).rstrip("/"), f"{scheme}://{str(path).rstrip('/')}")

    @property
    def is_local(self) -> bool:
        return self.uri.startswith(f"{FILE_SCHEME}:")

    def child(self, name: str) -> Location:
        path = f"{self.path}/{name}"
        if self.is_local:
            return Location(self.fs, path, Path(path).as_uri())
        return Location(self.fs, path, f"{self.uri}/{name}")

    def parent(self) -> Location:
        return Location.of(self.uri.rsplit("/", 1)[0])

    def makedirs(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)

    def read_bytes(self) -> bytes:
        data = self.fs.cat_file(self.path)
        return bytes(data)

    def write_bytes(self, data: bytes) -> None:
        """Write `data` whole or not at all: a local file goes through a temporary file,
        fsync and rename; an object is one PUT (S3 stores its sha256 with it)."""
        if self.is_local:
            target = Path(self.path)
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
            try:
                with tmp.open("wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, target)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(target.parent)
            return
        extra = {"ChecksumAlgorithm": "SHA256"} if "s3" in _protocols(self.fs) else {}
        self.fs.pipe_file(self.path, data, **extra)

    def copy_to(self, target: Location) -> None:
        """Stream this object to `target` in chunks (a checkpoint shard may not fit in
        memory twice), durably: a local target is fsynced."""
        target.fs.makedirs(target.path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(self.path, "rb", block_size=_CHUNK) as src:
            if target.is_local:
                with open(target.path, "wb") as dst:
                    shutil.copyfileobj(src, dst, _CHUNK)
                    dst.flush()
                    os.fsync(dst.fileno())
                return
            with target.fs.open(target.path, "wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)

    def digest(self) -> tuple[int, str]:
        """(size, sha256 hex) of the object, read in chunks."""
        h = hashlib.sha256()
        size = 0
        with self.fs.open(self.path, "rb", block_size=_CHUNK) as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                size += len(chunk)
        return size, h.hexdigest()

    def files(self) -> list[str]:
        """Every file under this directory, as paths relative to it, sorted."""
        found = self.fs.find(self.path, withdirs=False)
        prefix = self.path.rstrip("/") + "/"
        return sorted(str(p)[len(prefix) :] for p in found if str(p).startswith(prefix))


def fsync_dir(directory: Path) -> None:
    # A rename is durable only once the directory entry is; not possible everywhere.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _protocols(fs: Any) -> tuple[str, ...]:
    protocol = getattr(fs, "protocol", ())
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)
