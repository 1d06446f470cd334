"""The indexes placement reads, kept in step with every slot change by the ledger's
evolution, so a decision looks at a few candidate nodes instead of every GPU.

- ``FreeIndex``: free whole GPUs per gang key and node, and per gang key the nodes
  bucketed by how many of those GPUs they have free, then by host shape (CPU, memory).
  ``pack`` walks the buckets tightest first.
- ``FractionIndex``: partly used fractional GPUs by (home pool, model) and compute left,
  per node; the nodes that have some, by host CPU left; the nodes that took a fraction
  last. The share placement (``shares``) reads it.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Mapping

from gpusched.domain.inventory import GpuRef, Pool

from .model import GpuSlot
from .requests import GangKey, key_of

__all__ = ["FractionIndex", "FreeIndex", "Shape"]

# (cpu_milli, memory_mib) of a node's host; (0, 0) when the ledger does not limit it.
Shape = tuple[int, int]

# Nodes that took fractions last, remembered: their free GPUs are candidates for the
# next fraction, so fractions gather on few nodes instead of opening GPUs everywhere.
RECENT_FRACTION_NODES = 8


class FreeIndex:
    __slots__ = ("buckets", "free", "shapes")

    def __init__(self) -> None:
        self.free: dict[GangKey, dict[str, dict[int, GpuSlot]]] = {}
        self.buckets: dict[GangKey, dict[int, dict[Shape, dict[str, None]]]] = {}
        # A node's shape is its host size: placement fills small hosts before large
        # ones, which keeps large hosts for the jobs that need their CPU and memory.
        self.shapes: dict[str, Shape] = {}

    def on_node(self, key: GangKey, node: str) -> Mapping[int, GpuSlot]:
        """The node's free GPUs of ``key`` by index (empty: none)."""
        return self.free.get(key, {}).get(node, {})

    def add(self, slot: GpuSlot) -> None:
        key = key_of(slot)
        node = slot.ref.node
        free = self.free.setdefault(key, {}).setdefault(node, {})
        buckets = self.buckets.setdefault(key, {})
        shape = self.shapes[node]
        count = len(free)
        if count:
            _unbucket(buckets, count, shape, node)
        free[slot.ref.index] = slot
        buckets.setdefault(count + 1, {}).setdefault(shape, {})[node] = None

    def remove(self, slot: GpuSlot) -> None:
        key = key_of(slot)
        node = slot.ref.node
        by_node = self.free[key]
        free = by_node[node]
        buckets = self.buckets[key]
        shape = self.shapes[node]
        count = len(free)
        _unbucket(buckets, count, shape, node)
        del free[slot.ref.index]
        if free:
            buckets.setdefault(count - 1, {}).setdefault(shape, {})[node] = None
        else:
            del by_node[node]


def _unbucket(
    buckets: dict[int, dict[Shape, dict[str, None]]], count: int, shape: Shape, node: str
) -> None:
    by_shape = buckets[count]
    nodes = by_shape[shape]
    del nodes[node]
    if not nodes:
        del by_shape[shape]
        if not by_shape:
            del buckets[count]


class FractionIndex:
    __slots__ = ("by_cpu", "by_left", "lefts", "node_lefts", "recent_nodes")

    def __init__(self) -> None:
        self.by_left: dict[tuple[Pool, str], dict[int, dict[GpuRef, None]]] = {}
        # The compute-left values present in by_left, sorted, for a bisect to the
        # tightest fit.
        self.lefts: dict[tuple[Pool, str], list[int]] = {}
        # Per node, the compute left on each of its partly used fractional GPUs: what
        # the fragmentation score of a fraction reads.
        self.node_lefts: dict[str, dict[GpuRef, int]] = {}
        # The nodes in node_lefts with a host, by host CPU left: (cpu_free, node), sorted.
        self.by_cpu: list[tuple[int, str]] = []
        # The last few nodes a fraction landed on, oldest first.
        self.recent_nodes: dict[str, None] = {}

    def add(self, ref: GpuRef, key: tuple[Pool, str], left: int) -> None:
        bucket = self.by_left.setdefault(key, {}).setdefault(left, {})
        if not bucket:
            insort(self.lefts.setdefault(key, []), left)
        bucket[ref] = None
        self.node_lefts.setdefault(ref.node, {})[ref] = left

    def remove(self, ref: GpuRef, key: tuple[Pool, str], left: int) -> None:
        lefts = self.node_lefts[ref.node]
        del lefts[ref]
        if not lefts:
            del self.node_lefts[ref.node]
        by_left = self.by_left[key]
        del by_left[left][ref]
        if not by_left[left]:
            del by_left[left]
            self.lefts[key].remove(left)

    def took_fraction(self, node: str) -> None:
        self.recent_nodes.pop(node, None)
        self.recent_nodes[node] = None
        if len(self.recent_nodes) > RECENT_FRACTION_NODES:
            del self.recent_nodes[next(iter(self.recent_nodes))]

    def index_host(self, node: str, cpu_free: int, add: bool) -> None:
        if add:
            insort(self.by_cpu, (cpu_free, node))
        else:
            del self.by_cpu[bisect_left(self.by_cpu, (cpu_free, node))]
