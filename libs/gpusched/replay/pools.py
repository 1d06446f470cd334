"""The cluster of a replay: which nodes it has, and which are dedicated to inference.

Pure. ``sample`` keeps a share of an inventory's nodes with the same mix of GPU models
and node sizes; ``split`` labels whole nodes INFERENCE until the inference pool holds
(as close as whole nodes allow) the GPUs asked, taking every model in proportion so
that neither pool is left with the scarce models alone; the rest is SHARED.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from gpusched.domain.inventory import Inventory, NodeSpec, Pool

__all__ = ["pool_gpus", "sample", "smallest_share", "split"]


def sample(inventory: Inventory, share: float) -> Inventory:
    """About ``share`` of the nodes of each (GPU model, GPUs per node) kind, in order
    (none at all when the share is too small for any kind: see ``smallest_share``)."""
    if not 0 < share <= 1:
        raise ValueError(f"the share of nodes kept must be within (0, 1], got {share}")
    kept: list[NodeSpec] = []
    for nodes in _kinds(inventory).values():
        wanted = round(len(nodes) * share)
        # Spread over the kind's list (every k-th node), not its first few.
        kept.extend(nodes[int(i * len(nodes) / wanted)] for i in range(wanted))
    order = {node.name: i for i, node in enumerate(inventory.nodes)}
    return Inventory(tuple(sorted(kept, key=lambda node: order[node.name])))


def smallest_share(inventory: Inventory) -> float:
    """A share for which ``sample`` keeps a node: 1/n for the n nodes of the most common
    kind (0.5/n would round half to even, i.e. to none)."""
    most = max((len(nodes) for nodes in _kinds(inventory).values()), default=0)
    return 1.0 if most == 0 else 1 / most


def _kinds(inventory: Inventory) -> dict[tuple[str, int], list[NodeSpec]]:
    kinds: dict[tuple[str, int], list[NodeSpec]] = defaultdict(list)
    for node in inventory.nodes:
        kinds[(node.gpus[0].model, len(node.gpus))].append(node)
    return kinds


def split(inventory: Inventory, inference_gpus: int) -> Inventory:
    """The inventory with whole nodes in the INFERENCE pool for ``inference_gpus`` GPUs
    (closest whole-node total, models in proportion), every other node SHARED."""
    total = inventory.total_gpus
    if not 0 <= inference_gpus <= total:
        raise ValueError(f"cannot dedicate {inference_gpus} of {total} GPUs to inference")
    by_model: dict[str, list[NodeSpec]] = defaultdict(list)
    for node in inventory.nodes:
        by_model[node.gpus[0].model].append(node)
    chosen: set[str] = set()
    taken = 0
    # Largest models first; within a model the smallest nodes first, so the pool can land
    # close to its share, and the big nodes stay for training gangs.
    for nodes in sorted(by_model.values(), key=lambda ns: -sum(len(n.gpus) for n in ns)):
        share = inference_gpus * sum(len(n.gpus) for n in nodes) / total if total else 0
        got = 0
        for node in sorted(nodes, key=lambda n: (len(n.gpus), n.name)):
            if got + len(node.gpus) / 2 > share or taken + len(node.gpus) > inference_gpus:
                continue
            chosen.add(node.name)
            got += len(node.gpus)
            taken += len(node.gpus)
    # Whatever the proportional pass left (rounding on few nodes): nearest fits, any model.
    for node in sorted(inventory.nodes, key=lambda n: (len(n.gpus), n.name)):
        if node.name not in chosen and taken + len(node.gpus) <= inference_gpus:
            chosen.add(node.name)
            taken += len(node.gpus)
    return Inventory(
        tuple(
            replace(node, pool=Pool.INFERENCE if node.name in chosen else Pool.SHARED)
            for node in inventory.nodes
        )
    )


def pool_gpus(inventory: Inventory, pool: Pool) -> int:
    return inventory.gpus_in(pool)
