"""Placing a job without GPUs: host CPU and memory alone, on a GPU node.

Such a job takes no GPU, but the CPU and memory it takes may leave a node's free GPUs
without the host room their next pods need. It goes to the node whose taking them
scores best (``gpusched.domain.fragmentation``: the growth of the node's fragmentation
over the workload's typical pods, how tightly it packs, CPU balance): where no GPU
capacity is left to strand, or where CPU is left beyond what the free GPUs need.
"""

from __future__ import annotations

import numpy as np

from gpusched.domain.sharing import PodShape

from .requests import PlacementRequest
from .state import LedgerState

__all__ = ["place_host"]


def place_host(
    ledger: LedgerState, request: PlacementRequest, mix: tuple[tuple[PodShape, float], ...]
) -> str | None:
    """The node for ``request`` (no GPUs), or None when no node has its host room left."""
    frag = ledger._fragmentation(mix)
    scores = ledger._scores
    table = scores.table
    down = request.exclude_nodes | frozenset(ledger._down)
    fits = scores.usable((), request.cpu_milli, request.memory_mib, down, request.pools)
    rows = np.flatnonzero(fits)
    if not len(rows):
        return None
    score = scores.whole(frag, 0, request.cpu_milli, request.memory_mib)[rows]
    return table.names[int(rows[np.lexsort((rows, score))[0]])]
