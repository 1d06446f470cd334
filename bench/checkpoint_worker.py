"""One rank of the checkpoint bench, run by torchrun (see bench_checkpoints.py).

Each rank holds `gb / world` GB of tensors. First the baseline: every rank writes the
same bytes with plain file I/O (write + fsync, one file per rank, at the same time).
Then a periodic gang save of the same state with torch.distributed.checkpoint through
gpusched.sdk.distributed, with a persist step to a second directory: rank 0's client
publishes the snapshotted and persisted confirmations, whose arrival the bench times.
Prints one JSON line (rank 0): the wall-clock start of the save and the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from gpusched.sdk.distributed import Gang

TENSOR_BYTES = 256 << 20


class Blob:
    """A rank's share of the state: large float tensors, as DCP saves them."""

    def __init__(self, rank: int, nbytes: int) -> None:
        count = max(1, nbytes // TENSOR_BYTES)
        self.tensors = {
            f"rank{rank}.t{i}": torch.full((TENSOR_BYTES // 4,), float(rank * 1000 + i))
            for i in range(count)
        }

    def to_save(self, rank: int, step: int) -> dict[str, Any]:
        return {**self.tensors, "step": step}


def plain_write(blob: Blob, path: Path) -> float:
    started = time.perf_counter()
    with path.open("wb") as f:
        for tensor in blob.tensors.values():
            f.write(tensor.numpy().data.cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, required=True)
    parser.add_argument("--scratch", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    blob = Blob(rank, int(args.gb * 1e9 / world))
    baseline_dir = args.scratch / "plain"
    baseline_dir.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    started = time.perf_counter()
    plain_write(blob, baseline_dir / f"rank-{rank}.bin")
    dist.barrier()
    plain_s = time.perf_counter() - started
    if rank == 0:
        shutil.rmtree(baseline_dir)  # the disk holds one copy at a time
    dist.barrier()
    with Gang.from_env(args.scratch / "local", persist_to=str(args.scratch / "durable")) as gang:
        save_started = time.time()
        saved = gang.save(None, blob, step=1)  # type: ignore[arg-type]
        if rank == 0:
            print(json.dumps({"save_started": save_started, "plain_s": plain_s,
                              "uri": saved.uri, "bytes": saved.bytes, "sha256": saved.sha256,
                              "checkpoint_id": saved.checkpoint_id}), flush=True)  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
