"""Same-run baselines for placement on the openb cluster: first fit, best fit and FGD.

Each packs pods on a plain array model of the cluster (``Cluster``: every GPU's compute
left in milli, every node's host CPU and memory left), with the rules gpusched's ledger
enforces: a pod runs on one node, whole GPUs are wholly free GPUs, a fraction (1 GPU,
milli < 1000) shares a GPU up to 1000 milli, host CPU and memory are never exceeded, a
pod with a GPU model spec only uses GPUs of those models. gpusched itself is run on its
real ``Ledger`` (bench_fgd).

- first fit: the first node in the run's order that fits; its first free GPUs, or its
  first GPU with the fraction left.
- best fit (the FGD artifact's baseline): the node that the pod leaves with the least
  free CPU and GPU, each over its largest node value, weighted half and half; a
  fraction on its tightest GPU.
- FGD, from the paper (Weng et al., ATC'23, section 4), written here from its text: a
  node's fragmentation for a workload is the expected GPU capacity its typical pods
  cannot use: for each typical pod type (weighted by its share of the pods), all the
  node's unallocated GPU compute if that pod cannot run there (too little CPU left, too
  few GPUs with its per-GPU compute left, or none of the GPU models it accepts), else
  the compute left on GPUs that have less than it asks. Typical pods: the GPU pod types
  of the workload (GPUs, compute per GPU, CPU, model spec) most frequent first, until
  95 % of the pods. A pod goes where this fragmentation grows least (for a fraction:
  the node and the GPU); ties are broken at random (seeded), as a Kubernetes scheduler
  does among equal scores.
- FGD with ties in node order (``random_ties=False``): the same score, ties to the first
  node of the run's order, a stronger variant on these workloads (equal scores are
  common, and a random choice among them spreads pods, and CPU-only pods' CPU, over
  every node).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from bench.openb import WHOLE, Node, Pod

__all__ = ["BestFit", "Cluster", "Fgd", "FirstFit", "Packer", "TypicalPods", "typical_pods"]

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


class Cluster:
    """GPU nodes as arrays, in the run's node order."""

    def __init__(self, nodes: Sequence[Node]) -> None:
        width = max(node.gpus for node in nodes)
        self.names = [node.name for node in nodes]
        self.model_names = sorted({node.model for node in nodes})
        self.model = np.array([self.model_names.index(node.model) for node in nodes])
        # Compute left per GPU in milli; -1 where a node has no such GPU.
        self.left: IntArray = np.full((len(nodes), width), -1, dtype=np.int64)
        for row, node in enumerate(nodes):
            self.left[row, : node.gpus] = WHOLE
        self.cpu: IntArray = np.array([node.cpu_milli for node in nodes], dtype=np.int64)
        self.memory: IntArray = np.array([node.memory_mib for node in nodes], dtype=np.int64)
        self.free_whole: IntArray = (self.left == WHOLE).sum(axis=1)
        self._access: dict[tuple[str, ...], BoolArray] = {}

    def access(self, models: tuple[str, ...]) -> BoolArray:
        """Nodes whose GPUs a pod with this model spec may use."""
        found = self._access.get(models)
        if found is None:
            if models:
                wanted = [self.model_names.index(m) for m in models if m in self.model_names]
                found = np.isin(self.model, wanted)
            else:
                found = np.ones(len(self.names), dtype=np.bool_)
            self._access[models] = found
        return found

    def feasible(self, pod: Pod) -> BoolArray:
        """Nodes that can take ``pod`` now."""
        mask = (self.cpu >= pod.cpu_milli) & (self.memory >= pod.memory_mib)
        if not pod.gpus:
            return mask
        mask &= self.access(pod.models)
        if pod.fraction:
            room: BoolArray = self.left.max(axis=1) >= pod.milli
            return mask & room
        return mask & (self.free_whole >= pod.gpus)

    def take(self, node: int, gpus: Sequence[int], pod: Pod) -> None:
        self.cpu[node] -= pod.cpu_milli
        self.memory[node] -= pod.memory_mib
        for gpu in gpus:
            self.left[node, gpu] -= pod.milli
        self.free_whole[node] = int((self.left[node] == WHOLE).sum())

    def first_free(self, node: int, count: int) -> tuple[int, ...]:
        return tuple(int(g) for g in np.flatnonzero(self.left[node] == WHOLE)[:count])


