"""The event the outbox bench sends, and the producer of its latency phase.

The producer runs as its own process (`python -m bench.outbox_workload ...`), as an
application would, so its work does not share an event loop with the relay being
measured. It sends at a steady rate and writes, per event, the envelope id and the
moment the event became deliverable: right after the commit (relay mode) or right
before the publish (raw mode). time.monotonic() is one clock for every process on Linux.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    AllocationGranted,
    GpuRef,
    JobKind,
    PriorityClassName,
    T,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.db import UnitOfWorkFactory, create_engine

SOURCE = "bench"
SCHEMA = "bench"
EVENT_TYPE = T.ALLOCATION_GRANTED


def sample_event(n: int = 0) -> AllocationGranted:
    """A typical domain event: an 8-GPU allocation (about 1.3 kB as an envelope)."""
    return AllocationGranted(
        allocation_id=f"alloc-{n:08d}",
        job_id=f"job-{n:08d}",
        team="vision",
        kind=JobKind.TRAINING,
        priority_class=PriorityClassName.P1_NORMAL,
        pool="shared",
        gpus=[GpuRef(node="shared-03", index=i, model="A100-80GB") for i in range(8)],
        granted_at=datetime(2026, 3, 2, 9, 0, tzinfo=UTC),
        attempt=1,
        checkpointable=True,
    )


def sample_envelope(n: int = 0) -> Envelope:
    return make_envelope(EVENT_TYPE, sample_event(n), source=SOURCE)


async def produce(args: argparse.Namespace) -> tuple[list[tuple[str, float]], float]:
    subject = Subjects(args.prefix).event(SOURCE, EVENT_TYPE)
    transactions = int(args.rate * args.seconds / args.tx)
    interval = args.tx / args.rate
    stamps: list[tuple[str, float]] = []
    event = sample_event()
    if args.mode == "relay":
        engine = create_engine(args.database_url)
        uows = UnitOfWorkFactory(engine, SCHEMA, SOURCE, Subjects(args.prefix))
        async with uows() as uow:  # warm the pool before the clock starts
            await uow.commit()
    else:
        nc = await bus.connect(args.nats_url, "bench-producer")
        js = nc.jetstream()
        await (await js.publish_async(subject + ".warmup", b"", headers={"Nats-Msg-Id": "w"}))
    started = time.monotonic()
    for i in range(transactions):
        delay = started + i * interval - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if args.mode == "relay":
            async with uows() as uow:
                for _ in range(args.tx):
                    await uow.emit(subject, EVENT_TYPE, event)
                await uow.commit()
            now = time.monotonic()
            stamps.extend((e.id, now) for e in uow.emitted)
        else:
            envelopes = [make_envelope(EVENT_TYPE, event, source=SOURCE) for _ in range(args.tx)]
            now = time.monotonic()
            futures = [
                await js.publish_async(subject, e.to_bytes(), headers={"Nats-Msg-Id": e.id})
                for e in envelopes
            ]
            stamps.extend((e.id, now) for e in envelopes)
            await asyncio.gather(*futures)
    elapsed = time.monotonic() - started
    if args.mode == "relay":
        await engine.dispose()
    else:
        await nc.drain()
    return stamps, elapsed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["relay", "raw"], required=True)
    parser.add_argument("--nats-url")
    parser.add_argument("--database-url")
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--rate", type=float, required=True, help="events per second")
    parser.add_argument("--tx", type=int, required=True, help="events per transaction")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    stamps, elapsed = asyncio.run(produce(args))
    Path(args.out).write_text("".join(f"{i} {t!r}\n" for i, t in stamps))
    summary = {"events": len(stamps), "seconds": elapsed, "rate": len(stamps) / elapsed}
    json.dump(summary, sys.stdout)


if __name__ == "__main__":
    main()
