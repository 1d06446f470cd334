"""A torchrun gang: every rank checkpoints with torch.distributed.checkpoint, one confirms.

    dist.init_process_group("gloo")            # or "cpu:gloo,cuda:nccl" on GPUs
    with Gang.from_env() as gang:               # rank 0 holds the job's client
        state = ShardedState(model, optimizer)  # DDP, FSDP2 or plain modules
        step = gang.resume(state)               # 0, or where the evicted attempt stopped
        gang.started()
        while step < steps:
            train_step(); step += 1
            gang.answer(state, step)            # collective: every rank, every step
        gang.completed(step)

Rank 0 alone talks to the control plane. `answer` (like `requested`) is a collective:
rank 0 broadcasts the pending checkpoint request, so every rank saves at the same step.
All ranks write their shards with torch.distributed.checkpoint (`save`, or `save_async`
to keep training while the shards are written), then each hashes its share of the
files, rank 0 gathers the lists, writes the manifest (sdk.manifest) and sends exactly one
confirmation; a rank that fails, or dies, makes the checkpoint a checkpoint.failed, never
a partial confirmation. With `persist_to` (e.g. s3://bucket/job), every rank then uploads
its share there: `snapshotted` names the first copy, `persisted` the durable one.

The collectives run on two gloo groups of their own (control messages on the training
thread, shards possibly on async_save's thread), never on the group training uses.
torch is imported when a Gang is made, so the SDK works without it.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import secrets
import signal
import traceback
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Final

from gpusched.contracts.manifest import ManifestFile
from gpusched.contracts.messages import StageName
from gpusched.sdk.checkpoints import SavedCheckpoint
from gpusched.sdk.control import CheckpointRequest
from gpusched.sdk.environment import JobEnvironment
from gpusched.sdk.errors import CheckpointError
from gpusched.sdk.manifest import describe, is_manifest_uri, read_manifest, write_manifest
from gpusched.sdk.storage import Location
from gpusched.sdk.torch import rng_state, set_rng_state

if TYPE_CHECKING:
    import torch

    from gpusched.sdk.sync import JobClient

DEFAULT_TIMEOUT_S: Final = 600.0
# Hashing threads per rank; the ranks hash their shares at once.
DEFAULT_PARALLELISM: Final = 4


def _import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CheckpointError(
            f"gpusched.sdk.distributed needs PyTorch ({name}): pip install 'gpusched[torch]'"
        ) from exc


class Terminated(BaseException):
    """SIGTERM arrived while the gang was saving: the save is abandoned (and reported
    failed), then the process stops as SIGTERM asked."""


class ShardedState:
    """The training state of one rank as torch.distributed.checkpoint saves it: model and
    optimizer through get_state_dict (sharded DTensors under FSDP, deduplicated
    replicas under DDP), the step, and this rank's random number generators."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model = model
        self.optimizer = optimizer
        self.extra: dict[str, Any] = {}

    def to_save(self, rank: int, step: int) -> dict[str, Any]:
        sd = _import("torch.distributed.checkpoint.state_dict")
        model_sd, optim_sd = sd.get_state_dict(self.model, self._optimizers())
        rng = io.BytesIO(pickle.dumps({"rng": rng_state(), "extra": self.extra}))
        return {"model": model_sd, "optim": optim_sd, "step": step, _rng_key(rank): rng}

    def template(self, rank: int) -> dict[str, Any]:
        return self.to_save(rank, 0) | {_rng_key(rank): io.BytesIO()}

    def restore(self, rank: int, loaded: Mapping[str, Any]) -> int:
        sd = _import("torch.distributed.checkpoint.state_dict")
        sd.set_state_dict(
            self.model,
            self._optimizers(),
            model_state_dict=loaded["model"],
            optim_state_dict=loaded["optim"],
        )
        blob = loaded[_rng_key(rank)]
        raw = blob.getvalue() if isinstance(blob, io.BytesIO) else blob
        # This job's own checkpoint, verified by the control plane before it was offered
        # for resume: the RNG states are Python objects, so pickle.
        rest = pickle.loads(raw) if isinstance(raw, bytes) else raw
        set_rng_state(rest["rng"])
        self.extra = dict(rest["extra"])
        return int(loaded["step"])

    def _optimizers(self) -> tuple[Any, ...]:
        return () if self.optimizer is None else (self.optimizer,)


