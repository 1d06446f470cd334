"""Whole-GPU placement: gpusched's packing (``pack``, on the ledger's index) and the
plain ``first_fit`` strategy it is measured against."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from gpusched.domain.inventory import GpuRef
from gpusched.domain.placement import choose_in_node, stranded

from .model import GpuSlot
from .requests import GangKey, PlacementRequest, gangs, host_per_gpu, tier
from .state import LedgerState

__all__ = ["SCAN_LIMIT", "first_fit", "pack"]

# Candidates examined per decision once one is found that fits: bounds the cost of a
# decision on a large cluster; any of them is a valid best fit by GPU count.
SCAN_LIMIT = 64


def first_fit(
    free_by_node: Mapping[str, Sequence[GpuSlot]], request: PlacementRequest
) -> tuple[GpuRef, ...] | None:
    """Whole GPUs: the first node in name order that fits the gang, else span nodes.

    A gang never mixes GPU models, serving pools, or own and lent GPUs: a mixed-model
    gang runs at the slowest GPU's pace, and a gang partly on lent or shared GPUs could
    only be partly given back or evicted. Preference between such groups: the order of
    ``request.pools``, then a pool's own GPUs before lent ones (which keeps lent GPUs
    idle and easy to return). One node in a less preferred group still beats spanning
    nodes in a preferred one, since crossing nodes costs every training step.
    """
    wanted = request.gpus
    nodes = sorted(free_by_node)
    groups = {node: gangs(free_by_node[node]) for node in nodes}
    tiers = sorted({tier(key, request) for by_key in groups.values() for key in by_key})
    for rank in tiers:
        for node in nodes:
            for key, group in groups[node].items():
                if tier(key, request) == rank and len(group) >= wanted:
                    return tuple(slot.ref for slot in group[:wanted])
    if not request.may_span_nodes:
        return None
    # All-or-nothing: partial gathers are discarded unless one reaches the full count.
    for rank in tiers:
        gathered: dict[GangKey, list[GpuRef]] = {}
        for node in nodes:
            for key, group in groups[node].items():
                if tier(key, request) != rank:
                    continue
                refs = gathered.setdefault(key, [])
                refs.extend(slot.ref for slot in group[: wanted - len(refs)])
                if len(refs) == wanted:
                    return tuple(refs)
    return None


def pack(ledger: LedgerState, request: PlacementRequest) -> tuple[GpuRef, ...] | None:
    """gpusched's placement: whole GPUs, all or nothing, packed to keep big holes whole.

    In order: one group (NVLink island / NUMA node) of one node, then one node, then,
    if the job allows it, across nodes. Among single nodes, best fit: the node with the
    fewest free GPUs that still fits, so empty nodes stay empty for whole-node gangs;
    ties go to the placement that strands fewest GPUs (leaves them without host CPU or
    memory). Across nodes: the fewest nodes, the remainder on the tightest fit. Pool
    preference (``request.pools`` order, a pool's own GPUs before lent ones) ranks first,
    as in ``first_fit``.
    """
    keys = [
        key for key in ledger._index.free if key[0] in request.pools and request.accepts(key[2])
    ]
    tiers = sorted({tier(key, request) for key in keys})
    by_tier = {rank: [key for key in keys if tier(key, request) == rank] for rank in tiers}
    for rank in tiers:
        found = _best_node(ledger, by_tier[rank], request)
        if found is not None:
            return found
    if request.may_span_nodes:
        for rank in tiers:
            for key in by_tier[rank]:
                found = _fewest_nodes(ledger, key, request)
                if found is not None:
                    return found
    return None


def _best_node(
    ledger: LedgerState, keys: Sequence[GangKey], request: PlacementRequest
) -> tuple[GpuRef, ...] | None:
    wanted = request.gpus
    cpu, memory = host_per_gpu(request)
    free_index = ledger._index
    largest = max((max(free_index.buckets[key], default=0) for key in keys), default=0)
    best: tuple[tuple[int, bool, int, int], str, tuple[int, ...]] | None = None
    examined = 0
    for count in range(wanted, largest + 1):
        shapes = sorted(
            (shape, key) for key in keys for shape in free_index.buckets[key].get(count, ())
        )
        for shape, key in shapes:
            for node in free_index.buckets[key][count][shape]:
                if node in request.exclude_nodes:
                    continue
                if ledger._host_feeds(node, cpu, memory, wanted) < wanted:
                    continue
                free = sorted(free_index.free[key][node])
                chosen, in_group = choose_in_node(free, wanted, ledger._groups.get(node, ()))
                room = ledger._hosts.get(node)
                total = ledger._node_gpus[node]
                after = (
                    None
                    if room is None
                    else replace(
                        room,
                        cpu_free=room.cpu_free - wanted * cpu,
                        memory_free=room.memory_free - wanted * memory,
                    )
                )
                strands = stranded(count - wanted, after, total) - stranded(count, room, total)
                score = (0 if in_group else 1, strands > 0, count, strands)
                if best is None or score < best[0]:
                    best = (score, node, chosen)
                if in_group and strands <= 0:
                    # Buckets run tightest first: nothing later can beat this one.
                    return tuple(GpuRef(node, index) for index in chosen)
                examined += 1
                if examined >= SCAN_LIMIT:
                    return tuple(GpuRef(best[1], index) for index in best[2])
    if best is None:
        return None
    return tuple(GpuRef(best[1], index) for index in best[2])


def _fewest_nodes(
    ledger: LedgerState, key: GangKey, request: PlacementRequest
) -> tuple[GpuRef, ...] | None:
    wanted = request.gpus
    cpu, memory = host_per_gpu(request)
    usable: list[tuple[int, str]] = []
    for node, free in ledger._index.free[key].items():
        if node in request.exclude_nodes:
            continue
        fed = ledger._host_feeds(node, cpu, memory, len(free))
        if fed:
            usable.append((fed, node))
    if sum(fed for fed, _ in usable) < wanted:
        return None
    usable.sort(key=lambda item: (-item[0], item[1]))
    chosen: list[GpuRef] = []
    remaining = wanted
    position = 0
    while remaining:
        fed, node = usable[position]
        if fed >= remaining:
            # The remainder goes on the tightest node that holds it whole.
            fed, node = min(
                (item for item in usable[position:] if item[0] >= remaining),
                key=lambda item: (item[0], item[1]),
            )
            take = remaining
        else:
            take = fed
            position += 1
        indices = sorted(ledger._index.free[key][node])
        picked, _ = choose_in_node(indices, take, ledger._groups.get(node, ()))
        chosen.extend(GpuRef(node, index) for index in picked)
        remaining -= take
    return tuple(sorted(chosen))
