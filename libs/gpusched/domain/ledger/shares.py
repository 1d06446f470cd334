"""Placing part of one GPU: a fraction (``milli``) or a MIG slice.

The rules of what fits are in ``gpusched.domain.sharing``; this module picks where,
reading the ledger's state and its node table, and changes nothing: ``Ledger.place``
calls ``place_share`` and ``Ledger.allocate`` commits.
"""

from __future__ import annotations

import numpy as np

from gpusched.domain.inventory import GpuRef
from gpusched.domain.sharing import (
    GpuShare,
    PodShape,
    ShareAsk,
    SharedGpu,
    can_change_layout,
    fill_layout,
)

from .model import GpuSlot, JobKind
from .requests import Placement, PlacementRequest, key_of
from .state import LedgerState

__all__ = ["place_share"]

# Best-scored nodes checked in full (memory caps, overcommit) before giving up a pool:
# the table does not know GPU memory, so a few may fail the check.
_CHECKED = 16


def place_share(
    ledger: LedgerState,
    request: PlacementRequest,
    ask: ShareAsk,
    mix: tuple[tuple[PodShape, float], ...],
) -> Placement | None:
    """Where part of one GPU goes (``mix``: the workload's typical pod shapes, which
    the score of a fraction expects next), or None."""
    if ask.mig:
        pressure = ledger._scores.pressure_of(ledger._fragmentation(mix), ledger._demand)
        return _place_slice(ledger, request, ask, pressure)
    return _place_fraction(ledger, request, ask, mix)


def _place_fraction(
    ledger: LedgerState,
    request: PlacementRequest,
    ask: ShareAsk,
    mix: tuple[tuple[PodShape, float], ...],
) -> Placement | None:
    """The GPU whose taking the fraction scores best over every node (see
    ``gpusched.domain.fragmentation``: FGD's fragmentation growth of its node, how
    tightly it packs, CPU balance, model scarcity); among a node's GPUs that score
    alike, the one with least compute left; ties between nodes in name order. Pools in
    the request's order: a later pool only when nothing fits in an earlier one."""
    assert ask.milli is not None  # a fraction
    frag = ledger._fragmentation(mix)
    scores = ledger._scores
    usable = scores.usable(
        request.models, request.cpu_milli, request.memory_mib, request.exclude_nodes
    )
    per_node, column = scores.share(frag, ask.milli, request.cpu_milli, request.memory_mib)
    score = per_node + scores.scarcity(frag, ledger._demand, ask.milli)
    training = request.kind is JobKind.TRAINING

    def fitting(row: int, col: int) -> Placement | None:
        slot = ledger._slots[scores.refs[row][col]]
        share = ask.fraction_for(slot.memory_mib)
        room = ledger._shared.get(slot.ref) or SharedGpu(slot.memory_mib)
        if ledger._share_eligible(slot, request) and room.fits_fraction(
            share, training, ask.overcommit
        ):
            return Placement(request, (slot.ref,), slot.model, slot.pool, share)
        return None

    for pool in request.pools:
        rows = np.flatnonzero(usable & scores.pools_mask((pool,)) & np.isfinite(per_node))
        for best in np.lexsort((rows, score[rows]))[:_CHECKED]:
            row = int(rows[best])
            found = fitting(row, int(column[row]))
            if found is not None:
                return found
            # Its best GPU lacks the memory: the node's others, best-scored first.
            for col in scores.share_columns(
                frag, row, ask.milli, request.cpu_milli, request.memory_mib
            ):
                found = fitting(row, col)
                if found is not None:
                    return found
    return None


def _place_slice(
    ledger: LedgerState, request: PlacementRequest, ask: ShareAsk, pressure: dict[str, float]
) -> Placement | None:
    """A free slice of the smallest profile that holds the memory, of the least scarce
    model the request accepts (``pressure``: each model's, see model scarcity), on the
    GPU with the fewest free slices; else an empty MIG-capable GPU gets a layout with
    that profile (one already in MIG first, then a free GPU on the fullest node)."""
    found, awaited = _free_slice(ledger, request, ask, pressure)
    if found is not None:
        slot, share = found
        return Placement(request, (slot.ref,), slot.model, slot.pool, share)
    if ask.now is None or awaited:
        return None
    slot_found = _empty_mig_gpu(ledger, request, ask, pressure)
    if slot_found is None:
        return None
    profile = ask.slice_profile(slot_found.model)
    assert profile is not None  # checked by _empty_mig_gpu
    layout = fill_layout(slot_found.model, profile)
    share = GpuShare(profile.milli, profile.memory_gib * 1024, profile.name, 0)
    return Placement(request, (slot_found.ref,), slot_found.model, slot_found.pool, share, layout)


def _free_slice(
    ledger: LedgerState, request: PlacementRequest, ask: ShareAsk, pressure: dict[str, float]
) -> tuple[tuple[GpuSlot, GpuShare] | None, bool]:
    """The free slice to use, and whether a slice that fits is on its way (a pending
    layout): waiting for it beats re-laying out another GPU."""
    best: tuple[tuple[float, int, GpuRef], GpuSlot, GpuShare] | None = None
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
        rank = (pressure.get(slot.model, 1.0), len(shared.free_slices()), ref)
        if best is None or rank < best[0]:
            share = GpuShare(profile.milli, profile.memory_gib * 1024, profile.name, index)
            best = (rank, slot, share)
    return (None if best is None else (best[1], best[2])), awaited


def _empty_mig_gpu(
    ledger: LedgerState, request: PlacementRequest, ask: ShareAsk, pressure: dict[str, float]
) -> GpuSlot | None:
    """An empty MIG-capable GPU whose layout may change now: of the least scarce model,
    one already in MIG first, then the one on the node with the fewest free GPUs."""
    assert ask.now is not None  # the caller's check
    empty: tuple[tuple[float, int, int, GpuRef], GpuSlot] | None = None
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
        order = (
            pressure.get(slot.model, 1.0),
            0 if current is not None else 1,
            node_free,
            slot.ref,
        )
        if empty is None or order < empty[0]:
            empty = (order, slot)
    return None if empty is None else empty[1]
