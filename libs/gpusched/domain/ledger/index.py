"""The index of free whole GPUs, kept in step with every slot change by the ledger's
evolution: per gang key, each node's free GPUs, and the nodes bucketed by how many of
those GPUs they have free, then by host shape (CPU, memory). Lent GPUs (``pack`` walks
their buckets tightest first), spanning gangs and ``nodes_free`` read it; the scores of
the other placements read the node table (``scores``).
"""

from __future__ import annotations

from collections.abc import Mapping

from .model import GpuSlot
from .requests import GangKey, key_of

__all__ = ["FreeIndex", "Shape"]

# (cpu_milli, memory_mib) of a node's host; (0, 0) when the ledger does not limit it.
Shape = tuple[int, int]


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
