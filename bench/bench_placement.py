"""Placement on the Alibaba openb cluster: decision speed and packing quality.

The inventory is the openb node list (1,213 GPU nodes, 6,212 GPUs), read from
``Settings().traces_dir``; the workloads are the openb_pod_list_default and
openb_pod_list_multigpu50 pod lists, in trace order. Every pod becomes one
PlacementRequest with its CPU and memory, and ``may_span_nodes=False`` (a pod runs on
one node). A fractional pod (gpu_milli < 1000) asks one whole GPU in the figures that
compare with first fit as before; the ``sharing_*`` figures place it fractionally (a
share of one GPU, its memory cap its share of the GPU's memory), against a first fit
that shares GPUs too (``FirstFitShare``, the FGD paper's baseline) and, in the
``*_vs_whole`` figures, against first fit with whole GPUs. Pods without GPUs are skipped.

(a) decision speed: ``Ledger.place`` + ``Ledger.allocate`` per pod, with churn: before
each pod the oldest allocations are released until the pod would take the cluster at
most to 90 % of its GPUs, so decisions run on a busy, fragmented cluster. Reported: all
decisions per second, p50/p99 of one decision for 1-GPU pods and for 8-GPU gangs.
(c) packing (the FGD paper's method): pods in trace order, cycling through the list,
each placed if it fits else skipped, until 500 in a row do not fit. Reported: the share
of GPUs allocated, fragmented GPUs (free GPUs on partly used nodes that can no longer
host an 8-GPU gang, judged against the node's own size), stranded GPUs (free GPUs whose
node has less CPU or memory left than the least demanding pod of the list), and the
share allocated when the first 8-GPU pod found no node. With sharing (the paper's
measures, for both sides): the GPU capacity the placed pods asked (gpu_milli / 1000 for
a fraction) over all GPUs, and the fragmentation of ``fgd_fragment``.
The baseline of every figure is ``first_fit`` on the same ledger, in the same run.
"""

from __future__ import annotations

import asyncio
import csv
import json
import os
import random
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from bench.harness import Context, Figure, percentile
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
from gpusched.domain.placement import fragmented_gpus
from gpusched.domain.sharing import ShareAsk, SharedGpu
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

NAME = "placement"
TRACE = "alibaba-gpu-v2023"
NODE_LIST = "openb_node_list_gpu_node.csv"
POD_LISTS = ("openb_pod_list_default", "openb_pod_list_multigpu50")
BUSY = float(os.environ.get("BENCH_PLACEMENT_BUSY", "0.90"))
DECISIONS = int(os.environ.get("BENCH_PLACEMENT_DECISIONS", "8000"))
FULL_AFTER_MISSES = int(os.environ.get("BENCH_PLACEMENT_MISSES", "500"))
TYPICAL_GANG = 8  # the most frequent multi-GPU size in both pod lists
WHOLE_GPU_MILLI = 1000
SEED = 2023
# first_fit walks every GPU per decision (~6 ms here): its speed is sampled on fewer.
BASELINE_DECISIONS = min(DECISIONS, 1500)
T0 = datetime(2023, 1, 1, tzinfo=UTC)
E2E_JOBS = int(os.environ.get("BENCH_PLACEMENT_E2E_JOBS", "2000"))
E2E_CONCURRENCY = 64
E2E_GOAL = 300.0
# "e2e" runs only the end-to-end part (about a minute instead of several).
PARTS = os.environ.get("BENCH_PLACEMENT_PARTS", "all")

R = TypeVar("R")

# None: gpusched's packing (the ledger's default).
STRATEGIES: dict[str, PlacementStrategy | None] = {"gpusched": None, "first_fit": first_fit}


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    gpus: int
    cpu_milli: int
    memory_mib: int
    milli: int = WHOLE_GPU_MILLI  # per GPU; below 1000 only for 1-GPU pods

    def request(self, job_id: str, sharing: bool = False) -> PlacementRequest:
        fractional = sharing and self.milli < WHOLE_GPU_MILLI
        return PlacementRequest(
            job_id,
            JobKind.TRAINING,
            self.gpus,
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            may_span_nodes=False,
            share=ShareAsk(self.milli) if fractional else None,
        )

    @property
    def requested(self) -> float:
        """The GPU capacity the pod asks: a fraction of one GPU, or whole GPUs."""
        return self.gpus * self.milli / WHOLE_GPU_MILLI


def trace_dir() -> Path:
    return Settings().traces_dir / TRACE


def read_inventory() -> Inventory:
    with (trace_dir() / NODE_LIST).open(encoding="utf-8") as lines:
        return parse_openb_node_csv(lines)


