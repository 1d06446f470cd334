"""PyTorch helpers: checkpoint and resume a training loop in a few lines.

    from gpusched.sdk import JobClient
    from gpusched.sdk.torch import TorchCheckpointer

    with JobClient.from_env() as job:
        ckpt = TorchCheckpointer(model, optimizer, job.checkpoint_dir)
        step = ckpt.resume(job)                     # 0, or the step the job stopped at
        job.started(resumed_from=job.resume_checkpoint_id)
        while step < steps:
            train_step(); step += 1
            ckpt.answer(job, step)                  # saves + confirms if the plane asked
        job.completed(step)

A checkpoint is one file written with torch.save (through save_file_checkpoint, so it
is atomic, fsynced and described by size and sha256) holding the model, the optimizer,
the step and every random number generator the loop may draw from (torch CPU and CUDA,
numpy if installed, Python's `random`): a resumed run draws the same dropout masks and
batches as an uninterrupted one, so it reaches the very same parameters.

torch is imported when a helper runs, not when this module is imported, so the SDK
works without torch installed. torch.distributed.checkpoint (sharded saves across
ranks) is not wrapped here: its checkpoint is a directory, and the contract's
bytes/sha256 describe one object.
"""

from __future__ import annotations

import importlib
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Final

from gpusched.sdk.checkpoints import SavedCheckpoint, checkpoint_path, save_file_checkpoint
from gpusched.sdk.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from gpusched.sdk.sync import JobClient

FORMAT: Final = "gpusched.torch/1"


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise CheckpointError(
            "gpusched.sdk.torch needs PyTorch: pip install 'gpusched[torch]'"
        ) from exc


def _numpy_random() -> Any | None:
    try:
        return importlib.import_module("numpy").random
    except ImportError:
        return None


def rng_state() -> dict[str, Any]:
    """Every generator a training loop may draw from, as torch.save can store it."""
    torch_ = _torch()
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch_.get_rng_state()}
    if torch_.cuda.is_available():
        state["cuda"] = torch_.cuda.get_rng_state_all()
    if (np_random := _numpy_random()) is not None:
        state["numpy"] = np_random.get_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch_ = _torch()
    random.setstate(state["python"])
    torch_.set_rng_state(state["torch"])
    if "cuda" in state and torch_.cuda.is_available():
        torch_.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state and (np_random := _numpy_random()) is not None:
        np_random.set_state(state["numpy"])


def training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    step: int,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": None if optimizer is None else optimizer.state_dict(),
        "rng": rng_state(),
        "extra": extra or {},
    }


def save_training_checkpoint(
    path: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    step: int,
    checkpoint_id: str | None = None,
    extra: dict[str, Any] | None = None,
) -> SavedCheckpoint:
    """torch.save the full training state to `path` (atomically); describe the file."""
    state = training_state(model, optimizer, step, extra)

    def write(f: BinaryIO) -> None:
        _torch().save(state, f)

    return save_file_checkpoint(path, write, step=step, checkpoint_id=checkpoint_id)


def load_training_checkpoint(
    path_or_uri: str | os.PathLike[str],
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    map_location: str = "cpu",
) -> tuple[int, dict[str, Any]]:
    """Restore model, optimizer and RNG states; returns (step, extra)."""
    text = os.fspath(path_or_uri)
    path = checkpoint_path(text) if text.startswith("file:") else Path(text)
    # weights_only=False: the RNG states are plain Python and numpy objects, which the
    # safe unpickler refuses. The file is this job's own checkpoint, named by the
    # control plane after it verified its sha256.
    state = _torch().load(path, map_location=map_location, weights_only=False)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a gpusched PyTorch checkpoint")
    model.load_state_dict(state["model"])
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    return int(state["step"]), dict(state["extra"])


@dataclass
class TorchCheckpointer:
    """Binds a model and optimizer to a checkpoint directory and a job client."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    directory: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def path_for(self, step: int) -> Path:
        directory = self.directory or Path.cwd() / "checkpoints"
        return directory / f"step-{step:09d}.pt"

    def save(self, step: int) -> SavedCheckpoint:
        return save_training_checkpoint(
            self.path_for(step), self.model, self.optimizer, step=step, extra=self.extra
        )

    def restore(self, path_or_uri: str | os.PathLike[str]) -> int:
        step, extra = load_training_checkpoint(path_or_uri, self.model, self.optimizer)
        self.extra = extra
        return step

    def resume(self, job: JobClient) -> int:
        """The step to start from: the one of the checkpoint the agent resumes this
        attempt from (GPUSCHED_RESUME_URI), else 0."""
        return 0 if job.resume_uri is None else self.restore(job.resume_uri)

    def answer(self, job: JobClient, step: int) -> SavedCheckpoint | None:
        """Call between steps: if the control plane asked for a checkpoint, save this
        step and confirm it (snapshotted, then persisted); else do nothing."""
        request = job.checkpoint_requested
        if request is None:
            return None
        return job.checkpoint(request, lambda: self.save(step))
