"""A plain synchronous training loop that gpusched can preempt safely (no torch needed).

The cluster agent launches it with GPUSCHED_* variables set. It resumes from
GPUSCHED_RESUME_URI if there is one, reports progress, and when the control plane asks
for a checkpoint it finishes the current step, saves, and confirms; eviction then
stops it with SIGTERM. With PyTorch, `write` would be `torch.save(state, f)`.

    python examples/train_loop.py --steps 500 --step-seconds 0.1
"""

from __future__ import annotations

import argparse
import json
import math
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from types import FrameType
from typing import BinaryIO

from gpusched.sdk import (
    CheckpointError,
    JobClient,
    PreemptionCancelled,
    checkpoint_path,
    save_file_checkpoint,
)


class Model:
    """Stands in for a network: one weight fitted by gradient descent towards 3.0."""

    def __init__(self, step: int = 0, weight: float = 0.0) -> None:
        self.step = step
        self.weight = weight

    def train_step(self, lr: float = 0.01) -> float:
        gradient = 2 * (self.weight - 3.0)
        self.weight -= lr * gradient
        self.step += 1
        return (self.weight - 3.0) ** 2

    def write(self, f: BinaryIO) -> None:
        f.write(json.dumps({"step": self.step, "weight": self.weight}).encode())

    @classmethod
    def load(cls, path: Path) -> Model:
        state = json.loads(path.read_text())
        return cls(int(state["step"]), float(state["weight"]))


def _stop_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # Unwinds through `with JobClient(...)`, which closes the connection cleanly.
    sys.exit(128 + signum)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--step-seconds", type=float, default=0.1)
    parser.add_argument("--progress-every", type=int, default=10)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    with JobClient.from_env() as job:
        model = Model.load(checkpoint_path(job.resume_uri)) if job.resume_uri else Model()
        ckpt_dir = job.checkpoint_dir or Path(tempfile.mkdtemp(prefix="train-loop-"))
        job.started(resumed_from=job.resume_checkpoint_id)
        print(f"job {job.job_id} attempt {job.attempt} from step {model.step}", flush=True)

        connected = job.connection_state.connected
        while model.step < args.steps:
            loss = model.train_step()
            if model.step % args.progress_every == 0:
                # Never blocks for long or fails when the control plane is away: the
                # SDK buffers events and delivers them once it is back.
                job.progress(model.step, loss=round(loss, 6), weight=round(model.weight, 6))
                if (state := job.connection_state).connected != connected:
                    connected = state.connected
                    print(f"control plane: {state} (step {model.step})", flush=True)
            # Between steps, never in the middle of one: the state is consistent here.
            if (request := job.checkpoint_requested) is not None:
                path = ckpt_dir / f"ckpt-{model.step}.json"
                try:
                    save = partial(save_file_checkpoint, path, model.write, step=model.step)
                    saved = job.checkpoint(request, save)
                    print(f"checkpoint {saved.checkpoint_id} at step {saved.step}", flush=True)
                except CheckpointError as exc:
                    print(f"checkpoint failed, training on: {exc}", flush=True)
            while (message := job.poll_control()) is not None:
                if isinstance(message, PreemptionCancelled):
                    print(f"preemption {message.request_id} cancelled", flush=True)
            time.sleep(args.step_seconds)

        job.completed(model.step)
        print(f"done at step {model.step}, loss {math.fabs(model.weight - 3.0):.6f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