def read_pods(pod_list: str) -> list[Pod]:
    pods = []
    with (trace_dir() / f"{pod_list}.csv").open(encoding="utf-8") as rows:
        for row in csv.DictReader(rows):
            count = int(row["num_gpu"])
            if count == 0:
                continue  # CPU-only: nothing for a GPU ledger to place
            # gpu_milli < 1000 only occurs with num_gpu == 1 (a fraction of one GPU).
            milli = int(row["gpu_milli"])
            assert count == 1 or milli == WHOLE_GPU_MILLI
            pods.append(
                Pod(row["name"], count, int(row["cpu_milli"]), int(row["memory_mib"]), milli)
            )
    return pods


# --- (a) decision speed -----------------------------------------------------------


@dataclass(frozen=True)
class Speed:
    per_s: float
    p50_one_ms: float
    p99_one_ms: float
    p50_gang_ms: float
    p99_gang_ms: float
    placed: int


def decide_with_churn(
    inventory: Inventory,
    pods: list[Pod],
    strategy: PlacementStrategy | None,
    decisions: int,
    sharing: bool = False,
    shared_first_fit: bool = False,
) -> Speed:
    ledger = Ledger.from_inventory(inventory)
    baseline = FirstFitShare(ledger, grows_only=False)
    capacity = inventory.total_gpus
    live: deque[tuple[str, float]] = deque()
    used = 0.0
    one: list[float] = []
    gang: list[float] = []
    spent = 0.0
    decided = placed = 0
    clock = time.perf_counter
    for number, pod in _cycle(pods, decisions):
        weight = pod.requested if sharing else pod.gpus
        while live and used + weight > BUSY * capacity:
            allocation_id, gpus = live.popleft()
            ledger.release(allocation_id, T0)
            used -= gpus
        allocation_id = f"a-{number}"
        request = pod.request(f"j-{number}", sharing)
        start = clock()
        if shared_first_fit and request.share is not None:
            placement = baseline.place(request)
        else:
            placement = ledger.place(request, strategy)
        if placement is not None:
            ledger.allocate(allocation_id, placement, "openb", PriorityClass.P1_NORMAL, T0)
        elapsed = clock() - start
        spent += elapsed
        decided += 1
        if placement is not None:
            placed += 1
            live.append((allocation_id, weight))
            used += weight
        if pod.gpus == 1:
            one.append(elapsed * 1000)
        elif pod.gpus == TYPICAL_GANG:
            gang.append(elapsed * 1000)
    return Speed(
        per_s=decided / spent,
        p50_one_ms=percentile(one, 50),
        p99_one_ms=percentile(one, 99),
        p50_gang_ms=percentile(gang, 50),
        p99_gang_ms=percentile(gang, 99),
        placed=placed,
    )


def _cycle(pods: list[Pod], count: int) -> Iterator[tuple[int, Pod]]:
    for number in range(count):
        yield number, pods[number % len(pods)]


# --- (c) packing until full ----------------------------------------------------------


@dataclass(frozen=True)
class Packing:
    allocated_share: float
    fragmented: int
    stranded: int
    placed: int
    # Share of GPUs allocated when the first 8-GPU gang found no node: how long the
    # strategy keeps whole nodes for gangs while the cluster fills.
    share_at_first_gang_refusal: float
    # The GPU capacity the placed pods asked (a fraction counts its gpu_milli / 1000).
    requested_share: float
    # The FGD paper's fragmentation at full, in GPUs (see fgd_fragment).
    fgd_fragment: float


def pack_until_full(
    inventory: Inventory,
    pods: list[Pod],
    strategy: PlacementStrategy | None,
    sharing: bool = False,
    shared_first_fit: bool = False,
) -> Packing:
    """Fill the cluster; ``shared_first_fit`` places fractions with ``first_fit_share``
    (whole-GPU pods still with ``strategy``)."""
    ledger = Ledger.from_inventory(inventory)
    baseline = FirstFitShare(ledger, grows_only=True)
    misses = placed = used = 0
    requested = 0.0
    number = 0
    first_refusal: float | None = None
    while misses < FULL_AFTER_MISSES:
        pod = pods[number % len(pods)]
        request = pod.request(f"j-{number}", sharing)
        if shared_first_fit and request.share is not None:
            placement = baseline.place(request)
        else:
            placement = ledger.place(request, strategy)
        if placement is None:
            misses += 1
            if pod.gpus == TYPICAL_GANG and first_refusal is None:
                first_refusal = used / inventory.total_gpus
        else:
            ledger.allocate(f"a-{number}", placement, "openb", PriorityClass.P1_NORMAL, T0)
            misses = 0
            placed += 1
            used += pod.gpus
            requested += pod.requested
        number += 1
    return Packing(
        allocated_share=used / inventory.total_gpus,
        fragmented=fragmented_gpus(ledger.nodes_free(), TYPICAL_GANG),
        stranded=unusable_gpus(ledger, pods),
        placed=placed,
        share_at_first_gang_refusal=(
            used / inventory.total_gpus if first_refusal is None else first_refusal
        ),
        requested_share=requested / inventory.total_gpus,
        fgd_fragment=fgd_fragment(ledger, pods),
    )


