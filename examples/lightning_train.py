"""A PyTorch Lightning model that gpusched can preempt and resume exactly.

    python examples/lightning_train.py --steps 120 --result final.pt
    python examples/lightning_train.py --standalone --steps 120 --result final.pt  # no gpusched

The gpusched lines: GpuschedCallback.from_env() in the callbacks, ResumableDataLoader
for the data, and `ckpt_path=gpusched.resume_path` in fit. Lightning's own checkpoint
does the rest (the callback adds every RNG state and the position in the epoch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import TensorDataset

from gpusched.sdk.lightning import GpuschedCallback, ResumableDataLoader

SEED = 1234


class Regressor(pl.LightningModule):
    def __init__(self, step_seconds: float) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.step_seconds = step_seconds

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], index: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_seconds)
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(512, 8, generator=g)
    return TensorDataset(x, torch.sin(x.sum(dim=1, keepdim=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    parser.add_argument("--result", type=Path)
    parser.add_argument("--standalone", action="store_true", help="run without gpusched")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = Regressor(args.step_seconds)
    gpusched = None if args.standalone else GpuschedCallback.from_env()
    trainer = pl.Trainer(
        max_steps=args.steps,
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[] if gpusched is None else [gpusched],
    )
    loader = ResumableDataLoader(data(), batch_size=32, shuffle=True, seed=SEED)
    trainer.fit(model, loader, ckpt_path=None if gpusched is None else gpusched.resume_path)
    if args.result:
        torch.save({"steps": trainer.global_step, "params": model.state_dict()}, args.result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
