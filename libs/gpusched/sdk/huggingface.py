"""Hugging Face Trainer: answer gpusched's checkpoint requests with the Trainer's own save.

    from gpusched.sdk.huggingface import GpuschedTrainerCallback

    gpusched = GpuschedTrainerCallback.from_env()    # rank 0 connects; the others listen
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[gpusched])
    trainer.train(resume_from_checkpoint=gpusched.resume_path)   # None on a first attempt

At the end of every step the callback asks (rank 0, broadcast to every process when
torch.distributed runs) whether the control plane wants a checkpoint; if so it sets
`control.should_save`, the Trainer writes its usual `checkpoint-<step>` directory (model,
optimizer, scheduler, every process's RNG state, trainer state), and rank 0 confirms it
by its manifest. `resume_from_checkpoint` restores all of it and skips the batches
already seen, so a resumed run ends with the parameters of one never interrupted.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from gpusched.sdk.control import CheckpointRequest
from gpusched.sdk.environment import JobEnvironment
from gpusched.sdk.manifest import write_manifest
from gpusched.sdk.storage import Location
from gpusched.sdk.sync import JobClient

try:
    import torch.distributed as dist
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "gpusched.sdk.huggingface needs transformers: pip install 'gpusched[huggingface]'"
    ) from exc


class GpuschedTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """See the module docstring. `job` is the job's client on rank 0 (None elsewhere)."""

    def __init__(
        self,
        job: JobClient | None,
        *,
        resume_path: str | None = None,
        resumed_from: str | None = None,
        progress_every: int = 10,
    ) -> None:
        self.job = job
        self.resume_path = resume_path
        self._resumed_from = resumed_from
        self._progress_every = progress_every
        self._request: CheckpointRequest | None = None

    @classmethod
    def from_env(cls) -> GpuschedTrainerCallback:
        env = JobEnvironment.from_environ()
        job = JobClient.from_env() if int(os.environ.get("RANK", "0")) == 0 else None
        if job is not None:
            job.start()
        return cls(
            job, resume_path=_directory(env.resume_uri), resumed_from=env.resume_checkpoint_id
        )

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.job is not None:
            self.job.started(resumed_from=self._resumed_from)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.job is not None and state.global_step % self._progress_every == 0:
            self.job.progress(state.global_step)
        request = self.job.checkpoint_requested if self.job is not None else None
        if dist.is_available() and dist.is_initialized():
            box = [request]
            dist.broadcast_object_list(box, src=0)
            request = box[0]
        if request is not None:
            self._request = request
            if self.job is not None:
                self.job.take(request)
            control.should_save = True

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        request, self._request = self._request, None
        if request is None:
            return  # a save the Trainer's own strategy asked for
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every process's files (its RNG state) are written
        if self.job is None:
            return
        step = state.global_step
        directory = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}"
        checkpoint_id = f"{Path(args.output_dir).name}-{PREFIX_CHECKPOINT_DIR}-{step}"
        self.job.checkpoint(
            request,
            lambda: write_manifest(Location.of(directory), checkpoint_id=checkpoint_id, step=step),
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.job is not None:
            self.job.completed(state.global_step)
            self.job.close()


def _directory(uri: str | None) -> str | None:
    """The checkpoint directory a resume URI's manifest names (what the Trainer loads)."""
    if uri is None:
        return None
    where = Location.of(uri).parent()
    return where.path if where.is_local else where.uri


__all__ = ["GpuschedTrainerCallback"]
