"""Finding a queued job its GPUs under quota, and saying in words why it waits.

The scheduling pass and `gpusched why <job>` use the same function, so the words an
engineer reads are the reasons the scheduler acted on. Pure: ledger, catalog and usage
in, a placement or reasons out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from gpusched.domain.ledger import Ledger, Placement, PlacementRequest, default_pools

from .catalog import Catalog
from .index import FairOrder, QueueIndex
from .queue import Usage
from .store import JobRecord
from .words import models_words


@dataclass(frozen=True, slots=True)
class Attempt:
    placement: Placement | None
    borrowed: bool = False
    reasons: tuple[str, ...] = field(default=())


def find(
    ledger: Ledger,
    catalog: Catalog,
    job: JobRecord,
    usage: Mapping[tuple[str, str], int],
    *,
    count: int | None = None,
    held: frozenset[str] = frozenset(),
    now: datetime | None = None,
) -> Attempt:
    """GPUs for ``job`` that its team's quota allows, or the reasons there are none.

    ``count`` overrides the asked number (a long-waiting job offered fewer); ``held``
    nodes are reserved for another job and not used. Without ``now`` a MIG slice is
    sought only in the layouts GPUs have (no layout change). The ledger chooses among
    the models the job accepts; a model its team's quota refuses is left out and the
    ledger asked again.
    """
    reasons: list[str] = []
    count = job.gpus.count if count is None else count
    share = catalog.share_ask(job.ask, now)
    host = job.ask.host
    cpu, memory = (0, 0) if host is None else (host.cpu_milli, host.memory_mib)
    models = catalog.models_to_try(job.ask)
    # A MIG slice goes by model, smallest MIG GPUs first; anything else asks once for
    # every model it accepts.
    asks = [(model,) for model in models] if share is not None and share.mig else [models]
    for ask in asks:
        accepted = list(ask)
        while True:
            request = PlacementRequest(
                job.job_id, job.kind, count, exclude_nodes=held, share=share,
                models=tuple(accepted), cpu_milli=cpu, memory_mib=memory,
            )  # fmt: skip
            placement = ledger.place(request)
            if placement is None:
                reasons.append(_no_room(ledger, request) if share is None else _no_share(request))
                break
            if catalog.quotas is None or not count:
                return Attempt(placement)
            decision = catalog.quotas.decide(job.team, placement.model, count, usage)
            if decision.allowed:
                return Attempt(placement, borrowed=decision.borrowed)
            reasons.append(
                f"quota: team {job.team} holds {decision.used} {placement.model} GPUs; "
                f"{count} more would pass its max of {decision.quota.max} "
                f"(guaranteed {decision.quota.guaranteed}); it waits until the team frees some"
            )
            if not accepted:
                accepted = [m for m in catalog.models if m != placement.model]
            else:
                accepted.remove(placement.model)
            if not accepted:
                break
    if not reasons:
        reasons.append("no GPU model in the inventory fits the request")
    return Attempt(None, reasons=tuple(reasons))


def _no_share(request: PlacementRequest) -> str:
    share = request.share
    assert share is not None
    model = models_words(request.models)
    pools = "/".join(request.pools)
    if share.mig:
        return (
            f"capacity: no free MIG slice of {model} in the {pools} pools holds "
            f"{share.memory_mib} MiB, and no empty MIG GPU may change its layout now (a GPU's "
            "layout changes at most once per interval, and only while no job runs on it)"
        )
    return (
        f"capacity: no {model} GPU in the {pools} pools has {share.milli} milli of compute "
        "and the memory left (fractional tenants share a GPU up to 1000 milli and the "
        "memory overcommit factor), and no whole GPU is free to start sharing"
    )


def _no_room(ledger: Ledger, request: PlacementRequest) -> str:
    if not request.gpus:
        return (
            f"capacity: no node of the {'/'.join(request.pools)} pools has "
            f"{request.cpu_milli / 1000:g} CPU cores and {request.memory_mib} MiB of host "
            "memory left; it waits for running jobs to end"
        )
    model = models_words(request.models)
    free_by_node: dict[str, int] = {}
    for pool in request.pools or default_pools(request.kind):
        for ref in ledger.free_gpus(pool):
            if request.accepts(ledger.gpu(ref).model):
                free_by_node[ref.node] = free_by_node.get(ref.node, 0) + 1
    total = sum(free_by_node.values())
    largest = max(free_by_node.values(), default=0)
    pools = "/".join(request.pools or default_pools(request.kind))
    if total < request.gpus:
        return (
            f"capacity: {request.gpus} x {model} wanted, {total} free in the {pools} pools; "
            "it waits for running jobs to end or for GPUs to come back from inference"
        )
    return (
        f"fragmentation: {total} x {model} are free in the {pools} pools, but split so "
        f"that no gang of {request.gpus} can be formed (largest on one node: {largest}; "
        "a gang never mixes pools, models, or own and lent GPUs)"
    )


def reservation_target(
    ledger: Ledger, catalog: Catalog, job: JobRecord, held: frozenset[str]
) -> str | None:
    """The node a starving gang should collect freeing GPUs on: the one of its models and
    pools with the most free GPUs already (the shortest wait to complete the gang)."""
    best: tuple[int, str] | None = None
    wanted = set(catalog.models_to_try(job.ask))
    if not job.gpus.count:
        return None  # a job without GPUs waits for host room, not for a gang's GPUs
    for pool in default_pools(job.kind):
        counts: dict[str, int] = {}
        for ref in ledger.free_gpus(pool):
            model = ledger.gpu(ref).model
            if ref.node not in held and (not wanted or model in wanted):
                counts[ref.node] = counts.get(ref.node, 0) + 1
        for node, free in counts.items():
            if best is None or (free, node) > (best[0], best[1]):
                best = (free, node)
    return None if best is None else best[1]


def fair_order(jobs: Sequence[JobRecord], ledger: Ledger, usage: Usage) -> Iterator[JobRecord]:
    """Queued jobs in the scheduling pass's order (see queue.FairOrder): by priority
    class, then DRF across teams, then first in first out.

    Lazily: between two jobs the caller may add a placement to ``usage``, and the next
    pick sees the team's new dominant share.
    """
    return iter(FairOrder.of(QueueIndex(jobs), ledger, usage))
