"""No fault stops the cluster: every process of the stack killed while jobs keep coming.

The whole stack runs as processes, with its own nats-server and PostgreSQL (the shared
test servers must not be the ones killed). A client submits small simulated training
jobs continuously, each with its own idempotency key, and sends a key again when its
submit got no answer. Faults are injected one at a time (SIGKILL of a service, of
nats-server, of the postmaster; in the slow run also servers frozen for a minute), and
after each the suite waits, within a bound, until the killed process is back and a new
submit is placed. Nothing helps the stack recover but its own supervisor.

At the end:
- every acknowledged job exists exactly once, under its key, and the key answers the
  same job id again;
- no GPU was ever in two live allocations (sampled throughout the run);
- every job was placed and finished;
- jobs running when the agent or NATS went away finished rather than failed (they
  resumed in a new attempt, or kept running).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.faults import (
    FINISHED,
    Fault,
    JobRow,
    Load,
    WatchedStack,
    back,
    check_acknowledged,
    gpus_in_two_live_allocations,
    job_rows,
    kill,
    log_tail,
    own_servers_settings,
    pause,
    placed,
    progress,
    within,
)

SERVICES = ("admission", "ingest", "preemption", "checkpoint", "billing", "agent")
# In `make test`: SIGKILL of every process, one at a time, each back within seconds.
KILLS = tuple(Fault(target, "kill") for target in (*SERVICES, "nats", "postgres"))
# `make test-slow`: the same, then both servers unreachable for a minute each.
EVERYTHING = (*KILLS, Fault("nats", "pause", 60.0), Fault("postgres", "pause", 60.0))
# Faults that take running workloads' control plane away: their jobs must not fail.
INTERRUPTING = {"agent", "nats"}


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[WatchedStack]:
    prefix = f"f{uuid.uuid4().hex[:8]}"
    watched = WatchedStack(
        own_servers_settings(tmp_path / "data", prefix), tmp_path / "logs", env={}
    )
    watched.start()
    try:
        yield watched
    finally:
        watched.stop()


@dataclass
class Run:
    """What the suite saw: GPUs found doubly allocated, jobs running at each fault."""

    doubles: dict[str, list[str]] = field(default_factory=dict)
    interrupted: dict[str, dict[str, int]] = field(default_factory=dict)  # fault -> job -> attempt


async def _watch_allocations(watched: WatchedStack, run: Run, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(Exception):  # the database may be the thing that is down
            run.doubles.update(await gpus_in_two_live_allocations(watched.settings))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


async def _inject(watched: WatchedStack, load: Load, fault: Fault, recovery_s: float) -> None:
    stack = watched.stack
    started = time.monotonic()
    if fault.kind == "kill":
        old = kill(stack, fault.target)
        took_back = await back(stack, fault.target, old, recovery_s)
        what = f"back in {took_back:.1f}s"
    else:
        await pause(stack, fault.target, fault.seconds)
        started = time.monotonic()  # recovery counts from the end of the outage
        what = f"unreachable for {fault.seconds:.0f}s"
    key = f"probe-{uuid.uuid4().hex[:12]}"
    job_id = await load.submit_until_acked(key, recovery_s)
    try:
        await within(
            f"after {fault.name}, job {job_id} placed", lambda: placed(load, job_id), recovery_s
        )
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}\n--- admission log ---\n{log_tail(stack, 'admission')}"
        ) from None
    progress(
        f"{fault.name}: {what}; the next submit placed {time.monotonic() - started:.1f}s after"
    )


def _counts(rows: Sequence[JobRow]) -> str:
    return ", ".join(f"{s}: {n}" for s, n in sorted(Counter(r.state for r in rows).items()))


async def _run_suite(
    watched: WatchedStack,
    faults: Sequence[Fault],
    *,
    rate: float,
    long_steps: int,
    gap_s: float,
    recovery_s: float,
    settle_s: float,
) -> None:
    settings = watched.settings
    assert settings.nats_url
    run = Run()
    async with Load(
        settings.nats_url,
        settings.subject_prefix,
        rate=rate,
        long_steps=long_steps,
        credentials=settings.nats_credentials,
    ) as load:
        warmup = await load.submit_until_acked("warmup", 60)
        await within("the first job placed", lambda: placed(load, warmup), 60)
        progress(f"stack up at {settings.nats_url}; submitting {rate:g} jobs/s")
        stop = asyncio.Event()
        tasks = [
            asyncio.create_task(load.run(stop), name="load"),
            asyncio.create_task(_watch_allocations(watched, run, stop), name="allocations"),
        ]
        try:
            await asyncio.sleep(gap_s)
            for fault in faults:
                rows = await job_rows(settings, load.team)
                running = {r.job_id: r.attempt for r in rows if r.state == "running"}
                if fault.target in INTERRUPTING:
                    run.interrupted[fault.name] = running
                progress(f"{fault.name}: injecting ({len(running)} jobs running, {_counts(rows)})")
                await _inject(watched, load, fault, recovery_s)
                await asyncio.sleep(gap_s)
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
        progress(f"load stopped: {len(load.acked)} jobs acknowledged ({load.summary()})")
        await load.flush(recovery_s)

        async def all_finished() -> bool:
            return all(r.state in FINISHED for r in await job_rows(settings, load.team))

        try:
            took = await within("every job finished", all_finished, settle_s)
            rows = await job_rows(settings, load.team)
        except AssertionError as exc:
            rows = await job_rows(settings, load.team)
            stuck = [
                f"{r.job_id} {r.state} (attempt {r.attempt})"
                for r in rows
                if r.state not in FINISHED
            ]
            states = f"{_counts(rows)}; unfinished, e.g.: {stuck[:5]}"
            tails = "\n".join(
                f"--- {s} ---\n{log_tail(watched.stack, s)}" for s in ("admission", "agent")
            )
            raise AssertionError(f"{exc}: {states}\n{tails}") from None
        progress(f"every job finished {took:.1f}s after the load stopped ({_counts(rows)})")

        await load.resubmit_all()
        rows = await job_rows(settings, load.team)
        problems = check_acknowledged(load, rows)
        assert not problems, "\n".join(problems[:20])
        assert not load.refused, load.refused[:5]
        assert not run.doubles, f"GPUs in two live allocations: {run.doubles}"
        by_id = {r.job_id: r for r in rows}
        failed = [r.job_id for r in rows if r.state == "failed"]
        for name, jobs in run.interrupted.items():
            ended = {job: by_id[job] for job in jobs if job in by_id}
            lost = [job for job, row in ended.items() if row.state != "completed"]
            assert not lost, f"jobs running at {name} did not finish: {lost}"
            again = sum(1 for job, row in ended.items() if row.attempt > jobs[job])
            from_checkpoint = sum(
                1 for job, row in ended.items() if row.attempt > jobs[job] and row.resume_from
            )
            progress(
                f"{name}: {len(ended)} running jobs all finished; {again} in a new attempt "
                f"({from_checkpoint} from a checkpoint), {len(ended) - again} kept running"
            )
            if again:
                # Work saved before the fault is not thrown away: some of the jobs that
                # had to start again (long ones save every 20 steps) resumed from it.
                assert from_checkpoint, f"{name}: no interrupted job resumed from a checkpoint"
        assert not failed, f"{len(failed)} jobs failed: {failed[:10]}"
        progress(f"{len(rows)} jobs, {len(load.acked)} acknowledged: none lost, none doubled")


@pytest.mark.timeout(300)
async def test_killing_every_process_in_turn_loses_no_acknowledged_job_and_fails_no_running_one(
    stack: WatchedStack,
) -> None:
    await _run_suite(
        stack, KILLS, rate=2.0, long_steps=300, gap_s=3.0, recovery_s=60.0, settle_s=90.0
    )


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_every_process_killed_and_both_servers_away_a_minute_lose_nothing(
    stack: WatchedStack,
) -> None:
    await _run_suite(
        stack, EVERYTHING, rate=3.0, long_steps=600, gap_s=10.0, recovery_s=120.0, settle_s=240.0
    )
