"""Confirmation latency of a sharded checkpoint, beside plain file I/O of the same bytes.

A gang of 2 ranks (torchrun, gloo on CPU) holds 1 GB, then 10 GB of tensors
(BENCH_CHECKPOINT_GB="1,10"). In the same run, for each size:
- baseline: every rank writes its share with plain file I/O (write + fsync), at once;
- snapshotted: from the start of the gang's save until its `snapshotted` confirmation
  arrives on NATS: torch.distributed.checkpoint writes the shards, each rank hashes its
  files, rank 0 writes the manifest and confirms;
- persisted: until the `persisted` confirmation: every rank also copies its share to a
  second directory (the durable store) and rank 0 confirms the manifest there;
- verify: the checkpoint service's verification of the persisted manifest and every
  file it lists (FsspecStorage, the service's own code, in parallel threads).
Everything written is removed after each size.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from pathlib import Path

import nats
from nats.aio.msg import Msg

from bench.harness import Context, Figure
from gpusched.checkpoint.storage import FsspecStorage
from gpusched.checkpoint.verification import ClaimCheck
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import CheckpointKind, T
from gpusched.contracts.subjects import Subjects
from gpusched.domain.saga import CheckpointRef, Stage
from gpusched.infra import bus

NAME = "checkpoints"
SIZES_GB = [float(s) for s in os.environ.get("BENCH_CHECKPOINT_GB", "1,10").split(",") if s]
WORKER = Path(__file__).resolve().with_name("checkpoint_worker.py")
JOB = "job-bench-ckpt"


async def one_size(gb: float, ctx: Context) -> list[Figure]:
    scratch = ctx.scratch / f"checkpoints-{gb:g}gb"
    subjects = Subjects(f"bench{int(time.time() * 1000) % 10**9}")
    nc = await nats.connect(ctx.nats_url, name="bench-checkpoints")
    arrivals: dict[str, float] = {}

    async def on_event(msg: Msg) -> None:
        envelope = Envelope.from_bytes(msg.data)
        if envelope.type == T.CHECKPOINT_CONFIRMED:
            arrivals.setdefault(envelope.data["stage"], time.time())

    try:
        await bus.ensure_streams(nc.jetstream(), subjects.streams())
        await nc.subscribe(subjects.job_events(JOB), cb=on_event)
        env = {**os.environ, "GPUSCHED_NATS_URL": ctx.nats_url,
               "GPUSCHED_SUBJECT_PREFIX": subjects.prefix, "GPUSCHED_JOB_ID": JOB,
               "GPUSCHED_ATTEMPT": "1", "OMP_NUM_THREADS": "1"}  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            str(WORKER), "--gb", str(gb), "--scratch", str(scratch),
            env=env, stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, _ = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"the checkpoint bench worker failed ({process.returncode})")
        report = json.loads(out.decode().strip().splitlines()[-1])
        await nc.flush()
        for _ in range(100):
            if len(arrivals) == 2:
                break
            await asyncio.sleep(0.1)
        claim = CheckpointRef(report["checkpoint_id"], 1, report["uri"], report["bytes"],
                              report["sha256"], Stage.PERSISTED)  # fmt: skip
        storage = FsspecStorage(budget=None)
        started = time.perf_counter()
        verdict = await storage.verify(claim, CheckpointKind.MANIFEST)
        verify_s = time.perf_counter() - started
        if verdict is None or verdict.check is not ClaimCheck.VERIFIED:
            raise RuntimeError(f"the bench checkpoint did not verify: {verdict}")
    finally:
        await nc.drain()
        shutil.rmtree(scratch, ignore_errors=True)
    plain = report["plain_s"]
    snapshotted = arrivals["snapshotted"] - report["save_started"]
    persisted = arrivals["persisted"] - report["save_started"]
    ctx.progress(
        f"{NAME}: {gb:g} GB over 2 ranks: plain write {plain:.1f}s, snapshotted after "
        f"{snapshotted:.1f}s, persisted after {persisted:.1f}s, verified in {verify_s:.1f}s"
    )
    size = f"{gb:g}gb"
    return [
        Figure(NAME, f"plain_write_{size}", plain, "s"),
        Figure(NAME, f"confirm_snapshotted_{size}", snapshotted, "s", baseline=plain),
        Figure(NAME, f"confirm_persisted_{size}", persisted, "s", baseline=plain),
        Figure(NAME, f"verify_{size}", verify_s, "s", baseline=plain),
    ]


async def run(ctx: Context) -> list[Figure]:
    figures: list[Figure] = []
    for gb in SIZES_GB:
        free = shutil.disk_usage(ctx.scratch).free / 1e9
        if free < 2.5 * gb + 2:
            ctx.progress(f"{NAME}: skipping {gb:g} GB: {free:.0f} GB free, need {2.5 * gb + 2:.0f}")
            continue
        figures += await one_size(gb, ctx)
    return figures
