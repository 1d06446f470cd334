"""A small PyTorch model that gpusched can preempt and resume exactly.

The cluster agent launches it with GPUSCHED_* variables set (a `process` workload);
the gpusched lines are the JobClient block, TorchCheckpointer's resume and answer,
and job.progress / job.completed. With fixed seeds, a run that is checkpointed,
evicted and resumed ends with the very same parameters and loss as one that never
stopped: the checkpoint holds the model, the optimizer, the step and the RNG states.

    python examples/torch_train.py --steps 300 --result final.pt
    python examples/torch_train.py --standalone --steps 300 --result final.pt  # no gpusched
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import torch
from torch import nn

from gpusched.sdk import CheckpointError, JobClient
from gpusched.sdk.torch import TorchCheckpointer

SEED = 1234


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)
    # Dropout draws from the RNG every step: a resume that lost the RNG state would
    # diverge from the uninterrupted run at once.
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    x = torch.randn(64, 8)  # a fresh batch from the (checkpointed) RNG
    y = torch.sin(x.sum(dim=1, keepdim=True))
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    start: int,
    steps: int,
    between_steps: Callable[[int, torch.Tensor], None],
    loss: torch.Tensor | None = None,
) -> torch.Tensor:
    loss = torch.tensor(float("nan")) if loss is None else loss
    for step in range(start + 1, steps + 1):
        loss = train_step(model, optimizer)
        between_steps(step, loss)
    return loss


def write_result(path: Path, model: nn.Module, loss: torch.Tensor, steps: int) -> None:
    torch.save({"steps": steps, "loss": loss, "params": model.state_dict()}, path)


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwinds through `with JobClient(...)`, which closes the connection cleanly.
    sys.exit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--progress-every", type=int, default=10)
    parser.add_argument("--result", type=Path, help="where to torch.save the final state")
    parser.add_argument("--standalone", action="store_true", help="run without gpusched")
    args = parser.parse_args()
    # One thread: the same arithmetic in the same order on every run and every attempt.
    torch.set_num_threads(1)
    model, optimizer = build()

    if args.standalone:
        loss = train(model, optimizer, 0, args.steps, lambda step, loss: None)
        if args.result:
            write_result(args.result, model, loss, args.steps)
        return 0

    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    with JobClient.from_env() as job:
        ckpt = TorchCheckpointer(model, optimizer, job.checkpoint_dir)
        start = ckpt.resume(job)
        job.started(resumed_from=job.resume_checkpoint_id)
        print(f"job {job.job_id} attempt {job.attempt} from step {start}", flush=True)

        def between_steps(step: int, loss: torch.Tensor) -> None:
            if step % args.progress_every == 0:
                job.progress(step, loss=float(loss))
            ckpt.extra["loss"] = loss  # so a resume at the last step still knows it
            try:
                if (saved := ckpt.answer(job, step)) is not None:
                    print(f"checkpoint {saved.checkpoint_id} at step {step}", flush=True)
            except CheckpointError as exc:
                print(f"checkpoint failed, training on: {exc}", flush=True)
            time.sleep(args.step_seconds)

        loss = train(model, optimizer, start, args.steps, between_steps, ckpt.extra.get("loss"))
        if args.result:
            write_result(args.result, model, loss, args.steps)
        job.completed(args.steps)
        print(f"done at step {args.steps}, loss {float(loss):.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
