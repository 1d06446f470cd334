"""Placing part of one GPU: a fraction (``milli``) or a MIG slice.

The rules of what fits are in ``gpusched.domain.sharing``; this module picks where,
reading the ledger's indexes, and changes nothing: ``Ledger.place`` calls
``place_share`` and ``Ledger.allocate`` commits.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import islice

from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.sharing import (
    WHOLE_GPU_MILLI,
    GpuShare,
    NodeRoom,
    PodShape,
    ShareAsk,
    SharedGpu,
    can_change_layout,
    fill_layout,
    node_fragment,
)

from .model import GpuSlot, JobKind
from .packing import SCAN_LIMIT, pack
from .requests import Placement, PlacementRequest, key_of
from .state import LedgerState

__all__ = ["place_share"]

# Tightest partly used GPUs a fraction's placement scores (and half as many on starved
# hosts, beside the free GPUs): enough to find a good node, few enough to stay fast.
_FRACTION_CANDIDATES = 8
# Of them, at most this many with the same compute left: GPUs left alike differ only
# in their nodes, and the best node is rarely among the very tightest.
_PER_LEFT = 1
# Nodes with partly used GPUs looked at, least host CPU first, for the starved ones
# (half of _FRACTION_CANDIDATES): measured on openb, 64 finds too few on a full cluster.
_STARVED_SCAN = 512

# (slot, share, compute left on it now; None for a free whole GPU)
_Candidate = tuple[GpuSlot, GpuShare, int | None]


def place_share(
    ledger: LedgerState,
    request: PlacementRequest,
    ask: ShareAsk,
    mix: Sequence[tuple[PodShape, float]],
) -> Placement | None:
    """Where part of one GPU goes (``mix``: the workload's typical pod shapes, which
    the fragmentation score of a fraction expects next), or None."""
    if ask.mig:
        return _place_slice(ledger, request, ask)
    return _place_fraction(ledger, request, ask, mix)


def _place_fraction(
    ledger: LedgerState,
    request: PlacementRequest,
    ask: ShareAsk,
    mix: Sequence[tuple[PodShape, float]],
) -> Placement | None:
    """FGD-style (Weng et al., ATC'23) on a small candidate set, so a decision stays
    well under a millisecond: the tightest partly used GPUs that fit, the partly used
    GPUs on the hosts with least CPU left (``_starved_partials``), and free GPUs
    (``_fresh_for_fraction``). The winner is the one whose node's fragmentation
    (``node_fragment`` over the recent workload mix) grows least; ties go to the
    tightest fit, so whole GPUs stay whole. Pools in the request's order: a later
    pool only when nothing fits in an earlier one."""
    candidates: list[_Candidate] = []
    for pool in request.pools:
        candidates = _fraction_candidates(ledger, request, ask, pool)
        if candidates:
            break
    else:
        return None

    def rank(candidate: _Candidate) -> tuple[float, int, GpuRef]:
        slot, _, left = candidate
        growth = _fragment_growth(ledger, slot, left, request, mix) if len(candidates) > 1 else 0
        return (growth, WHOLE_GPU_MILLI if left is None else left, slot.ref)

    slot, share, _ = min(candidates, key=rank)
    return Placement(request, (slot.ref,), slot.model, slot.pool, share)


def _fraction_candidates(
    ledger: LedgerState, request: PlacementRequest, ask: ShareAsk, pool: Pool
) -> list[_Candidate]:
    assert ask.milli is not None  # a fraction
    candidates = _tightest_candidates(ledger, request, ask, pool)
    seen = {slot.ref for slot, _, _ in candidates}
    for ref in _starved_partials(ledger, request, ask.milli):
        slot = ledger._slots[ref]
        if ref not in seen and slot.pool is pool:
            candidates.extend(_partial(ledger, slot, request, ask))
    for slot in _fresh_for_fraction(ledger, request, pool, candidates):
        share = ask.fraction_for(slot.memory_mib)
        training = request.kind is JobKind.TRAINING
        if ledger._share_eligible(slot, request) and SharedGpu(slot.memory_mib).fits_fraction(
            share, training, ask.overcommit
        ):
            candidates.append((slot, share, None))
    return candidates


def _partial(
    ledger: LedgerState, slot: GpuSlot, request: PlacementRequest, ask: ShareAsk
) -> list[_Candidate]:
    """The partly used ``slot`` as a candidate, if the fraction fits it."""
    share = ask.fraction_for(slot.memory_mib)
    shared = ledger._shared[slot.ref]
    training = request.kind is JobKind.TRAINING
    if ledger._share_eligible(slot, request) and shared.fits_fraction(
        share, training, ask.overcommit
    ):
        return [(slot, share, WHOLE_GPU_MILLI - shared.milli_used)]
    return []


def _tightest_candidates(
    ledger: LedgerState, request: PlacementRequest, ask: ShareAsk, pool: Pool
) -> list[_Candidate]:
    assert ask.milli is not None  # a fraction
    keys = [key for key in ledger._fractions.by_left if key[0] is pool and request.accepts(key[1])]
    candidates: list[_Candidate] = []
    # Bounded like pack: past SCAN_LIMIT GPUs examined (shared GPUs whose hosts are
    # full, say) other candidates are the better use of the decision's time.
    examined = 0
    for group in _tightest_shared(ledger, keys, ask.milli):
        taken = 0
        for ref in group:
            examined += 1
            found = _partial(ledger, ledger._slots[ref], request, ask)
            candidates.extend(found)
            taken += len(found)
            if taken >= _PER_LEFT or examined >= SCAN_LIMIT:
                break
        if examined >= SCAN_LIMIT or len(candidates) >= _FRACTION_CANDIDATES:
            break
    return candidates


def _tightest_shared(
    ledger: LedgerState, keys: Sequence[tuple[Pool, str]], milli: int
) -> Iterator[Iterator[GpuRef]]:
    """Fractional GPUs with at least ``milli`` compute left, grouped by compute left,
    least left first."""
    fractions = ledger._fractions
    lefts = sorted(
        {
            left
            for key in keys
            for left in fractions.lefts[key][bisect_left(fractions.lefts[key], milli) :]
        }
    )
    for left in lefts:
        yield (ref for key in keys for ref in fractions.by_left[key].get(left, ()))


def _starved_partials(
    ledger: LedgerState, request: PlacementRequest, milli: int
) -> Iterator[GpuRef]:
    """On the nodes with partly used GPUs whose host has the least CPU left that still
    feeds the request, the tightest GPU that holds ``milli``. A fraction there costs
    the least: what those hosts have left is already too little for larger pods."""
    fractions = ledger._fractions
    start = bisect_left(fractions.by_cpu, (request.cpu_milli, ""))
    found = 0
    for _, node in islice(fractions.by_cpu, start, start + _STARVED_SCAN):
        room = ledger._hosts[node]
        if room.memory_free < request.memory_mib or node in request.exclude_nodes:
            continue
        fits = [(left, ref) for ref, left in fractions.node_lefts[node].items() if left >= milli]
        if fits:
            yield min(fits)[1]
            found += 1
            if found >= _FRACTION_CANDIDATES // 2:
                return


def _fresh_for_fraction(
    ledger: LedgerState,
    request: PlacementRequest,
    pool: Pool,
    partials: Sequence[_Candidate],
) -> list[GpuSlot]:
    """Free GPUs of ``pool`` a fraction may start sharing: one per node among the
    partials' nodes, the nodes that took fractions last (so fractions gather on few
    nodes, as first fit's do), an empty node, and ``pack``'s choice."""
    index = ledger._index
    keys = [key for key in index.free if key[0] is pool and request.accepts(key[2])]
    nodes = dict.fromkeys(slot.ref.node for slot, _, _ in partials)
    nodes.update(dict.fromkeys(reversed(ledger._fractions.recent_nodes)))
    fresh: list[GpuSlot] = []
    for key in keys:
        by_node = index.free[key]
        for node in nodes:
            free = by_node.get(node)
            if free and node not in request.exclude_nodes:
                fresh.append(free[min(free)])
        # One node of each (free GPUs, host size) class: the index's buckets.
        for by_shape in index.buckets.get(key, {}).values():
            for shaped in by_shape.values():
                for node in shaped:
                    if node not in request.exclude_nodes:
                        free = by_node[node]
                        fresh.append(free[min(free)])
                        break
    chosen = pack(ledger, replace(request, share=None, pools=(pool,)))
    if chosen is not None:
        fresh.append(ledger._slots[chosen[0]])
    return list({slot.ref: slot for slot in fresh}.values())


def _fragment_growth(
    ledger: LedgerState,
    slot: GpuSlot,
    left: int | None,
    request: PlacementRequest,
    mix: Sequence[tuple[PodShape, float]],
) -> float:
    """How much the fraction would grow its node's expected fragment, in milli."""
    node = slot.ref.node
    host = ledger._hosts.get(node)
    room = NodeRoom(
        len(ledger._index.on_node(key_of(slot), node)),
        tuple(ledger._fractions.node_lefts.get(node, {}).values()),
        None if host is None else host.cpu_free,
        None if host is None else host.memory_free,
    )
    assert request.share is not None and request.share.milli is not None  # a fraction
    after = room.taking(left, request.share.milli, request.cpu_milli, request.memory_mib)
    return node_fragment(after, mix) - node_fragment(room, mix)


def _place_slice(ledger: LedgerState, request: PlacementRequest, ask: ShareAsk) -> Placement | None:
    """A free slice of the smallest profile that holds the memory, on the GPU with the
    fewest free slices; else an empty MIG-capable GPU gets a layout with that profile
    (one already in MIG first, then a free GPU on the fullest node)."""
    found, awaited = _free_slice(ledger, request, ask)
    if found is not None:
        slot, share = found
        return Placement(request, (slot.ref,), slot.model, slot.pool, share)
    if ask.now is None or awaited:
        return None
    slot_found = _empty_mig_gpu(ledger, request, ask)
    if slot_found is None:
        return None
    profile = ask.slice_profile(slot_found.model)
    assert profile is not None  # checked by _empty_mig_gpu
    layout = fill_layout(slot_found.model, profile)
    share = GpuShare(profile.milli, profile.memory_gib * 1024, profile.name, 0)
    return Placement(request, (slot_found.ref,), slot_found.model, slot_found.pool, share, layout)


def _free_slice(
    ledger: LedgerState, request: PlacementRequest, ask: ShareAsk
) -> tuple[tuple[GpuSlot, GpuShare] | None, bool]:
    """The free slice to use, and whether a slice that fits is on its way (a pending
    layout): waiting for it beats re-laying out another GPU."""
    best: tuple[tuple[int, GpuRef], GpuSlot, GpuShare] | None = None
    awaited = False
    for ref, shared in ledger._shared.items():
        slot = ledger._slots.get(ref)
        if slot is None or not shared.mig or not ledger._share_eligible(slot, request):
            continue
        profile = ask.slice_profile(slot.model)
        index = None if profile is None else shared.free_slice(profile.name)
        if profile is None or index is None:
            continue
        if shared.pending:
            awaited = True
            continue
        rank = (len(shared.free_slices()), ref)
        if best is None or rank < best[0]:
            share = GpuShare(profile.milli, profile.memory_gib * 1024, profile.name, index)
            best = (rank, slot, share)
    return (None if best is None else (best[1], best[2])), awaited


def _empty_mig_gpu(ledger: LedgerState, request: PlacementRequest, ask: ShareAsk) -> GpuSlot | None:
    """An empty MIG-capable GPU whose layout may change now: one already in MIG first,
    then the one on the node with the fewest free GPUs."""
    assert ask.now is not None  # the caller's check
    empty: tuple[tuple[int, int, GpuRef], GpuSlot] | None = None
    for slot in ledger._slots.values():
        current = ledger._shared.get(slot.ref)
        if (
            not slot.mig_enabled
            or not ledger._share_eligible(slot, request)
            or (current is not None and not current.empty)
            or ask.slice_profile(slot.model) is None
            or not can_change_layout(ledger._layout_at.get(slot.ref), ask.now, ask.change_interval)
        ):
            continue
        node_free = len(ledger._index.on_node(key_of(slot), slot.ref.node))
        order = (0 if current is not None else 1, node_free, slot.ref)
        if empty is None or order < empty[0]:
            empty = (order, slot)
    return None if empty is None else empty[1]
