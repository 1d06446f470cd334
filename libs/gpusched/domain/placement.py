"""Packing rules the ledger's placement uses: which GPUs inside a node, and what a
placement costs the cluster in fragmentation.

Pure functions on plain numbers, so the ledger, the benchmarks and the tests share
them. The ledger owns the index of free GPUs and calls these to rank candidates.

Vocabulary:
- group: GPU indices of one NVLink island (else one NUMA node) of a node; a node that
  declares none is one group.
- host room: the CPU and memory a node has left; a GPU whose node has no CPU or memory
  left for it is *stranded*: free, yet nobody can use it.
- fragmented: free GPUs on a node that is partly used and can no longer host the
  cluster's typical multi-GPU gang on its own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = [
    "FED_FRACTION",
    "HostRoom",
    "NodeFree",
    "choose_in_node",
    "fragmented_gpus",
    "per_gpu",
    "stranded",
]


@dataclass(frozen=True, slots=True)
class HostRoom:
    """A node's CPU and memory: its total, and what allocations left free."""

    cpu_total: int
    memory_total: int
    cpu_free: int
    memory_free: int


@dataclass(frozen=True, slots=True)
class NodeFree:
    """Free GPUs of one node, for fragmentation measures."""

    node: str
    free: int
    total: int


def per_gpu(total: int, gpus: int) -> int:
    """A job's host demand per GPU, rounded up, so a gang split across nodes never
    receives less than it asked on any node."""
    return -(-total // gpus) if total > 0 else 0


def choose_in_node(
    free: Sequence[int], wanted: int, groups: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], bool]:
    """Pick ``wanted`` of a node's free GPU indices (sorted); True if inside one group.

    Best fit among groups: the fullest group that still holds the gang, so larger
    islands stay whole for larger gangs. A gang larger than any group's free GPUs takes
    the freest groups first, which crosses as few group boundaries as possible.
    """
    if len(free) < wanted:
        raise ValueError(f"node has {len(free)} free GPUs, {wanted} wanted")
    if not groups:
        return tuple(free[:wanted]), True
    available = set(free)
    by_group = [[index for index in group if index in available] for group in groups]
    fitting = [group for group in by_group if len(group) >= wanted]
    if fitting:
        best = min(fitting, key=lambda group: (len(group), group))
        return tuple(sorted(best[:wanted])), True
    grouped = {index for group in by_group for index in group}
    ordered = [
        index
        for group in sorted(by_group, key=lambda group: (-len(group), group))
        for index in group
    ] + [index for index in free if index not in grouped]
    return tuple(sorted(ordered[:wanted])), False


# A free GPU counts as fed while its node keeps a quarter of its per-GPU share of CPU
# and memory: most pods ask less than a node's average share (the openb median asks
# 9.8 cores per GPU where a 96-core, 8-GPU node gives 12), so only a near-empty host
# truly strands its GPUs. Measured on openb (bench_placement): a full share as the bar
# fragments twice as much, since it shies away from nodes that still had room.
FED_FRACTION = 4


def stranded(free: int, room: HostRoom | None, gpus_total: int) -> int:
    """Free GPUs the node's leftover CPU or memory can no longer feed (see FED_FRACTION)."""
    if room is None or free <= 0:
        return 0
    scale = gpus_total * FED_FRACTION
    fed_by_cpu = room.cpu_free * scale // room.cpu_total if room.cpu_total else free
    fed_by_memory = room.memory_free * scale // room.memory_total if room.memory_total else free
    return max(0, free - min(fed_by_cpu, fed_by_memory))


def fragmented_gpus(nodes: Iterable[NodeFree], typical_gang: int) -> int:
    """Free GPUs on partly used nodes that cannot host the typical gang any more.

    A node is judged against what it could host empty (``min(typical, total)``), so a
    2-GPU node is not fragmented merely for being smaller than an 8-GPU gang.
    """
    return sum(
        node.free
        for node in nodes
        if 0 < node.free < node.total and node.free < min(typical_gang, node.total)
    )
