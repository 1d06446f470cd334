"""The stack file: where a running `gpusched up` can be reached, kept in its data dir.

`<data_dir>/stack.json` holds the server URLs, the subject prefix, the ports and the pids
of one stack. `gpusched up` writes it (atomically, mode 0600: the URLs are the keys to
the stack) and reuses its ports on the next start, so clients keep a URL that works; the
CLI reads it when GPUSCHED_NATS_URL / GPUSCHED_DATABASE_URL are not set.

`<data_dir>/stack.lock` is held (flock) by the process that runs the stack, for as long
as it runs; the kernel drops it when that process dies, even by SIGKILL, so "a stack
runs on this data dir" is never a stale guess.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from pathlib import Path
from typing import IO

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "StackFile",
    "StackFileError",
    "StackLock",
    "StackRunning",
    "lock_path",
    "read_stack_file",
    "stack_file_path",
    "write_stack_file",
]

FILE_NAME = "stack.json"
LOCK_NAME = "stack.lock"


class StackFileError(RuntimeError):
    """The stack file exists but cannot be read; the message says which file."""


class StackRunning(RuntimeError):
    """Another process runs a stack on this data dir."""


class StackFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    version: int = 1
    running: bool = False
    nats_url: str | None = None
    database_url: str | None = None
    subject_prefix: str = "gpusched"
    nats_port: int | None = None
    nats_monitor_port: int | None = None
    postgres_port: int | None = None
    log_dir: str | None = None
    # The NATS credentials bundle of the embedded stack (natsauth.AuthBundle).
    auth_dir: str | None = None
    # Who runs the stack ("up") and each server and service, while it runs.
    pids: dict[str, int] = {}
    # Each service's /metrics, /livez and /readyz port (kept for the next start).
    metrics_ports: dict[str, int] = {}


def stack_file_path(data_dir: Path) -> Path:
    return data_dir / FILE_NAME


def lock_path(data_dir: Path) -> Path:
    return data_dir / LOCK_NAME


def read_stack_file(data_dir: Path) -> StackFile | None:
    """The stack file of `data_dir`, or None if there is none."""
    path = stack_file_path(data_dir)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StackFileError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        return StackFile.model_validate_json(raw)
    except ValidationError as exc:
        raise StackFileError(
            f"{path} is not a valid stack file; remove it and start the stack again "
            "(`gpusched up`), or set GPUSCHED_NATS_URL"
        ) from exc


def write_stack_file(data_dir: Path, content: StackFile) -> Path:
    """Replace the stack file in one step (a reader never sees half of it), mode 0600."""
    data_dir.mkdir(parents=True, exist_ok=True)
    path = stack_file_path(data_dir)
    scratch = path.with_name(f".{FILE_NAME}.{os.getpid()}.tmp")
    fd = os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(content.model_dump(mode="json"), indent=2) + "\n")
            out.flush()
            os.fsync(out.fileno())
        os.chmod(scratch, 0o600)  # the umask may have narrowed it; never widened
        os.replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            scratch.unlink()
        raise
    return path


class StackLock:
    """The exclusive right to run a stack on one data dir (see the module docstring)."""

    def __init__(self, data_dir: Path) -> None:
        self.path = lock_path(data_dir)
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        """Take the lock or raise StackRunning naming the holder; re-entrant per object."""
        if self._file is not None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lock_file = self.path.open("a+")
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock_file.seek(0)
            holder = lock_file.read().strip() or "unknown"
            lock_file.close()
            raise StackRunning(
                f"a stack already runs on data dir {self.path.parent} (pid {holder}); "
                "stop it first, or set GPUSCHED_DATA_DIR to another directory"
            ) from None
        except BaseException:
            lock_file.close()
            raise
        lock_file.seek(0)
        lock_file.truncate()
        lock_file.write(f"{os.getpid()}\n")
        lock_file.flush()
        self._file = lock_file

    def release(self) -> None:
        lock_file, self._file = self._file, None
        if lock_file is not None:
            lock_file.close()  # closing drops the flock

    @property
    def held(self) -> bool:
        return self._file is not None
