"""A Hugging Face Trainer run that gpusched can preempt and resume exactly.

    python examples/hf_train.py --steps 60 --result final.pt
    python examples/hf_train.py --standalone --steps 60 --result final.pt  # no gpusched

The model is a tiny BERT built from its config (no download). The gpusched lines:
GpuschedTrainerCallback.from_env() in the callbacks and
`resume_from_checkpoint=gpusched.resume_path` in train; the Trainer's own checkpoint
(model, optimizer, scheduler, RNG states, trainer state) does the rest.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from gpusched.sdk.environment import JobEnvironment
from gpusched.sdk.huggingface import GpuschedTrainerCallback

SEED = 1234


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences labelled by the parity of their sum: made here, not fetched."""

    def __init__(self, size: int = 256, length: int = 12) -> None:
        g = torch.Generator().manual_seed(SEED)
        self.ids = torch.randint(1, 64, (size, length), generator=g)
        self.labels = self.ids.sum(dim=1) % 2

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


class Pace(TrainerCallback):  # type: ignore[misc]
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        time.sleep(self.seconds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--result", type=Path)
    parser.add_argument("--standalone", action="store_true", help="run without gpusched")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    config = BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=2,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    callbacks: list[TrainerCallback] = [Pace(args.step_seconds)]
    gpusched = None
    if args.standalone:
        output = Path(tempfile.mkdtemp(prefix="hf-"))
    else:
        gpusched = GpuschedTrainerCallback.from_env()
        callbacks.append(gpusched)
        output = (JobEnvironment.from_environ().checkpoint_dir or Path("checkpoints")) / "hf"
    training = TrainingArguments(
        output_dir=str(output), max_steps=args.steps, per_device_train_batch_size=16,
        learning_rate=1e-3, seed=SEED, report_to="none", use_cpu=True,
        save_strategy="no", logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = Trainer(model=model, args=training, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=None if gpusched is None else gpusched.resume_path)
    if args.result:
        torch.save({"steps": trainer.state.global_step, "params": model.state_dict()}, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
