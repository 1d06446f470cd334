"""What the simulated cluster knows of itself: nodes, pools, and which GPUs serve inference.

A projection of admission's events (inventory loaded, GPUs reserved for inference and
returned, allocations released), plus the GPUs the agent runs training on, turned
into one DCGM-style sample per node.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from gpusched.contracts.messages import GpuReading, GpuSample, InventoryNode, NodeChange
from gpusched.contracts.subjects import has_node_token
from gpusched.domain.inventory import DEFAULT_GPU_MEMORY_MIB, GPU_MEMORY_MIB, GpuRef, Pool
from gpusched.simcluster.load import serving_util, training_util

# Share of a GPU's memory in use: training holds its working set; a serving replica
# holds its weights and grows its KV cache with load. Both stay under the 85% alert.
_TRAINING_MEMORY = 0.70
_SERVING_MEMORY_BASE = 0.25
_SERVING_MEMORY_PER_UTIL = 0.45


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    pool: str
    gpu_model: str
    gpus: int

    @property
    def memory_mib(self) -> int:
        return GPU_MEMORY_MIB.get(self.gpu_model, DEFAULT_GPU_MEMORY_MIB)


@dataclass
class ClusterView:
    """Mutable projection; every `apply_*` is idempotent (replaying an event is harmless)."""

    nodes: dict[str, NodeInfo] = field(default_factory=dict)
    # reservation id -> GPUs lent to inference now / lent once their allocation ends
    _lent: dict[str, set[GpuRef]] = field(default_factory=dict)
    _pending: dict[str, set[GpuRef]] = field(default_factory=dict)

    def apply_inventory(self, nodes: Iterable[InventoryNode]) -> None:
        self.nodes = {n.name: NodeInfo(n.name, n.pool, n.gpu_model, n.gpus) for n in nodes}

    def apply_node_change(self, change: NodeChange, node: InventoryNode) -> None:
        """A node that failed or was removed serves nothing and reports nothing; one
        added or recovered is back, idle, in its pool."""
        if change in (NodeChange.ADDED, NodeChange.RECOVERED):
            self.nodes[node.name] = NodeInfo(node.name, node.pool, node.gpu_model, node.gpus)
        elif change in (NodeChange.FAILED, NodeChange.REMOVED):
            self.nodes.pop(node.name, None)
            for group in (self._lent, self._pending):
                for reservation_id, refs in list(group.items()):
                    left = {ref for ref in refs if ref.node != node.name}
                    if left:
                        group[reservation_id] = left
                    else:
                        del group[reservation_id]

    def apply_reserved(
        self, reservation_id: str, gpus: Iterable[GpuRef], pending: Iterable[GpuRef]
    ) -> None:
        # `gpus` is every GPU of the reservation, `pending` the ones training still
        # holds: those serve inference only once their allocation is released.
        waiting = set(pending)
        self._lent[reservation_id] = set(gpus) - waiting
        self._pending[reservation_id] = waiting

    def apply_returned(self, reservation_id: str, gpus: Iterable[GpuRef]) -> None:
        returned = set(gpus)
        for group in (self._lent, self._pending):
            left = group.get(reservation_id, set()) - returned
            if left:
                group[reservation_id] = left
            else:
                group.pop(reservation_id, None)

    def apply_released(self, gpus: Iterable[GpuRef]) -> None:
        """An allocation ended: GPUs reserved while it held them now serve inference."""
        freed = set(gpus)
        for reservation_id, pending in list(self._pending.items()):
            moved = pending & freed
            if not moved:
                continue
            self._lent.setdefault(reservation_id, set()).update(moved)
            if pending - moved:
                self._pending[reservation_id] = pending - moved
            else:
                del self._pending[reservation_id]

    def serving_gpus(self) -> set[GpuRef]:
        """The dedicated inference pool plus the shared GPUs lent to inference."""
        serving = {
            GpuRef(node.name, index)
            for node in self.nodes.values()
            if node.pool == Pool.INFERENCE
            for index in range(node.gpus)
        }
        for lent in self._lent.values():
            serving |= lent
        return serving


def gpu_samples(
    view: ClusterView,
    training: Iterable[GpuRef],
    demand_gpus: float,
    tick: int,
    time: datetime,
    extra_models: Mapping[str, str] | None = None,
) -> list[GpuSample]:
    """One sample per node with all its GPUs (none for a node whose name cannot be a
    telemetry subject: `untelemetered_note`).

    Serving GPUs report the inference load spread over all of them; GPUs running a
    workload report training load; the rest are idle. Nodes not in the inventory but
    running a workload (`extra_models`: node -> GPU model) report the GPUs known to be busy.
    """
    serving = view.serving_gpus()
    busy = set(training)
    util_serving = serving_util(demand_gpus, len(serving))
    per_node: dict[str, tuple[str, set[int]]] = {
        n.name: (n.gpu_model, set(range(n.gpus))) for n in view.nodes.values()
    }
    for ref in busy:
        model = (extra_models or {}).get(ref.node, "")
        per_node.setdefault(ref.node, (model, set()))[1].add(ref.index)
    samples = []
    for node_name in sorted(per_node):
        if not has_node_token(node_name):
            # No telemetry subject can name it: the other nodes are sampled all the same.
            continue
        model, indices = per_node[node_name]
        memory = GPU_MEMORY_MIB.get(model, DEFAULT_GPU_MEMORY_MIB)
        readings = []
        for index in sorted(indices):
            ref = GpuRef(node_name, index)
            if ref in serving:
                util = util_serving
                used = memory * (_SERVING_MEMORY_BASE + _SERVING_MEMORY_PER_UTIL * util)
            elif ref in busy:
                util = training_util(node_name, index, tick)
                used = memory * _TRAINING_MEMORY
            else:
                util, used = 0.0, 0.0
            readings.append(
                GpuReading(
                    index=index,
                    util=round(util, 4),
                    mem_used_mib=int(used),
                    mem_total_mib=memory,
                    temp_c=round(32.0 + 45.0 * util, 1),
                    power_w=round(60.0 + 340.0 * util, 1),
                )
            )
        samples.append(GpuSample(node=node_name, time=time, gpus=readings))
    return samples
