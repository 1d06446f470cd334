"""The Alibaba openb trace as the FGD paper's method uses it: the GPU nodes, the pod
lists and their variants, and the workload of one seeded run.

Data: Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads with
Fragmentation Gradient Descent", USENIX ATC'23 (alibaba/clusterdata,
cluster-trace-gpu-v2023), read from ``Settings().traces_dir`` and never copied.

Variants made here, with fixed seeds, from ``openb_pod_list_default``:
- ``gpuspec<P>``: P % of the GPU pods (seeded) require one of a set of GPU models, as the
  trace's ``gpu_spec`` column allows (``V100M16|V100M32``): a single model two times in
  three, drawn in proportion to the GPUs of that model in the inventory, else one of the
  multi-model sets the FGD artifact's lists use. Only specs some node can ever satisfy
  for that pod (GPUs per node, host CPU and memory) are drawn.
- ``cpu<P>``: the list's GPU pods, and CPU-only pods (drawn with replacement from its own
  CPU-only pods) until they ask P % of the cluster's CPU, spread over the list at random.

The FGD method for one seed (their artifact's workload tuning): pods drawn at random,
with replacement, from the list are appended until the requested GPUs reach ``ratio``
(1.3) of the cluster's, or removed at random while above it; the list is shuffled; the
node order is shuffled too (the artifact names nodes with a random prefix).
"""

from __future__ import annotations

import csv
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from gpusched.domain.ledger import JobKind, PlacementRequest
from gpusched.domain.sharing import ShareAsk
from gpusched.infra.settings import Settings

__all__ = [
    "Node",
    "Pod",
    "Workload",
    "constrained",
    "cpu_only_added",
    "read_nodes",
    "read_pods",
    "seeded_run",
    "trace_dir",
]

TRACE = "alibaba-gpu-v2023"
NODE_LIST = "openb_node_list_gpu_node.csv"
WHOLE = 1000
# Multi-model sets of the FGD artifact's gpu_spec lists (besides single models).
MODEL_SETS = (
    ("V100M16", "V100M32"),
    ("P100", "V100M16", "V100M32"),
    ("P100", "T4", "V100M16", "V100M32"),
    ("G2", "P100", "T4", "V100M16", "V100M32"),
)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    model: str
    gpus: int
    cpu_milli: int
    memory_mib: int


@dataclass(frozen=True, slots=True)
class Pod:
    name: str
    gpus: int
    milli: int  # per GPU; below 1000 only for 1-GPU pods, 0 for a CPU-only pod
    cpu_milli: int
    memory_mib: int
    # Acceptable GPU models (empty: any).
    models: tuple[str, ...] = ()

    @property
    def gpu_milli(self) -> int:
        """The GPU capacity the pod asks, in milli."""
        return self.gpus * self.milli

    @property
    def fraction(self) -> bool:
        return self.gpus == 1 and self.milli < WHOLE

    def request(self, job_id: str) -> PlacementRequest:
        """The pod as gpusched's ledger is asked: one node (a pod never spans nodes), a
        fraction as a share of one GPU (its memory cap its share of the GPU's memory),
        a CPU-only pod as a job of host CPU and memory alone."""
        return PlacementRequest(
            job_id,
            JobKind.TRAINING,
            self.gpus,
            cpu_milli=self.cpu_milli,
            memory_mib=self.memory_mib,
            may_span_nodes=False,
            share=ShareAsk(self.milli) if self.fraction else None,
            models=self.models,
        )


@dataclass(frozen=True, slots=True)
class Workload:
    """One run's input: the nodes in this run's order and the pods in arrival order."""

    name: str
    seed: int
    nodes: tuple[Node, ...]
    pods: tuple[Pod, ...]

    @property
    def capacity_milli(self) -> int:
        return sum(node.gpus for node in self.nodes) * WHOLE


def trace_dir() -> Path:
    return Settings().traces_dir / TRACE


def read_nodes() -> tuple[Node, ...]:
    with (trace_dir() / NODE_LIST).open(encoding="utf-8") as rows:
        return tuple(
            Node(row["sn"], row["model"], int(row["gpu"]), int(row["cpu_milli"]),
                 int(row["memory_mib"]))
            for row in csv.DictReader(rows)
            if int(row["gpu"]) > 0
        )  # fmt: skip