class Packer:
    """Chooses a node and GPUs for a pod on its ``Cluster``, or None."""

    name = "packer"

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster

    def choose(self, pod: Pod) -> tuple[int, tuple[int, ...]] | None:
        raise NotImplementedError

    def place(self, pod: Pod) -> bool:
        chosen = self.choose(pod)
        if chosen is None:
            return False
        node, gpus = chosen
        self.cluster.take(node, gpus, pod)
        self.placed(node)
        return True

    def placed(self, node: int) -> None:
        """``node`` changed (a subclass refreshes what it keeps per node)."""


class FirstFit(Packer):
    name = "first_fit"

    def choose(self, pod: Pod) -> tuple[int, tuple[int, ...]] | None:
        cluster = self.cluster
        nodes = np.flatnonzero(cluster.feasible(pod))
        if not len(nodes):
            return None
        node = int(nodes[0])
        if not pod.gpus:
            return node, ()
        if pod.fraction:
            return node, (int(np.flatnonzero(cluster.left[node] >= pod.milli)[0]),)
        return node, cluster.first_free(node, pod.gpus)


class BestFit(Packer):
    name = "best_fit"

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(cluster)
        self.max_cpu = float(cluster.cpu.max())
        self.max_gpu = float((cluster.left.clip(0).sum(axis=1)).max())

    def choose(self, pod: Pod) -> tuple[int, tuple[int, ...]] | None:
        cluster = self.cluster
        nodes = np.flatnonzero(cluster.feasible(pod))
        if not len(nodes):
            return None
        gpu_free = cluster.left[nodes].clip(0).sum(axis=1)
        score = (
            0.5 * (cluster.cpu[nodes] - pod.cpu_milli) / self.max_cpu
            + 0.5 * (gpu_free - pod.gpu_milli) / self.max_gpu
        )
        node = int(nodes[int(np.argmin(score))])
        if not pod.gpus:
            return node, ()
        if pod.fraction:
            left = cluster.left[node]
            fits = np.where(left >= pod.milli, left, WHOLE + 1)
            return node, (int(np.argmin(fits)),)
        return node, cluster.first_free(node, pod.gpus)


@dataclass(frozen=True, slots=True)
class TypicalPods:
    """Pod types (GPUs, compute per GPU, CPU, model spec) and their weights."""

    gpus: IntArray
    milli: IntArray
    cpu: IntArray
    models: tuple[tuple[str, ...], ...]
    weight: FloatArray


def typical_pods(pods: Sequence[Pod], popularity: float = 0.95) -> TypicalPods:
    """The most frequent GPU pod types until ``popularity`` of the GPU pods, weighted by
    their frequency among them (summing to 1)."""
    counts = Counter((pod.gpus, pod.milli, pod.cpu_milli, pod.models) for pod in pods if pod.gpus)
    total = sum(counts.values())
    chosen: list[tuple[tuple[int, int, int, tuple[str, ...]], int]] = []
    covered = 0
    for key, count in sorted(counts.items(), key=lambda item: (-item[1], item[0])):
        if covered >= popularity * total:
            break
        chosen.append((key, count))
        covered += count
    weight = np.array([count for _, count in chosen], dtype=np.float64)
    return TypicalPods(
        np.array([key[0] for key, _ in chosen], dtype=np.int64),
        np.array([key[1] for key, _ in chosen], dtype=np.int64),
        np.array([key[2] for key, _ in chosen], dtype=np.int64),
        tuple(key[3] for key, _ in chosen),
        weight / weight.sum(),
    )


class Fragmentation:
    """The FGD fragmentation of every node for ``types``, kept per node: for each type,
    how many GPUs have its compute left (``count``) and the compute left on the others
    (``part``)."""

    def __init__(self, cluster: Cluster, types: TypicalPods) -> None:
        self.cluster = cluster
        self.types = types
        self.tm = types.milli[:, None]
        self.tg = types.gpus[:, None]
        self.tc = types.cpu[:, None]
        self.w = types.weight[:, None]
        self.access = np.stack([cluster.access(models) for models in types.models])
        left = cluster.left
        self.count: IntArray = (left[None, :, :] >= types.milli[:, None, None]).sum(axis=2)
        self.part: IntArray = np.where(
            (left[None] >= 0) & (left[None] < types.milli[:, None, None]), left[None], 0
        ).sum(axis=2)
        self.unallocated: IntArray = left.clip(0).sum(axis=1)
        self.value: FloatArray = self.after(
            slice(None), self.count, self.part, self.unallocated, cluster.cpu
        )
        # Per node, how many times it changed: scores kept per pod shape are recomputed
        # for the nodes that changed since.
        self.version: IntArray = np.zeros(len(cluster.names), dtype=np.int64)

    def after(
        self,
        nodes: IntArray | slice,
        count: IntArray,
        part: IntArray,
        unallocated: IntArray,
        cpu: IntArray,
    ) -> FloatArray:
        """The fragmentation of ``nodes`` were they in the given state (arrays over the
        types, then the nodes)."""
        fits = self.access[:, nodes] & (cpu >= self.tc) & (count >= self.tg)
        return (self.w * np.where(fits, part, unallocated)).sum(axis=0)  # type: ignore[no-any-return]

    def refresh(self, node: int) -> None:
        self.version[node] += 1
        left = self.cluster.left[node]
        self.count[:, node] = (left[None, :] >= self.tm).sum(axis=1)
        self.part[:, node] = np.where((left >= 0) & (left < self.tm), left, 0).sum(axis=1)
        self.unallocated[node] = left.clip(0).sum()
        self.value[node] = self.after(
            np.array([node]),
            self.count[:, [node]],
            self.part[:, [node]],
            self.unallocated[[node]],
            self.cluster.cpu[[node]],
        )[0]

    def total(self) -> float:
        return float(self.value.sum())