def _rng_key(rank: int) -> str:
    # Per rank: each rank draws its own batches and dropout masks.
    return f"rng.rank{rank}"


@dataclass
class _Inflight:
    request: CheckpointRequest | None
    checkpoint_id: str
    step: int
    target: Location
    upload: Future[Any]


class Gang:
    """The ranks of one job checkpointing together (see the module docstring)."""

    def __init__(
        self,
        job: JobClient | None,
        directory: str | os.PathLike[str],
        *,
        resume_uri: str | None = None,
        persist_to: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        parallelism: int = DEFAULT_PARALLELISM,
    ) -> None:
        dist = _import("torch.distributed")
        if not dist.is_initialized():
            raise CheckpointError("call torch.distributed.init_process_group before Gang(...)")
        self._dist = dist
        self._dcp = _import("torch.distributed.checkpoint")
        self.rank: int = dist.get_rank()
        self.world: int = dist.get_world_size()
        if self.rank == 0 and job is None:
            raise CheckpointError("rank 0 of a gang needs the job's client")
        self.job = job if self.rank == 0 else None
        self.directory = Location.of(directory)
        self.persist_to = None if persist_to is None else Location.of(persist_to)
        self.resume_uri = resume_uri
        self._parallelism = parallelism
        timeout = timedelta(seconds=timeout_s)
        # Every rank creates both groups, in the same order.
        self._control = dist.new_group(backend="gloo", timeout=timeout)
        self._io = dist.new_group(backend="gloo", timeout=timeout)
        self._inflight: _Inflight | None = None

    @classmethod
    def from_env(cls, directory: str | os.PathLike[str] | None = None, **kwargs: Any) -> Gang:
        """The gang of a job the agent launched with torchrun: every rank reads the
        job's GPUSCHED_* variables; rank 0 connects the client. `directory` defaults to
        the job's checkpoint directory."""
        from gpusched.sdk.sync import JobClient

        env = JobEnvironment.from_environ()
        where = directory or env.checkpoint_dir
        if where is None:
            raise CheckpointError(
                "no checkpoint directory: pass one, or set GPUSCHED_CHECKPOINT_DIR"
            )
        dist = _import("torch.distributed")
        job = None
        if dist.is_initialized() and dist.get_rank() == 0:
            job = JobClient.from_env()
            job.start()
        try:
            return cls(job, where, resume_uri=env.resume_uri, **kwargs)
        except BaseException:
            if job is not None:
                job.close()
            raise

    def __enter__(self) -> Gang:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self.job is not None:
            self.job.close()

    # --- job events: rank 0 speaks for the gang -------------------------------------------
    def started(self) -> None:
        if self.job is not None:
            self.job.started(resumed_from=self.job.resume_checkpoint_id)

    def progress(self, step: int, **metrics: Any) -> None:
        if self.job is not None:
            self.job.progress(step, **metrics)

    def completed(self, step: int | None = None) -> None:
        if self.job is not None:
            self.job.completed(step)

    # --- resume -----------------------------------------------------------------------------
    def resume(self, state: ShardedState) -> int:
        """Load every rank's part of the checkpoint this attempt resumes from (the
        manifest GPUSCHED_RESUME_URI names); the step to go on from, 0 if none."""
        if self.resume_uri is None:
            return 0
        if not is_manifest_uri(self.resume_uri):
            raise CheckpointError(f"{self.resume_uri} is not a directory checkpoint's manifest")
        directory, _manifest = read_manifest(self.resume_uri)
        loaded = state.template(self.rank)
        self._dcp.load(loaded, storage_reader=self._reader(directory), process_group=self._io)
        return state.restore(self.rank, loaded)

    # --- checkpoint requests -----------------------------------------------------------------
    def requested(self) -> CheckpointRequest | None:
        """The pending checkpoint request as rank 0 knows it, on every rank (a
        collective). Also finishes a `save_async` once every rank's shards are written."""
        request = self.job.checkpoint_requested if self.job is not None else None
        written = self._inflight is not None and self._inflight.upload.done()
        everyone = self._gather((request, written))
        if self._inflight is not None and all(done for _, done in everyone):
            with _terminations_deferred():
                self._finish_inflight()
        return everyone[0][0]  # type: ignore[no-any-return]

    def answer(self, state: ShardedState, step: int) -> SavedCheckpoint | None:
        """Call on every rank between steps: if the control plane asked for a checkpoint,
        the gang saves this step and confirms it; else nothing."""
        request = self.requested()
        if request is None:
            return None
        return self.save(request, state, step)

    def save(
        self, request: CheckpointRequest | None, state: ShardedState, step: int
    ) -> SavedCheckpoint:
        """Every rank saves its shards of `step` and the gang confirms once (a collective;
        `request=None`: a periodic checkpoint). Raises CheckpointError on every rank if any
        rank failed; checkpoint.failed has then been published."""
        if self.job is not None:
            self.job.take(request)
        with _terminations_deferred():
            checkpoint_id, target = self._agree_on_target(step)
            error: str | None = None
            try:
                self._dcp.save(
                    state.to_save(self.rank, step),
                    storage_writer=self._writer(target),
                    process_group=self._io,
                )
            except Exception as exc:
                error = _describe(self.rank, "save", exc)
            return self._confirm(request, checkpoint_id, step, target, error)

    def save_async(self, request: CheckpointRequest | None, state: ShardedState, step: int) -> None:
        """Stage `step` in memory and write the shards in the background (torch's
        async_save): training goes on; a later `requested()`/`answer()` confirms once
        every rank's shards are written. One at a time: a second waits for the first."""
        self.wait()
        if self.job is not None:
            self.job.take(request)
        checkpoint_id, target = self._agree_on_target(step)
        upload = self._dcp.async_save(
            state.to_save(self.rank, step),
            storage_writer=self._writer(target),
            process_group=self._io,
        )
        future = getattr(upload, "upload_completion", upload)
        self._inflight = _Inflight(request, checkpoint_id, step, target, future)

    def wait(self) -> SavedCheckpoint | None:
        """Finish an async save now (a collective): the confirmed checkpoint, if any."""
        if self._inflight is None:
            return None
        self._inflight.upload.exception()  # waits for this rank's shards
        with _terminations_deferred():
            return self._drain_inflight()

    # --- the steps of a save ------------------------------------------------------------------
    def _drain_inflight(self) -> SavedCheckpoint | None:
        self._gather(True)  # every rank's shards are written
        return self._finish_inflight()

    def _finish_inflight(self) -> SavedCheckpoint | None:
        inflight, self._inflight = self._inflight, None
        assert inflight is not None
        failure = inflight.upload.exception()
        error = None if failure is None else _describe(self.rank, "async save", failure)
        try:
            return self._confirm(
                inflight.request, inflight.checkpoint_id, inflight.step, inflight.target, error
            )
        except CheckpointError:
            return None  # reported; training goes on

    def _agree_on_target(self, step: int) -> tuple[str, Location]:
        # One fresh directory per save, named by rank 0: a retried save never mixes
        # with the shards of an earlier, failed one.
        token = secrets.token_hex(4) if self.rank == 0 else ""
        chosen = self._broadcast(f"step-{step:09d}-{token}")
        return chosen, self.directory.child(chosen)

    def _confirm(
        self,
        request: CheckpointRequest | None,
        checkpoint_id: str,
        step: int,
        target: Location,
        error: str | None,
    ) -> SavedCheckpoint:
        """Hash, gather, write the manifest, confirm (rank 0): the end of every save."""
        errors = self._gather_errors(error)
        files: list[ManifestFile] = []
        if not errors:
            files, errors = self._share_of(target, "hash")
        saved: SavedCheckpoint | None = None
        if not errors and self.job is not None:
            try:
                saved = write_manifest(target, checkpoint_id=checkpoint_id, step=step, files=files)
                stage = StageName.SNAPSHOTTED if self.persist_to else StageName.PERSISTED
                if stage is StageName.PERSISTED:
                    self.job.checkpoint_confirmed(request, saved, StageName.SNAPSHOTTED)
                self.job.checkpoint_confirmed(request, saved, stage)
            except Exception as exc:
                errors = [_describe(0, "manifest", exc)]
        errors = self._broadcast(errors)
        if not errors and self.persist_to is not None:
            durable = self.persist_to.child(checkpoint_id)
            _, errors = self._share_of(target, "persist", copy_to=durable, files=files)
            if not errors and self.job is not None:
                try:
                    saved = write_manifest(
                        durable, checkpoint_id=checkpoint_id, step=step, files=files
                    )
                    self.job.checkpoint_confirmed(request, saved, StageName.PERSISTED)
                except Exception as exc:
                    errors = [_describe(0, "manifest", exc)]
            errors = self._broadcast(errors)
        if errors:
            if self.job is not None:
                self.job.checkpoint_failed(
                    request.request_id if request else None, "; ".join(errors)
                )
            raise CheckpointError(f"checkpoint of step {step} failed: {'; '.join(errors)}")
        result: SavedCheckpoint = self._broadcast(saved)
        return result

    def _share_of(
        self,
        target: Location,
        what: str,
        *,
        copy_to: Location | None = None,
        files: list[ManifestFile] | None = None,
    ) -> tuple[list[ManifestFile], list[str]]:
        """This rank's share of the files (every world-th, by name): hashed, or copied to
        `copy_to`; gathered from every rank. (files, errors)."""
        mine: list[ManifestFile] = []
        error = None
        try:
            if files is None:
                _invalidate(target)
                names = target.files()[self.rank :: self.world]
                mine = describe(target, names, parallelism=self._parallelism)
            else:
                assert copy_to is not None
                for entry in files[self.rank :: self.world]:
                    target.child(entry.path).copy_to(copy_to.child(entry.path))
        except Exception as exc:
            error = _describe(self.rank, what, exc)
        gathered = self._gather_or_lost((mine, error))
        if gathered is None:
            return [], [f"a rank was lost during the {what}"]
        all_files = [f for part, _ in gathered for f in part]
        errors = [e for _, e in gathered if e is not None]
        if not errors and files is None and not all_files:
            errors = [f"{target.uri} holds no files after the save"]
        return all_files, errors

    def _gather_errors(self, error: str | None) -> list[str]:
        gathered = self._gather_or_lost(error)
        if gathered is None:
            return [f"rank {self.rank}: a rank was lost during the save"]
        return [e for e in gathered if e is not None]

    # --- collectives ---------------------------------------------------------------------------
    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        self._dist.all_gather_object(out, value, group=self._control)
        return out

    def _gather_or_lost(self, value: Any) -> list[Any] | None:
        """all_gather, or None when a rank is gone (its process died: gloo says so)."""
        try:
            return self._gather(value)
        except RuntimeError:
            return None

    def _broadcast(self, value: Any) -> Any:
        box = [value]
        try:
            self._dist.broadcast_object_list(box, src=0, group=self._control)
        except RuntimeError as exc:
            if self.rank == 0:
                return value  # rank 0's own view stands; the others failed with it
            raise CheckpointError(f"rank {self.rank}: lost rank 0: {exc}") from exc
        return box[0]

    def _writer(self, target: Location) -> Any:
        if target.is_local:
            return self._dcp.FileSystemWriter(target.path)
        fsspec_fs = _import("torch.distributed.checkpoint._fsspec_filesystem")
        return fsspec_fs.FsspecWriter(target.uri)

    def _reader(self, directory: Location) -> Any:
        if directory.is_local:
            return self._dcp.FileSystemReader(directory.path)
        fsspec_fs = _import("torch.distributed.checkpoint._fsspec_filesystem")
        return fsspec_fs.FsspecReader(directory.uri)


def _invalidate(target: Location) -> None:
    # An object store's listing may be cached from before the shards were written.
    invalidate = getattr(target.fs, "invalidate_cache", None)
    if invalidate is not None:
        invalidate(target.path)


def _describe(rank: int, what: str, exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" at {last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno}" if last else ""
    return f"rank {rank}: {what} failed: {type(exc).__name__}: {exc}{where}"


@contextmanager
def _terminations_deferred() -> Iterator[None]:
    """While the gang saves, SIGTERM (the agent evicting; torchrun stopping the gang after
    a rank died) waits until the checkpoint is confirmed or reported failed, then stops
    the process as SIGTERM asked (Terminated). A rank that died makes the others' gloo
    calls fail at once, and the group's timeout bounds the rest. Outside the main
    thread nothing changes."""
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    try:
        previous = signal.signal(signal.SIGTERM, hold)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if received:
        raise Terminated(f"signal {received[0]} during a checkpoint")
