"""Placing a job without GPUs: host CPU and memory alone, on a GPU node.

Such a job costs the GPUs nothing directly, but the CPU and memory it takes may leave
a node's free GPUs without the host room their next pod needs (stranded). So it goes
first where no GPU capacity is left to strand, the node whose CPU it fits tightest
(larger CPU holes stay for larger pods); else where it strands fewest free GPUs,
keeping the most CPU per free GPU.
"""

from __future__ import annotations

from dataclasses import replace

from gpusched.domain.placement import stranded

from .requests import PlacementRequest
from .state import LedgerState

__all__ = ["place_host"]


def place_host(ledger: LedgerState, request: PlacementRequest) -> str | None:
    """The node for ``request`` (no GPUs), or None when no node has its host room left."""
    best: tuple[tuple[int, int, float, str], str] | None = None
    for node, total in ledger._node_gpus.items():
        if not ledger._host_eligible(node, request):
            continue
        room = ledger._hosts.get(node)
        unallocated = ledger.node_free_milli(node)
        if room is None:
            rank = (0, 0, 0.0, node)
        elif not unallocated:
            rank = (0, room.cpu_free, 0.0, node)
        else:
            free = -(-unallocated // 1000)
            after = replace(
                room,
                cpu_free=room.cpu_free - request.cpu_milli,
                memory_free=room.memory_free - request.memory_mib,
            )
            strands = stranded(free, after, total) - stranded(free, room, total)
            rank = (1, strands, -after.cpu_free / free, node)
        if best is None or rank < best[0]:
            best = (rank, node)
    return None if best is None else best[1]
