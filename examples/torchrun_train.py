"""A sharded (FSDP2) model trained by a torchrun gang that gpusched can preempt and resume.

    python -m torch.distributed.run --nproc-per-node 2 examples/torchrun_train.py \\
        --steps 200 --result final.pt

Every rank runs this file; rank 0 talks to the control plane (gpusched.sdk.distributed).
Between steps every rank calls `gang.answer`: when the control plane asks for a
checkpoint, all ranks save their shards with torch.distributed.checkpoint, rank 0
writes the manifest and confirms once. A resumed gang loads every rank's shards, its
optimizer state and its random number generators, so it ends with the very parameters
of a run that was never interrupted. gloo on CPU here; on GPUs use
`init_process_group("cpu:gloo,cuda:nccl")` and move the model to the rank's GPU.

    --standalone          no gpusched: the uninterrupted reference run
    --checkpoints URI     where the shards go (default: the job's checkpoint directory;
                          s3://bucket/prefix with gpusched[s3] and AWS_* set)
    --persist-to URI      copy each checkpoint there too (snapshotted -> persisted)
    --async-save          write the shards in the background (torch's async_save)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from gpusched.sdk import CheckpointError
from gpusched.sdk.distributed import Gang, ShardedState

SEED = 1234


def build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(SEED)  # the same initial weights on every rank before sharding
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 1))
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    x = torch.randn(32, 8)  # this rank's batch, from its own (checkpointed) RNG
    y = torch.sin(x.sum(dim=1, keepdim=True))
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


def write_result(path: Path, model: nn.Module, steps: int) -> None:
    # full_tensor() is a collective: every rank calls it; rank 0 writes.
    params = {name: p.full_tensor() for name, p in model.state_dict().items()}
    if dist.get_rank() == 0:
        torch.save({"steps": steps, "params": params}, path)


def _stop(signum: int, frame: FrameType | None) -> None:
    sys.exit(128 + signum)  # unwinds through `with Gang`, which closes the client


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-seconds", type=float, default=0.05)
    parser.add_argument("--progress-every", type=int, default=10)
    parser.add_argument("--result", type=Path)
    parser.add_argument("--standalone", action="store_true")
    parser.add_argument("--checkpoints")
    parser.add_argument("--persist-to")
    parser.add_argument("--async-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, optimizer = build()
    torch.manual_seed(SEED + 1 + rank)  # each rank its own data stream
    try:
        if args.standalone:
            for _ in range(args.steps):
                train_step(model, optimizer)
            if args.result:
                write_result(args.result, model, args.steps)
            # Every rank past the last collective (and rank 0's save) before the group
            # goes: a rank that tore down gloo while another still used it could abort.
            dist.barrier()
            return 0
        signal.signal(signal.SIGTERM, _stop)
        with Gang.from_env(args.checkpoints, persist_to=args.persist_to) as gang:
            state = ShardedState(model, optimizer)
            step = gang.resume(state)
            gang.started()
            print(f"rank {rank}: from step {step}", flush=True)
            while step < args.steps:
                loss = train_step(model, optimizer)
                step += 1
                if step % args.progress_every == 0:
                    gang.progress(step, loss=float(loss))
                try:
                    if (request := gang.requested()) is not None:
                        if args.async_save:
                            gang.save_async(request, state, step)
                        else:
                            saved = gang.save(request, state, step)
                            print(f"rank {rank}: checkpoint {saved.uri}", flush=True)
                except CheckpointError as exc:
                    print(f"rank {rank}: checkpoint failed, training on: {exc}", flush=True)
                time.sleep(args.step_seconds)
            gang.wait()
            if args.result:
                write_result(args.result, model, args.steps)
            gang.completed(args.steps)
            dist.barrier()
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the interpreter's teardown destroys torch's and gloo's C++ objects,
    # and a background thread still joinable then aborts the rank ("terminate called
    # without an active exception", seen under a loaded machine), which torchrun reports
    # as the gang's failure although every rank finished its work.
    os._exit(code)