class FirstFitShare:
    """The FGD paper's first-fit baseline for a fraction: the first node (name order)
    whose host has the pod's CPU and memory left, its first GPU (index order), shared
    or free, with the fraction's compute and memory left.

    ``grows_only``: allocations are never released (packing), so a node found without
    any free or partly used GPU is skipped from then on; only speeds the baseline up.
    """

    def __init__(self, ledger: Ledger, grows_only: bool) -> None:
        self.ledger = ledger
        self.grows_only = grows_only
        self.full: set[str] = set()
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
            if node in self.full:
                continue
            room = ledger.host_room(node)
            if room is not None and (
                room.cpu_free < request.cpu_milli or room.memory_free < request.memory_mib
            ):
                continue
            open_gpus = 0
            for slot in slots:
                status = ledger.gpu(slot.ref).status
                if status is GpuStatus.FREE:
                    gpu = SharedGpu(slot.memory_mib)
                elif status is GpuStatus.SHARED:
                    gpu = ledger.shared[slot.ref]
                    if gpu.mig or gpu.milli_used >= WHOLE_GPU_MILLI:
                        continue
                else:
                    continue
                open_gpus += 1
                share = ask.fraction_for(slot.memory_mib)
                if slot.pool in request.pools and gpu.fits_fraction(
                    share, training, ask.overcommit
                ):
                    return Placement(request, (slot.ref,), slot.model, slot.pool, share)
            if not open_gpus and self.grows_only:
                self.full.add(node)
        return None


def fgd_fragment(ledger: Ledger, pods: list[Pod]) -> float:
    """The FGD paper's fragmentation of the cluster, in GPUs: for each node, the free
    GPU capacity the workload's typical pod cannot use, averaged over the pod types of
    the list weighted by their frequency (Weng et al., ATC'23, section 3).

    For one pod type on one node: all the node's free GPU capacity when the pod cannot
    run there at all (the host lacks its CPU or memory, or no GPU has its fraction
    left, or fewer whole GPUs than it asks are free); otherwise the free part of each
    GPU that has less left than the pod asks (for a whole-GPU pod: every partly used
    GPU). A MIG GPU's free slices count as used (no pod of these lists asks a slice).
    """
    mix = Counter((pod.gpus, pod.milli, pod.cpu_milli, pod.memory_mib) for pod in pods)
    weights = [(shape, count / len(pods)) for shape, count in mix.items()]
    partial: dict[str, list[int]] = {}
    for ref, shared in ledger.shared.items():
        if not shared.mig and shared.milli_used < WHOLE_GPU_MILLI:
            partial.setdefault(ref.node, []).append(WHOLE_GPU_MILLI - shared.milli_used)
    fragment = 0.0
    for node in ledger.nodes_free():
        lefts = partial.get(node.node, [])
        unallocated = node.free * WHOLE_GPU_MILLI + sum(lefts)
        if not unallocated:
            continue
        room = ledger.host_room(node.node)
        most = max(lefts, default=0)
        for (gpus, milli, cpu, memory), weight in weights:
            if room is not None and (room.cpu_free < cpu or room.memory_free < memory):
                lost = unallocated
            elif milli == WHOLE_GPU_MILLI:
                lost = unallocated if node.free < gpus else sum(lefts)
            elif not node.free and most < milli:
                lost = unallocated
            else:
                lost = sum(left for left in lefts if left < milli)
            fragment += weight * lost
    return fragment / WHOLE_GPU_MILLI


def unusable_gpus(ledger: Ledger, pods: list[Pod]) -> int:
    """Free GPUs whose node has less CPU or memory left than the least demanding 1-GPU
    pod of the list asks: no pod of this workload can ever use them."""
    singles = [pod for pod in pods if pod.gpus == 1]
    cpu = min(pod.cpu_milli for pod in singles)
    memory = min(pod.memory_mib for pod in singles)
    unusable = 0
    for node in ledger.nodes_free():
        room = ledger.host_room(node.node)
        if node.free and room is not None and (room.cpu_free < cpu or room.memory_free < memory):
            unusable += node.free
    return unusable


def sampled(pods: list[Pod]) -> list[Pod]:
    """The pod list in a fixed pseudo-random order: the FGD paper samples its pods."""
    order = list(pods)
    random.Random(SEED).shuffle(order)
    return order


# --- the bench -------------------------------------------------------------------------


