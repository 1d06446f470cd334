"""Checkpoint URIs, as jobs write them and the checkpoint service reads them.

A file URI names a path on the host that reads it: `file:///p` (or `file://localhost/p`),
never another host (`file://node-7/p` would be read as this host's `/p`, a different
file) nor a relative path (read from wherever each reader runs). The SDK, which writes
and resumes checkpoints, and the checkpoint service, which verifies them, hold to the
same rule.
"""

from __future__ import annotations

from typing import Final
from urllib.parse import unquote, urlsplit

__all__ = ["FILE_SCHEME", "local_path"]

FILE_SCHEME: Final = "file"


def local_path(uri: str) -> str:
    """The path a file URI names on this host; ValueError saying why there is none."""
    parts = urlsplit(uri)
    if parts.scheme.lower() != FILE_SCHEME:
        raise ValueError(f"not a file:// URI: {uri!r}")
    if parts.netloc not in ("", "localhost"):
        raise ValueError(
            f"{uri!r} names the host {parts.netloc!r}: a file URI here must name this "
            "host's path (file:///path; shared storage is mounted, or s3://, gs://, az://)"
        )
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise ValueError(f"{uri!r} names no absolute path (file:///path/to/checkpoint)")
    return path
