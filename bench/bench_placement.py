"""Placement on the Alibaba openb cluster: decision speed, and end to end.

The inventory is the openb node list (1,213 GPU nodes, 6,212 GPUs), read from
``Settings().traces_dir`` (``bench/openb.py``); how well placement packs is measured by
``bench_fgd.py`` (the FGD paper's method). Workloads: openb_pod_list_default,
multigpu50, and two variants of default (``bench/openb.py``): gpuspec33 (a third of
the GPU pods require one of a set of GPU models) and cpu20 (CPU-only pods asking 20 %
of the cluster's CPU). Every pod is one PlacementRequest with its CPU, memory, model
spec, ``may_span_nodes=False`` (a pod runs on one node), a fraction of one GPU as a
share of it (its memory cap its share of the GPU's memory), a CPU-only pod as a job of
host CPU and memory alone.

(a) decision speed: ``Ledger.place`` + ``Ledger.allocate`` per pod, with churn: before
each pod the oldest allocations are released until the pod would take the cluster at
most to 90 % of its GPUs, so decisions run on a busy, fragmented cluster. Reported: all
decisions per second, p50/p99 of one decision for 1-GPU pods and for 8-GPU gangs.
Baseline, in the same run: the ledger with the ``first_fit`` strategy for whole GPUs and
``FirstFitShare`` (the FGD paper's first fit for a fraction) for fractions.
(b) end to end: jobs submitted to a running admission service (see ``end_to_end``).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bench import openb
from bench.harness import Context, Figure, percentile
from bench.openb import Pod
from gpusched.admission import app as admission_app
from gpusched.contracts.messages import T
from gpusched.contracts.subjects import Subjects
from gpusched.domain.inventory import Inventory, parse_openb_node_csv
from gpusched.domain.ledger import (
    GpuSlot,
    GpuStatus,
    JobKind,
    Ledger,
    Placement,
    PlacementRequest,
    PlacementStrategy,
    PriorityClass,
    first_fit,
)
from gpusched.domain.sharing import SharedGpu
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

NAME = "placement"
BUSY = float(os.environ.get("BENCH_PLACEMENT_BUSY", "0.90"))
DECISIONS = int(os.environ.get("BENCH_PLACEMENT_DECISIONS", "8000"))
TYPICAL_GANG = 8  # the most frequent multi-GPU size in the pod lists
WHOLE_GPU_MILLI = 1000
VARIANT_SEED = 2023
# first_fit walks every GPU per decision: its speed is sampled on fewer.
BASELINE_DECISIONS = min(DECISIONS, 1500)
T0 = datetime(2023, 1, 1, tzinfo=UTC)
E2E_JOBS = int(os.environ.get("BENCH_PLACEMENT_E2E_JOBS", "2000"))
E2E_CONCURRENCY = 64
E2E_GOAL = 300.0
# "e2e" runs only the end-to-end part (about a minute instead of several).
PARTS = os.environ.get("BENCH_PLACEMENT_PARTS", "all")

R = TypeVar("R")


def read_inventory() -> Inventory:
    with (openb.trace_dir() / openb.NODE_LIST).open(encoding="utf-8") as lines:
        return parse_openb_node_csv(lines)


def workloads() -> dict[str, tuple[Pod, ...]]:
    nodes = openb.read_nodes()
    default = openb.read_pods("openb_pod_list_default")
    return {
        "default": default,
        "multigpu50": openb.read_pods("openb_pod_list_multigpu50"),
        "gpuspec33": openb.constrained(default, nodes, 0.33, VARIANT_SEED),
        "cpu20": openb.cpu_only_added(default, nodes, 0.20, VARIANT_SEED),
    }


# --- (a) decision speed -----------------------------------------------------------


@dataclass(frozen=True)
class Speed:
    per_s: float
    # CPU time of this process per decision: steadier than the rate on a shared machine.
    cpu_us: float
    p50_one_ms: float
    p99_one_ms: float
    p50_gang_ms: float
    p99_gang_ms: float
    placed: int


def decide_with_churn(
    inventory: Inventory,
    pods: tuple[Pod, ...],
    strategy: PlacementStrategy | None,
    decisions: int,
) -> Speed:
    """``strategy`` None: gpusched; else that strategy for whole GPUs and
    ``FirstFitShare`` for fractions (the baseline)."""
    ledger = Ledger.from_inventory(inventory)
    baseline = FirstFitShare(ledger)
    capacity = inventory.total_gpus * WHOLE_GPU_MILLI
    live: deque[tuple[str, int]] = deque()
    used = 0
    one: list[float] = []
    gang: list[float] = []
    spent = cpu = 0.0
    decided = placed = 0
    clock, cpu_clock = time.perf_counter, time.process_time
    for number, pod in _cycle(pods, decisions):
        while live and used + pod.gpu_milli > BUSY * capacity:
            allocation_id, milli = live.popleft()
            ledger.release(allocation_id, T0)
            used -= milli
        allocation_id = f"a-{number}"
        request = pod.request(f"j-{number}")
        start, cpu_start = clock(), cpu_clock()
        if strategy is not None and request.share is not None:
            placement = baseline.place(request)
        else:
            placement = ledger.place(request, strategy)
        if placement is not None:
            ledger.allocate(allocation_id, placement, "openb", PriorityClass.P1_NORMAL, T0)
        elapsed = clock() - start
        cpu += cpu_clock() - cpu_start
        spent += elapsed
        decided += 1
        if placement is not None:
            placed += 1
            live.append((allocation_id, pod.gpu_milli))
            used += pod.gpu_milli
        if pod.gpus == 1:
            one.append(elapsed * 1000)
        elif pod.gpus == TYPICAL_GANG:
            gang.append(elapsed * 1000)
    return Speed(
        per_s=decided / spent,
        cpu_us=cpu / decided * 1e6,
        p50_one_ms=percentile(one, 50),
        p99_one_ms=percentile(one, 99),
        p50_gang_ms=percentile(gang, 50),
        p99_gang_ms=percentile(gang, 99),
        placed=placed,
    )


def _cycle(pods: tuple[Pod, ...], count: int) -> Iterator[tuple[int, Pod]]:
    """``count`` pods of the list in a seeded random order, round after round: the
    lists share their first pods (multigpu50 is default's 8,152 and 909 more), so the
    list order would time the same pods for every workload."""
    order = random.Random(VARIANT_SEED).sample(pods, len(pods))
    for number in range(count):
        yield number, order[number % len(order)]


class FirstFitShare:
    """The FGD paper's first-fit baseline for a fraction: the first node (name order)
    whose host has the pod's CPU and memory left, its first GPU (index order), shared
    or free, with the fraction's compute and memory left, of a model the pod accepts."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger
        by_node: dict[str, list[GpuSlot]] = {}
        for slot in ledger.gpus:
            by_node.setdefault(slot.ref.node, []).append(slot)
        self.nodes = list(by_node.items())

    def place(self, request: PlacementRequest) -> Placement | None:
        ask = request.share
        assert ask is not None and ask.milli is not None  # only fractions come here
        ledger = self.ledger
        training = request.kind is JobKind.TRAINING
        for node, slots in self.nodes:
            room = ledger.host_room(node)
            if room is not None and (
                room.cpu_free < request.cpu_milli or room.memory_free < request.memory_mib
            ):
                continue
            for slot in slots:
                if not request.accepts(slot.model) or slot.pool not in request.pools:
                    continue
                status = ledger.gpu(slot.ref).status
                if status is GpuStatus.FREE:
                    gpu = SharedGpu(slot.memory_mib)
                elif status is GpuStatus.SHARED:
                    gpu = ledger.shared[slot.ref]
                else:
                    continue
                share = ask.fraction_for(slot.memory_mib)
                if gpu.fits_fraction(share, training, ask.overcommit):
                    return Placement(request, (slot.ref,), slot.model, slot.pool, share)
        return None


# --- the bench -------------------------------------------------------------------------


async def run(ctx: Context) -> list[Figure]:
    if PARTS == "e2e":
        return await end_to_end(ctx)
    inventory = read_inventory()
    ctx.progress(
        f"placement: openb inventory {len(inventory.nodes)} nodes, {inventory.total_gpus} GPUs"
    )
    figures: list[Figure] = []
    for tag, pods in workloads().items():
        ours = _timed(
            ctx, f"{tag} speed gpusched", decide_with_churn, inventory, pods, None, DECISIONS
        )
        base = _timed(
            ctx, f"{tag} speed first_fit", decide_with_churn, inventory, pods, first_fit,
            BASELINE_DECISIONS,
        )  # fmt: skip
        figures += [
            Figure(NAME, f"{tag}.decisions_per_s", ours.per_s, "decisions/s", base.per_s),
            Figure(NAME, f"{tag}.cpu_per_decision", ours.cpu_us, "µs", base.cpu_us),
            Figure(NAME, f"{tag}.decision_1gpu_p50", ours.p50_one_ms, "ms", base.p50_one_ms),
            Figure(NAME, f"{tag}.decision_1gpu_p99", ours.p99_one_ms, "ms", base.p99_one_ms),
            Figure(NAME, f"{tag}.decision_8gpu_p50", ours.p50_gang_ms, "ms", base.p50_gang_ms),
            Figure(NAME, f"{tag}.decision_8gpu_p99", ours.p99_gang_ms, "ms", base.p99_gang_ms),
        ]  # fmt: skip
    figures += await end_to_end(ctx)
    return figures


# --- (b) end to end: NATS request/reply, PostgreSQL, outbox ---------------------------


async def end_to_end(ctx: Context) -> list[Figure]:
    """Submit jobs to a running admission service and wait for every allocation.granted.

    The service runs in this process (its runtime: consumers, scheduling loop, outbox
    relay) against the run's NATS and a fresh database; the inventory is 32 x 8 A100
    shared nodes per 256 jobs, so every 1-GPU job fits. Jobs/s = jobs / (first submit
    to last allocation.granted received). Baseline: the same number of request/reply
    round trips to a responder that only answers, at the same concurrency.
    CPU per job: this process's CPU time (the admission service and the client, which
    share it) over the same span, against the responder's CPU per round trip; steadier
    than the rates on a machine shared with other work.
    """
    nodes = -(-E2E_JOBS // 8)
    inventory = ctx.scratch / "e2e-inventory.yaml"
    inventory.write_text(
        f"nodes:\n  - {{name_prefix: shared, count: {nodes}, pool: shared, "
        "gpu_model: A100-80GB, gpus: 8, cpu_milli: 128000, memory_mib: 1048576}\n"
    )
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    settings = Settings(
        nats_url=ctx.nats_url,
        database_url=await ctx.create_database("bench_admission"),
        subject_prefix=prefix,
        db_pool_size=int(os.environ.get("BENCH_PLACEMENT_E2E_POOL", "5")),
    )
    settings = settings.model_copy(
        update={"admission": settings.admission.model_copy(
            update={"inventory_path": inventory, "schedule_interval_s": 0.05})}
    )  # fmt: skip
    rt = ServiceRuntime(
        admission_app.NAME, admission_app.SCHEMA, settings, migrations_dir(admission_app.__file__)
    )
    await rt.start()
    await admission_app.assemble(rt)
    task = asyncio.create_task(rt.run())
    subjects = Subjects(prefix)
    nc = await nats.connect(ctx.nats_url)
    try:
        await _until_serving(nc, subjects)
        baseline, baseline_cpu = await _echo_rate(nc, prefix)
        granted = asyncio.Event()
        seen = 0

        async def on_granted(_: Msg) -> None:
            nonlocal seen
            seen += 1
            if seen >= E2E_JOBS:
                granted.set()

        sub = await nc.subscribe(
            subjects.event(admission_app.NAME, T.ALLOCATION_GRANTED), cb=on_granted
        )
        start, cpu_start = time.perf_counter(), time.process_time()
        await _fan_out(nc, subjects.api_jobs_submit, [
            json.dumps({"name": f"e2e-{n}", "team": "bench", "gpus": {"count": 1},
                        "idempotency_key": f"k{n}"}).encode()
            for n in range(E2E_JOBS)
        ])  # fmt: skip
        submitted = time.perf_counter() - start
        await asyncio.wait_for(granted.wait(), timeout=300)
        elapsed = time.perf_counter() - start
        cpu = time.process_time() - cpu_start
        await sub.unsubscribe()
    finally:
        await nc.drain()
        rt.request_stop()
        await asyncio.wait_for(task, 60)
    ctx.progress(f"placement: e2e {E2E_JOBS} jobs granted in {elapsed:.1f} s")
    return [
        Figure(NAME, "e2e.jobs_per_s", E2E_JOBS / elapsed, "jobs/s", baseline),
        Figure(NAME, "e2e.submits_per_s", E2E_JOBS / submitted, "jobs/s", baseline),
        Figure(NAME, "e2e.cpu_per_job", cpu / E2E_JOBS * 1e6, "µs", baseline_cpu),
    ]


async def _until_serving(nc: NatsClient, subjects: Subjects) -> None:
    for _ in range(200):
        try:
            await nc.request(subjects.api_jobs_get, b'{"job_id": "job-none"}', timeout=1)
            return
        except Exception:  # no responders yet: the endpoints subscribe once run() starts
            await asyncio.sleep(0.1)
    raise RuntimeError("admission did not answer")


async def _fan_out(nc: NatsClient, subject: str, bodies: list[bytes]) -> None:
    queue = iter(bodies)

    async def worker() -> None:
        for body in queue:
            reply = json.loads((await nc.request(subject, body, timeout=60)).data)
            if not reply.get("ok"):
                raise RuntimeError(f"refused: {reply}")

    await asyncio.gather(*(worker() for _ in range(E2E_CONCURRENCY)))


async def _echo_rate(nc: NatsClient, prefix: str) -> tuple[float, float]:
    """Round trips per second, and CPU µs per round trip of this process."""
    subject = f"{prefix}.bench.echo"

    async def answer(msg: Msg) -> None:
        await msg.respond(b'{"ok": true}')

    sub = await nc.subscribe(subject, cb=answer)
    start, cpu_start = time.perf_counter(), time.process_time()
    await _fan_out(nc, subject, [b"{}"] * E2E_JOBS)
    rate = E2E_JOBS / (time.perf_counter() - start)
    cpu = (time.process_time() - cpu_start) / E2E_JOBS * 1e6
    await sub.unsubscribe()
    return rate, cpu


def _timed(ctx: Context, label: str, work: Callable[..., R], *args: object) -> R:
    start = time.perf_counter()
    result = work(*args)
    ctx.progress(f"placement: {label} took {time.perf_counter() - start:.1f} s")
    return result
