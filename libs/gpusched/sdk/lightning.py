"""PyTorch Lightning: answer gpusched's checkpoint requests with Lightning's own checkpoint.

    from gpusched.sdk.lightning import GpuschedCallback, ResumableDataLoader

    gpusched = GpuschedCallback.from_env()           # rank 0 connects; the others listen
    trainer = pl.Trainer(callbacks=[gpusched], ...)
    trainer.fit(model, ResumableDataLoader(dataset, batch_size=32),
                ckpt_path=gpusched.resume_path)      # None on a first attempt

After every training batch the callback asks (rank 0, broadcast to every rank through
the strategy) whether the control plane wants a checkpoint; if so, every rank calls
`trainer.save_checkpoint` (Lightning's own format: one file, or a directory for sharded
strategies), and rank 0 confirms it (a file by size and sha256, a directory by its
manifest). `trainer.fit(ckpt_path=...)` resumes: Lightning restores the model, the
optimizers and the loops; the callback's state restores every random number
generator, and ResumableDataLoader the position in the epoch, so a resumed run ends
with the parameters of one that was never interrupted.
"""

from __future__ import annotations

import os
import pickle
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gpusched.sdk.checkpoints import SavedCheckpoint
from gpusched.sdk.environment import JobEnvironment
from gpusched.sdk.errors import CheckpointError
from gpusched.sdk.manifest import write_manifest
from gpusched.sdk.storage import Location
from gpusched.sdk.sync import JobClient
from gpusched.sdk.torch import rng_state, set_rng_state

try:
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gpusched.sdk.lightning needs PyTorch Lightning: pip install 'gpusched[lightning]'"
    ) from exc


def encode_state(state: Any) -> Any:
    """Python objects (the RNG states) as a uint8 tensor: Lightning loads checkpoints
    with weights_only=True, which takes tensors but not arbitrary objects."""
    return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)


def decode_state(tensor: Any) -> Any:
    # This job's own checkpoint, verified by the control plane before it was offered
    # for resume.
    return pickle.loads(tensor.numpy().tobytes())


class GpuschedCallback(pl.Callback):  # type: ignore[misc]
    """See the module docstring. `job` is the job's client on global rank 0 (None on the
    other ranks); `directory` is where checkpoints go (default: the job's directory)."""

    def __init__(
        self,
        job: JobClient | None,
        directory: str | os.PathLike[str],
        *,
        resume_path: str | None = None,
        resumed_from: str | None = None,
    ) -> None:
        self.job = job
        self.directory = Path(directory)
        self.resume_path = resume_path
        self._resumed_from = resumed_from
        self._rng: Any = None
        self.saved: SavedCheckpoint | None = None

    @classmethod
    def from_env(cls, directory: str | os.PathLike[str] | None = None) -> GpuschedCallback:
        env = JobEnvironment.from_environ()
        where = directory or env.checkpoint_dir
        if where is None:
            raise CheckpointError(
                "no checkpoint directory: pass one or set GPUSCHED_CHECKPOINT_DIR"
            )
        # Global rank 0 speaks for the job (torchrun/Lightning set RANK on the others).
        job = JobClient.from_env() if int(os.environ.get("RANK", "0")) == 0 else None
        if job is not None:
            job.start()
        return cls(
            job,
            where,
            resume_path=_local(env.resume_uri),
            resumed_from=env.resume_checkpoint_id,
        )

    # --- events ------------------------------------------------------------------------------
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self.job is not None:
            self.job.started(resumed_from=self._resumed_from)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self.job is not None:
            self.job.completed(trainer.global_step)
            self.job.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.job is not None:
            self.job.close()

    # --- checkpoint requests ---------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        if self.job is not None and step % 10 == 0:
            self.job.progress(step)
        mine = self.job.checkpoint_requested if self.job is not None else None
        request = trainer.strategy.broadcast(mine, src=0)
        if request is None:
            return
        path = self.directory / f"step-{step:09d}-{uuid.uuid4().hex[:8]}.ckpt"
        if self.job is not None:
            self.job.take(request)
        error = None
        try:
            trainer.save_checkpoint(path)  # a collective: every rank takes part
        except Exception as exc:
            error = f"rank {trainer.global_rank}: {type(exc).__name__}: {exc}"
        # One confirmation, and only if every rank saved its part.
        failed = trainer.strategy.reduce_boolean_decision(error is not None, all=False)
        if self.job is None:
            return
        if failed:
            self.job.checkpoint_failed(request.request_id, error or "another rank failed to save")
            return
        saved = describe_checkpoint(path, path.stem, step)
        self.saved = self.job.checkpoint(request, lambda: saved)

    # --- state: every RNG, restored at the next batch ------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"rng": encode_state(rng_state())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_rng_state(decode_state(state_dict["rng"]))


def describe_checkpoint(path: Path, checkpoint_id: str, step: int) -> SavedCheckpoint:
    """A Lightning checkpoint as checkpoint.confirmed describes it: a file by its size and
    sha256, a directory (sharded strategies) by its manifest."""
    where = Location.of(path)
    if path.is_dir():
        return write_manifest(where, checkpoint_id=checkpoint_id, step=step)
    size, sha256 = where.digest()
    return SavedCheckpoint(checkpoint_id, step, where.uri, size, sha256)


def _local(uri: str | None) -> str | None:
    if uri is None:
        return None
    where = Location.of(uri)
    if not where.is_local:
        return uri  # Lightning reads remote paths through fsspec itself
    path = Path(where.path)
    return str(path.parent if path.name == "gpusched-manifest.json" else path)


class ResumableDataLoader(DataLoader):  # type: ignore[type-arg]
    """A DataLoader Lightning can resume mid-epoch: its state is how many batches of the
    epoch it gave and its generator's state when the epoch began; restored, it replays
    that epoch's order and skips those batches. Its generator is its own (seeded with
    `seed`), so the global RNG a model draws from is not touched by shuffling."""

    def __init__(self, *args: Any, seed: int = 0, **kwargs: Any) -> None:
        kwargs.setdefault("generator", torch.Generator().manual_seed(seed))
        super().__init__(*args, **kwargs)
        self._given = 0
        self._epoch_start: Any = None
        self._restore: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        skip = 0
        if self._restore is not None:
            restore, self._restore = self._restore, None
            self.generator.set_state(restore["generator"])
            skip = int(restore["given"])
        self._epoch_start = self.generator.get_state().clone()
        self._given = skip
        batches = super().__iter__()
        for _ in range(skip):
            next(batches)
        for batch in batches:
            self._given += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return {"given": self._given, "generator": self._epoch_start}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restore = state_dict


__all__ = ["GpuschedCallback", "ResumableDataLoader", "describe_checkpoint"]