def read_pods(pod_list: str) -> tuple[Pod, ...]:
    pods = []
    with (trace_dir() / f"{pod_list}.csv").open(encoding="utf-8") as rows:
        for row in csv.DictReader(rows):
            gpus = int(row["num_gpu"])
            spec = (row.get("gpu_spec") or "").strip()
            pods.append(
                Pod(
                    row["name"],
                    gpus,
                    int(row["gpu_milli"]) if gpus else 0,
                    int(row["cpu_milli"]),
                    int(row["memory_mib"]),
                    tuple(sorted(spec.split("|"))) if spec else (),
                )
            )
    return tuple(pods)


def _can_ever_fit(pod: Pod, nodes: Iterable[Node], models: Sequence[str]) -> bool:
    return any(
        node.model in models
        and node.gpus >= pod.gpus
        and node.cpu_milli >= pod.cpu_milli
        and node.memory_mib >= pod.memory_mib
        for node in nodes
    )


def constrained(
    pods: Sequence[Pod], nodes: Sequence[Node], share: float, seed: int
) -> tuple[Pod, ...]:
    """``share`` of the GPU pods given a GPU model spec (see the module docstring)."""
    rng = random.Random(seed)
    gpus_of = Counter[str]()
    for node in nodes:
        gpus_of[node.model] += node.gpus
    singles = sorted(gpus_of)
    out = []
    for pod in pods:
        if pod.gpus and rng.random() < share:
            out.append(replace(pod, models=_spec_for(pod, nodes, rng, singles, gpus_of)))
        else:
            out.append(pod)
    return tuple(out)


def _spec_for(
    pod: Pod, nodes: Sequence[Node], rng: random.Random, singles: Sequence[str],
    gpus_of: Counter[str],
) -> tuple[str, ...]:  # fmt: skip
    feasible_singles = [model for model in singles if _can_ever_fit(pod, nodes, (model,))]
    feasible_sets = [spec for spec in MODEL_SETS if _can_ever_fit(pod, nodes, spec)]
    if feasible_sets and (not feasible_singles or rng.random() < 1 / 3):
        return rng.choice(feasible_sets)
    if not feasible_singles:
        return ()
    weights = [gpus_of[model] for model in feasible_singles]
    return (rng.choices(feasible_singles, weights)[0],)


def cpu_only_added(
    pods: Sequence[Pod], nodes: Sequence[Node], cpu_share: float, seed: int
) -> tuple[Pod, ...]:
    """The GPU pods of ``pods`` and CPU-only pods asking ``cpu_share`` of the cluster's
    CPU, drawn from its own CPU-only pods, at random places."""
    rng = random.Random(seed)
    gpu_pods = [pod for pod in pods if pod.gpus]
    cpu_pods = [pod for pod in pods if not pod.gpus]
    target = cpu_share * sum(node.cpu_milli for node in nodes)
    added: list[Pod] = []
    asked = 0
    while asked < target:
        pod = rng.choice(cpu_pods)
        added.append(replace(pod, name=f"{pod.name}-cpu{len(added)}"))
        asked += pod.cpu_milli
    out = list(gpu_pods)
    for pod in added:
        out.insert(rng.randrange(len(out) + 1), pod)
    return tuple(out)


def seeded_run(
    name: str, pods: Sequence[Pod], nodes: Sequence[Node], seed: int, ratio: float = 1.3
) -> Workload:
    """The FGD method's workload for one seed (see the module docstring)."""
    rng = random.Random(seed)
    capacity = sum(node.gpus for node in nodes) * WHOLE
    target = ratio * capacity
    tuned = list(pods)
    asked = sum(pod.gpu_milli for pod in tuned)
    if asked > target:
        while asked > target:
            asked -= tuned.pop(rng.randrange(len(tuned))).gpu_milli
    else:
        while True:
            pod = pods[rng.randrange(len(pods))]
            if asked + pod.gpu_milli > target:
                break
            tuned.append(replace(pod, name=f"{pod.name}-tuned{len(tuned)}"))
            asked += pod.gpu_milli
    rng.shuffle(tuned)
    order = list(nodes)
    rng.shuffle(order)
    return Workload(name, seed, tuple(order), tuple(tuned))
