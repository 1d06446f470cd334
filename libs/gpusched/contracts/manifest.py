"""The manifest of a directory checkpoint: every file, with its size and sha256.

A checkpoint written as many files (torch.distributed.checkpoint writes a shard per
rank and a `.metadata` file) is confirmed by its manifest: checkpoint.confirmed v2 with
kind=manifest names the manifest's URI and gives the manifest's own bytes and sha256;
the manifest names every file relative to its own directory. The checkpoint service
verifies the manifest against the claim, then every file it lists against the manifest.

    {"format": "gpusched.manifest/1", "checkpoint_id": "...", "step": 120,
     "files": [{"path": ".metadata", "bytes": 1841, "sha256": "..."},
               {"path": "__0_0.distcp", "bytes": 52110, "sha256": "..."}]}

A public format, like the job events: readers refuse what they do not understand
(another format string) and ignore unknown optional fields.
"""

from __future__ import annotations

import json
from typing import Annotated, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpusched.contracts.validation import Bytes, Id, Step, first_error

FORMAT: Final = "gpusched.manifest/1"
# The manifest's file name inside the checkpoint directory (what the SDK writes).
MANIFEST_NAME: Final = "gpusched-manifest.json"
# Bounds a reader holds to before trusting anything in a manifest.
MAX_MANIFEST_BYTES: Final = 16 << 20
MAX_FILES: Final = 100_000
_PATH_MAX: Final = 1024

Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]


class MalformedManifest(ValueError):
    """Not a manifest this build reads: not JSON, another format, a bad path or size."""


class ManifestFile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    path: str = Field(min_length=1, max_length=_PATH_MAX)
    bytes: Bytes
    sha256: Sha256

    @field_validator("path")
    @classmethod
    def _relative_inside(cls, path: str) -> str:
        # A manifest is read by a service with storage credentials: a path must not
        # lead it out of the checkpoint's directory.
        if path.startswith("/") or "\\" in path or ":" in path.split("/", 1)[0]:
            raise ValueError(f"{path!r} is not a path relative to the manifest")
        parts = path.split("/")
        if any(part in ("", ".", "..") for part in parts):
            raise ValueError(f"{path!r} has an empty, '.' or '..' component")
        if any(not ch.isprintable() for ch in path):
            raise ValueError(f"{path!r} has a control character")
        if path == MANIFEST_NAME:
            raise ValueError("a manifest does not list itself")
        return path


class Manifest(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    format: Literal["gpusched.manifest/1"] = FORMAT
    checkpoint_id: Id
    step: Step
    files: list[ManifestFile] = Field(min_length=1, max_length=MAX_FILES)

    @field_validator("files")
    @classmethod
    def _unique(cls, files: list[ManifestFile]) -> list[ManifestFile]:
        seen: set[str] = set()
        for f in files:
            if f.path in seen:
                raise ValueError(f"{f.path!r} is listed twice")
            seen.add(f.path)
        return files

    @property
    def total_bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    def to_bytes(self) -> bytes:
        """The manifest as stored: sorted, compact JSON (the same state, the same bytes)."""
        files = sorted(self.files, key=lambda f: f.path)
        body = {
            "format": self.format,
            "checkpoint_id": self.checkpoint_id,
            "step": self.step,
            "files": [f.model_dump() for f in files],
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def parse(cls, raw: bytes) -> Manifest:
        if len(raw) > MAX_MANIFEST_BYTES:
            raise MalformedManifest(f"{len(raw)} bytes: a manifest is at most {MAX_MANIFEST_BYTES}")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise MalformedManifest(f"not JSON ({exc})") from None
        except (RecursionError, MemoryError) as exc:
            # Nesting the parser cannot follow (a few hundred kB of `[`): the claim's
            # own bytes are at fault, so it is judged false, never retried.
            raise MalformedManifest(f"not a manifest: {type(exc).__name__}") from None
        if not isinstance(data, dict):
            raise MalformedManifest("not a JSON object")
        if data.get("format") != FORMAT:
            raise MalformedManifest(f"format {data.get('format')!r}, this build reads {FORMAT!r}")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            where, message = first_error(exc)
            raise MalformedManifest(f"{where}: {message}") from None