async def run(ctx: Context) -> list[Figure]:
    if PARTS == "e2e":
        return await end_to_end(ctx)
    inventory = read_inventory()
    ctx.progress(
        f"placement: openb inventory {len(inventory.nodes)} nodes, {inventory.total_gpus} GPUs"
    )
    lists = {name.removeprefix("openb_pod_list_"): read_pods(name) for name in POD_LISTS}
    figures: list[Figure] = []
    for tag, pods in lists.items():
        ours = _timed(
            ctx, f"{tag} speed gpusched", decide_with_churn, inventory, pods, None, DECISIONS
        )
        base = _timed(
            ctx,
            f"{tag} speed first_fit",
            decide_with_churn,
            inventory,
            pods,
            first_fit,
            BASELINE_DECISIONS,
        )
        figures += [
            Figure(NAME, f"{tag}.decisions_per_s", ours.per_s, "decisions/s", base.per_s),
            Figure(NAME, f"{tag}.decision_1gpu_p50", ours.p50_one_ms, "ms", base.p50_one_ms),
            Figure(NAME, f"{tag}.decision_1gpu_p99", ours.p99_one_ms, "ms", base.p99_one_ms),
            Figure(NAME, f"{tag}.decision_8gpu_p50", ours.p50_gang_ms, "ms", base.p50_gang_ms),
            Figure(NAME, f"{tag}.decision_8gpu_p99", ours.p99_gang_ms, "ms", base.p99_gang_ms),
        ]  # fmt: skip
        # Fractional pods as shares of one GPU, against first fit that shares them too.
        shared = _timed(
            ctx, f"{tag} speed gpusched sharing", decide_with_churn, inventory, pods, None,
            DECISIONS, True,
        )  # fmt: skip
        base_s = _timed(
            ctx, f"{tag} speed first_fit sharing", decide_with_churn, inventory, pods,
            first_fit, BASELINE_DECISIONS, True, True,
        )  # fmt: skip
        figures += [
            Figure(NAME, f"{tag}.sharing_decisions_per_s", shared.per_s, "decisions/s",
                   base_s.per_s),
            Figure(NAME, f"{tag}.sharing_decision_1gpu_p50", shared.p50_one_ms, "ms",
                   base_s.p50_one_ms),
            Figure(NAME, f"{tag}.sharing_decision_1gpu_p99", shared.p99_one_ms, "ms",
                   base_s.p99_one_ms),
        ]  # fmt: skip
    # multigpu50 appends its extra gangs after the default pods, where trace order
    # never reaches before the cluster is full; sampled order mixes them in.
    workloads = {
        "default": lists["default"],
        "multigpu50": lists["multigpu50"],
        "multigpu50_sampled": sampled(lists["multigpu50"]),
    }
    for tag, pods in workloads.items():
        ours_p = _timed(ctx, f"{tag} packing gpusched", pack_until_full, inventory, pods, None)
        base_p = _timed(
            ctx, f"{tag} packing first_fit", pack_until_full, inventory, pods, first_fit
        )
        pairs = {
            "full_allocated_share": ("fraction", ours_p.allocated_share, base_p.allocated_share),
            "full_fragmented_gpus": ("GPUs", ours_p.fragmented, base_p.fragmented),
            "full_stranded_gpus": ("GPUs", ours_p.stranded, base_p.stranded),
            "share_at_first_8gpu_refusal": (
                "fraction",
                ours_p.share_at_first_gang_refusal,
                base_p.share_at_first_gang_refusal,
            ),
        }
        figures += [
            Figure(NAME, f"{tag}.{metric}", value, unit, baseline)
            for metric, (unit, value, baseline) in pairs.items()
        ]
        ours_s = _timed(
            ctx, f"{tag} packing gpusched sharing", pack_until_full, inventory, pods, None, True
        )
        base_ps = _timed(
            ctx, f"{tag} packing first_fit sharing", pack_until_full, inventory, pods,
            first_fit, True, True,
        )  # fmt: skip
        figures += [
            Figure(NAME, f"{tag}.sharing_allocated_share", ours_s.requested_share, "fraction",
                   base_ps.requested_share),
            Figure(NAME, f"{tag}.sharing_fragmented_gpus", ours_s.fgd_fragment, "GPUs",
                   base_ps.fgd_fragment),
            Figure(NAME, f"{tag}.sharing_gang_fragmented_gpus", ours_s.fragmented, "GPUs",
                   base_ps.fragmented),
            Figure(NAME, f"{tag}.sharing_stranded_gpus", ours_s.stranded, "GPUs",
                   base_ps.stranded),
            # Second reference: first fit without sharing (a fraction takes a whole GPU).
            Figure(NAME, f"{tag}.sharing_allocated_share_vs_whole", ours_s.requested_share,
                   "fraction", base_p.requested_share),
            Figure(NAME, f"{tag}.sharing_fragmented_gpus_vs_whole", ours_s.fgd_fragment,
                   "GPUs", base_p.fgd_fragment),
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
