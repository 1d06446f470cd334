"""Node objects as gpusched inventory, and what admission must be told to match them.

Pure: `observe(node)` reads a Node into what gpusched needs (its GPUs, pool, state),
`reconcile(cluster, admission)` compares the cluster with admission's inventory and
says which node lifecycle changes admission should make (add, drain, undrain, fail,
recover, remove). The agent runs these as the nodes API and `node.health` events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from gpusched.contracts.messages import NodeState
from gpusched.domain.inventory import GPU_MEMORY_MIB, InventoryError, Pool, parse_inventory

from . import labels as L
from .quantity import QuantityError, count, mebibytes, milli

# GPU feature discovery product names -> the model names gpusched prices and places by.
# A product not listed keeps its GFD name (then the node must carry nvidia.com/gpu.memory).
PRODUCT_MODELS: Mapping[str, str] = {
    "NVIDIA-A100-SXM4-80GB": "A100-80GB",
    "NVIDIA-A100-80GB-PCIe": "A100-80GB",
    "NVIDIA-A100-SXM4-40GB": "A100-40GB",
    "NVIDIA-A100-PCIE-40GB": "A100-40GB",
    "NVIDIA-H100-80GB-HBM3": "H100-80GB",
    "NVIDIA-H100-PCIe": "H100-80GB",
    "NVIDIA-A10": "A10",
    "Tesla-T4": "T4",
    "Tesla-V100-SXM2-16GB": "V100M16",
    "Tesla-V100-SXM2-32GB": "V100M32",
}


class NodeProblem(ValueError):
    """A GPU node gpusched cannot use as it is labelled (the message says what to fix)."""


@dataclass(frozen=True, slots=True)
class ObservedNode:
    name: str
    spec: dict[str, Any]  # one node in the inventory YAML shape (AddNode.spec)
    ready: bool
    why_not_ready: str
    cordoned: bool
    deleting: bool
    mig_config: str | None = None
    mig_config_state: str | None = None

    @property
    def pool(self) -> str:
        return str(self.spec["pool"])

    @property
    def gpus(self) -> int:
        return int(self.spec["gpus"])


def observe(
    node: Mapping[str, Any], pool_label: str, models: Mapping[str, str] | None = None
) -> ObservedNode | None:
    """What gpusched sees of a Node; None for a node it does not manage (no pool label,
    or no GPUs: CPU nodes stay with the default scheduler). NodeProblem for a node in a
    pool that gpusched cannot use (an unknown pool, an unreadable size)."""
    meta = node.get("metadata") or {}
    name = str(meta.get("name", ""))
    node_labels: Mapping[str, str] = meta.get("labels") or {}
    pool = node_labels.get(pool_label)
    if pool is None:
        return None
    status = node.get("status") or {}
    allocatable: Mapping[str, Any] = status.get("allocatable") or status.get("capacity") or {}
    try:
        gpus = _gpu_count(allocatable, node_labels)
        if gpus == 0:
            return None
        cpu = milli(allocatable.get("cpu", "0"))
        memory = mebibytes(allocatable.get("memory", "0"))
    except QuantityError as exc:
        raise NodeProblem(f"node {name}: {exc}") from None
    product = node_labels.get(L.GFD_PRODUCT, "")
    model = {**PRODUCT_MODELS, **(models or {})}.get(product, product) or "unknown"
    spec: dict[str, Any] = {
        "name": name,
        "pool": pool,
        "gpu_model": model,
        "gpus": gpus,
        "cpu_milli": max(cpu, 1),
        "memory_mib": max(memory, 1),
    }
    if L.GFD_MEMORY in node_labels:
        try:
            spec["gpu_memory_mib"] = count(node_labels[L.GFD_MEMORY])
        except QuantityError as exc:
            raise NodeProblem(f"node {name}: label {L.GFD_MEMORY}: {exc}") from None
    elif model not in GPU_MEMORY_MIB:
        raise NodeProblem(
            f"node {name}: GPU product {product or '(no ' + L.GFD_PRODUCT + ' label)'} is "
            f"unknown and the node has no {L.GFD_MEMORY} label: run GPU feature discovery, "
            "or name the model in GPUSCHED_AGENT__KUBERNETES__GPU_MODELS"
        )
    if any(key.startswith(L.MIG_RESOURCE_PREFIX) for key in allocatable):
        spec["mig"] = True
    elif node_labels.get(L.GFD_MIG_CAPABLE) == "false":
        spec["mig"] = False  # GPU feature discovery says so, whatever the model could do
    try:
        parse_inventory({"nodes": [spec]})
    except InventoryError as exc:
        raise NodeProblem(f"node {name}: {exc}") from None
    ready, why = _readiness(status)
    return ObservedNode(
        name=name,
        spec=spec,
        ready=ready,
        why_not_ready=why,
        cordoned=bool((node.get("spec") or {}).get("unschedulable")),
        deleting="deletionTimestamp" in meta,
        mig_config=node_labels.get(L.MIG_CONFIG),
        mig_config_state=node_labels.get(L.MIG_CONFIG_STATE),
    )


def _gpu_count(allocatable: Mapping[str, Any], node_labels: Mapping[str, str]) -> int:
    """The node's physical GPUs. With MIG (mixed strategy) a GPU in MIG mode leaves the
    nvidia.com/gpu count for its slices' resources, and with DRA none is advertised at
    all; GPU feature discovery still counts them all. Whichever is larger: a MIG layout
    change must not look like GPUs gone (which would drain the node)."""
    advertised = count(allocatable[L.GPU_RESOURCE]) if L.GPU_RESOURCE in allocatable else 0
    discovered = count(node_labels[L.GFD_COUNT]) if L.GFD_COUNT in node_labels else 0
    return max(advertised, discovered)


def _readiness(status: Mapping[str, Any]) -> tuple[bool, str]:
    for condition in status.get("conditions") or []:
        if condition.get("type") == "Ready":
            if condition.get("status") == "True":
                return True, ""
            reason = condition.get("reason") or "NotReady"
            message = condition.get("message") or ""
            return (
                False,
                f"Ready={condition.get('status')} ({reason}{': ' + message if message else ''})",
            )
    return False, "no Ready condition yet"


# --- reconciling admission's inventory with the cluster ---------------------------------
class Action(StrEnum):
    ADD = "add"
    DRAIN = "drain"
    UNDRAIN = "undrain"
    FAIL = "fail"  # a node.health report: unhealthy
    RECOVER = "recover"  # a node.health report: healthy
    REMOVE = "remove"


@dataclass(frozen=True, slots=True)
class KnownNode:
    """A node as admission has it (from its inventory events)."""

    spec: dict[str, Any]
    state: NodeState


@dataclass(frozen=True, slots=True)
class NodeAction:
    action: Action
    node: str
    reason: str
    spec: dict[str, Any] | None = None  # for ADD


def same_spec(known: Mapping[str, Any], observed: Mapping[str, Any]) -> bool:
    """Whether admission's node is the cluster's: what placement relies on (pool, GPU
    model and count). CPU and memory drift (a kubelet reserving more) changes nothing."""
    return all(known.get(k) == observed.get(k) for k in ("pool", "gpu_model", "gpus"))


def reconcile(
    cluster: Mapping[str, ObservedNode], admission: Mapping[str, KnownNode]
) -> list[NodeAction]:
    """The changes that bring admission's inventory to the cluster's nodes, one step per
    node (the next step follows once admission's event shows the first applied):

    - a GPU node in a gpusched pool that admission lacks is added;
    - cordoned (`kubectl cordon`, `kubectl drain`) -> drained, uncordoned -> undrained;
    - not Ready -> failed (its allocations end, training requeues from its checkpoint),
      Ready again -> recovered;
    - deleted (or being deleted) -> failed, then removed;
    - its pool, GPU model or count changed -> drained, removed once empty, added anew.
    """
    actions: list[NodeAction] = []
    for name in sorted(set(cluster) | set(admission)):
        observed, known = cluster.get(name), admission.get(name)
        if known is None:
            if observed is not None and not observed.deleting:
                actions.append(
                    NodeAction(Action.ADD, name, "a GPU node of the cluster", observed.spec)
                )
            continue
        if observed is None or observed.deleting:
            gone = "deleted from the cluster"
            if known.state is not NodeState.FAILED:
                actions.append(NodeAction(Action.FAIL, name, gone))
            else:
                actions.append(NodeAction(Action.REMOVE, name, gone))
            continue
        if not same_spec(known.spec, observed.spec):
            why = (
                f"its labels changed (pool {known.spec.get('pool')} -> {observed.pool}, "
                f"{known.spec.get('gpus')} -> {observed.gpus} GPUs)"
            )
            if known.state is NodeState.UP:
                actions.append(NodeAction(Action.DRAIN, name, why))
            else:
                actions.append(NodeAction(Action.REMOVE, name, why))
            continue
        if not observed.ready:
            if known.state is not NodeState.FAILED:
                actions.append(NodeAction(Action.FAIL, name, observed.why_not_ready))
            continue
        if known.state is NodeState.FAILED:
            actions.append(NodeAction(Action.RECOVER, name, "Ready again"))
        elif observed.cordoned and known.state is NodeState.UP:
            actions.append(NodeAction(Action.DRAIN, name, "cordoned"))
        elif not observed.cordoned and known.state is NodeState.DRAINED:
            actions.append(NodeAction(Action.UNDRAIN, name, "uncordoned"))
    return actions


def known_from_wire(name: str, pool: str, gpu_model: str, gpus: int, state: NodeState) -> KnownNode:
    return KnownNode({"name": name, "pool": pool, "gpu_model": gpu_model, "gpus": gpus}, state)


def pool_of(value: str) -> Pool | None:
    try:
        return Pool(value)
    except ValueError:
        return None