class Fgd(Packer):
    name = "fgd"

    def __init__(
        self, cluster: Cluster, types: TypicalPods, seed: int, random_ties: bool = True
    ) -> None:
        super().__init__(cluster)
        self.frag = Fragmentation(cluster, types)
        self.rng = random.Random(seed)
        self.random_ties = random_ties
        # Per pod shape: each node's version when scored, its growth, and for a
        # fraction the GPU it would take (the growth of one node depends only on it).
        self._kept: dict[tuple[int, int, int], tuple[IntArray, FloatArray, IntArray]] = {}

    def placed(self, node: int) -> None:
        self.frag.refresh(node)

    def choose(self, pod: Pod) -> tuple[int, tuple[int, ...]] | None:
        nodes = np.flatnonzero(self.cluster.feasible(pod))
        if not len(nodes):
            return None
        growth, gpu = self._growth(pod)
        node = int(nodes[self._least(growth[nodes])])
        if pod.fraction:
            return node, (int(gpu[node]),)
        return node, self.cluster.first_free(node, pod.gpus)

    def _growth(self, pod: Pod) -> tuple[FloatArray, IntArray]:
        key = (pod.gpus, pod.milli, pod.cpu_milli)
        size = len(self.cluster.names)
        kept = self._kept.get(key)
        if kept is None:
            kept = (np.full(size, -1), np.full(size, np.inf), np.zeros(size, dtype=np.int64))
            self._kept[key] = kept
        seen, growth, gpu = kept
        changed = np.flatnonzero(seen != self.frag.version)
        if len(changed):
            if pod.fraction:
                self._fraction_growth(pod, changed, growth, gpu)
            else:
                frag = self.frag
                growth[changed] = (
                    frag.after(
                        changed,
                        frag.count[:, changed] - pod.gpus,
                        frag.part[:, changed],
                        frag.unallocated[changed] - pod.gpu_milli,
                        self.cluster.cpu[changed] - pod.cpu_milli,
                    )
                    - frag.value[changed]
                )
            seen[changed] = self.frag.version[changed]
        return growth, gpu

    def _fraction_growth(
        self, pod: Pod, nodes: IntArray, growth: FloatArray, gpu: IntArray
    ) -> None:
        """For each of ``nodes``, the growth of its best GPU for the fraction (inf if
        none has it left), and which GPU."""
        cluster, frag = self.cluster, self.frag
        growth[nodes] = np.inf
        rows, cols = np.nonzero(cluster.left[nodes] >= pod.milli)
        if not len(rows):
            return
        node_of = nodes[rows]
        left = cluster.left[node_of, cols]
        rest = left - pod.milli
        tm = frag.tm
        count = frag.count[:, node_of] - (left >= tm) + (rest >= tm)
        part = frag.part[:, node_of] - np.where(left < tm, left, 0) + np.where(rest < tm, rest, 0)
        each = (
            frag.after(
                node_of,
                count,
                part,
                frag.unallocated[node_of] - pod.milli,
                cluster.cpu[node_of] - pod.cpu_milli,
            )
            - frag.value[node_of]
        )
        # Per node, its GPU of least growth (the lowest index among equals).
        order = np.lexsort((cols, each, node_of))
        first = order[np.r_[True, node_of[order][1:] != node_of[order][:-1]]]
        growth[node_of[first]] = each[first]
        gpu[node_of[first]] = cols[first]

    def _least(self, growth: FloatArray) -> int:
        least = growth.min()
        ties = np.flatnonzero(growth <= least + 1e-9)
        if len(ties) == 1 or not self.random_ties:
            return int(ties[0])
        return int(self.rng.choice(list(ties)))
