"""GPU inventory: which nodes exist, which pool each belongs to, and their GPUs.

Pure parsing only: callers read YAML or CSV files and hand over the parsed data or
the text lines, so the same functions serve the services, the simulator and replay.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "DEFAULT_GPU_MEMORY_MIB",
    "GPU_MEMORY_MIB",
    "GpuRef",
    "GpuSpec",
    "Inventory",
    "InventoryError",
    "NodeSpec",
    "Pool",
    "parse_inventory",
    "parse_openb_node_csv",
]


class Pool(StrEnum):
    INFERENCE = "inference"
    SHARED = "shared"
    # Dedicated training capacity, never lent to inference.
    TRAINING = "training"


# Nominal memory per GPU model. The openb trace names G1-G3 without disclosing them,
# so they fall back to the default; nodes from YAML may always state it explicitly.
GPU_MEMORY_MIB: Mapping[str, int] = {
    "A10": 24_576,
    "A100-40GB": 40_960,
    "A100-80GB": 81_920,
    "H100-80GB": 81_920,
    "P100": 16_384,
    "T4": 16_384,
    "V100M16": 16_384,
    "V100M32": 32_768,
}
DEFAULT_GPU_MEMORY_MIB = 16_384


class InventoryError(ValueError):
    """The inventory data is malformed; the message names the offending entry."""


@dataclass(frozen=True, slots=True, order=True)
class GpuRef:
    """Identity of one whole GPU. Ordering is (node, index): the placement order."""

    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}/{self.index}"


@dataclass(frozen=True, slots=True)
class GpuSpec:
    node: str
    index: int
    model: str
    memory_mib: int

    @property
    def ref(self) -> GpuRef:
        return GpuRef(self.node, self.index)


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    pool: Pool
    gpus: tuple[GpuSpec, ...]
    cpu_milli: int
    memory_mib: int
    # GPU indices that talk over NVLink, and GPUs per NUMA node; both optional. A gang
    # inside one group avoids PCIe/inter-socket hops on every collective.
    nvlink_islands: tuple[tuple[int, ...], ...] = ()
    numa: tuple[tuple[int, ...], ...] = ()
    # MIG on or off for the node's GPUs; None: as the GPU model's MIG table says.
    mig: bool | None = None
    # Local disk for jobs' scratch data and checkpoints (0: not stated). Recorded and
    # shown; placement does not hold disk per job.
    disk_gib: int = 0

    def __post_init__(self) -> None:
        if not self.gpus:
            raise InventoryError(f"node {self.name!r} has no GPUs")
        for gpu in self.gpus:
            if gpu.node != self.name:
                raise InventoryError(f"GPU {gpu.ref} is listed under node {self.name!r}")
        if len({gpu.index for gpu in self.gpus}) != len(self.gpus):
            raise InventoryError(f"node {self.name!r} lists a GPU index twice")
        indices = {gpu.index for gpu in self.gpus}
        for field, groups in (("nvlink_islands", self.nvlink_islands), ("numa", self.numa)):
            listed = [index for group in groups for index in group]
            if len(set(listed)) != len(listed):
                raise InventoryError(f"node {self.name!r}: {field} lists a GPU twice")
            if not set(listed) <= indices:
                unknown = sorted(set(listed) - indices)
                raise InventoryError(f"node {self.name!r}: {field} names unknown GPU(s) {unknown}")
            if any(not group for group in groups):
                raise InventoryError(f"node {self.name!r}: {field} has an empty group")

    @property
    def gpu_groups(self) -> tuple[tuple[int, ...], ...]:
        """The groups placement keeps a gang inside: NVLink islands, else NUMA nodes."""
        return self.nvlink_islands or self.numa


@dataclass(frozen=True, slots=True)
class Inventory:
    nodes: tuple[NodeSpec, ...]

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise InventoryError(f"duplicate node {node.name!r}")
            seen.add(node.name)

    @property
    def gpus(self) -> tuple[GpuSpec, ...]:
        return tuple(gpu for node in self.nodes for gpu in node.gpus)

    @property
    def total_gpus(self) -> int:
        return sum(len(node.gpus) for node in self.nodes)

    def gpus_in(self, pool: Pool) -> int:
        return sum(len(node.gpus) for node in self.nodes if node.pool is pool)

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def _gpus_of(node: str, count: int, model: str, memory_mib: int) -> tuple[GpuSpec, ...]:
    return tuple(GpuSpec(node, index, model, memory_mib) for index in range(count))


# --- YAML-shaped inventory --------------------------------------------------------

_REQUIRED_FIELDS = ("pool", "gpu_model", "gpus", "cpu_milli", "memory_mib")
_GROUP_FIELDS = ("nvlink_islands", "numa")
_KNOWN_FIELDS = frozenset(
    {
        "name",
        "name_prefix",
        "count",
        "gpu_memory_mib",
        "mig",
        "disk_gib",
        *_GROUP_FIELDS,
        *_REQUIRED_FIELDS,
    }
)


def parse_inventory(data: Mapping[str, Any]) -> Inventory:
    """Build an Inventory from ``{nodes: [{name, pool, gpu_model, gpus, ...}]}``.

    An entry with ``count: N`` and ``name_prefix: p`` stands for N identical nodes
    named ``p-00``, ``p-01``, ...; the zero padding keeps name order equal to numeric
    order, which matters because placement walks nodes in name order.
    """
    entries = data.get("nodes")
    if not isinstance(entries, list) or not entries:
        raise InventoryError("inventory needs a non-empty 'nodes' list")
    nodes: list[NodeSpec] = []
    seen: dict[str, str] = {}
    for position, entry in enumerate(entries):
        where = f"nodes[{position}]"
        if not isinstance(entry, Mapping):
            raise InventoryError(f"{where}: expected a mapping, got {type(entry).__name__}")
        for node in _parse_entry(entry, where):
            if node.name in seen:
                raise InventoryError(
                    f"{where}: duplicate node {node.name!r} (first defined in {seen[node.name]})"
                )
            seen[node.name] = where
            nodes.append(node)
    return Inventory(tuple(nodes))


def _parse_entry(entry: Mapping[str, Any], where: str) -> list[NodeSpec]:
    unknown = sorted(str(key) for key in entry if key not in _KNOWN_FIELDS)
    if unknown:
        raise InventoryError(f"{where}: unknown field(s) {', '.join(unknown)}")
    names = _entry_names(entry, where)
    where = f"{where} ({names[0]!r})" if len(names) == 1 else f"{where} ({len(names)} nodes)"
    for field in _REQUIRED_FIELDS:
        if field not in entry:
            raise InventoryError(f"{where}: missing field {field!r}")
    pool = _parse_pool(entry["pool"], where)
    model = entry["gpu_model"]
    if not isinstance(model, str) or not model:
        raise InventoryError(f"{where}: 'gpu_model' must be a non-empty string")
    gpu_count = _positive_int(entry, "gpus", where)
    if "gpu_memory_mib" in entry:
        gpu_memory = _positive_int(entry, "gpu_memory_mib", where)
    elif model in GPU_MEMORY_MIB:
        gpu_memory = GPU_MEMORY_MIB[model]
    else:
        raise InventoryError(
            f"{where}: missing field 'gpu_memory_mib' (GPU model {model!r} is not in the "
            "built-in table)"
        )
    cpu_milli = _positive_int(entry, "cpu_milli", where)
    memory_mib = _positive_int(entry, "memory_mib", where)
    islands, numa = (_gpu_groups(entry.get(field), field, where) for field in _GROUP_FIELDS)
    mig = entry.get("mig")
    if mig is not None and not isinstance(mig, bool):
        raise InventoryError(f"{where}: 'mig' must be true or false, got {mig!r}")
    disk_gib = _positive_int(entry, "disk_gib", where) if "disk_gib" in entry else 0
    try:
        return [
            NodeSpec(
                name,
                pool,
                _gpus_of(name, gpu_count, model, gpu_memory),
                cpu_milli,
                memory_mib,
                islands,
                numa,
                mig,
                disk_gib,
            )
            for name in names
        ]
    except InventoryError as exc:
        raise InventoryError(f"{where}: {exc}") from None


def _gpu_groups(value: object, field: str, where: str) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(
        isinstance(group, list)
        and all(isinstance(i, int) and not isinstance(i, bool) for i in group)
        for group in value
    ):
        raise InventoryError(
            f"{where}: {field!r} must be a list of lists of GPU indices, e.g. [[0, 1], [2, 3]]"
        )
    return tuple(tuple(group) for group in value)


def _entry_names(entry: Mapping[str, Any], where: str) -> list[str]:
    if "count" not in entry:
        if "name_prefix" in entry:
            raise InventoryError(f"{where}: 'name_prefix' needs 'count'")
        if "name" not in entry:
            raise InventoryError(f"{where}: missing field 'name'")
        name = entry["name"]
        if not isinstance(name, str) or not name:
            raise InventoryError(f"{where}: 'name' must be a non-empty string")
        return [name]
    if "name" in entry:
        raise InventoryError(f"{where}: use 'name_prefix' with 'count', not 'name'")
    if "name_prefix" not in entry:
        raise InventoryError(f"{where}: missing field 'name_prefix' (required with 'count')")
    prefix = entry["name_prefix"]
    if not isinstance(prefix, str) or not prefix:
        raise InventoryError(f"{where}: 'name_prefix' must be a non-empty string")
    count = _positive_int(entry, "count", where)
    width = max(2, len(str(count - 1)))
    return [f"{prefix}-{number:0{width}d}" for number in range(count)]


def _parse_pool(value: object, where: str) -> Pool:
    try:
        return Pool(str(value))
    except ValueError:
        allowed = ", ".join(pool.value for pool in Pool)
        raise InventoryError(
            f"{where}: unknown pool {value!r} (expected one of {allowed})"
        ) from None


def _positive_int(entry: Mapping[str, Any], field: str, where: str) -> int:
    value = entry[field]
    # bool is an int subclass; `gpus: yes` is a typo, not one GPU.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InventoryError(f"{where}: {field!r} must be an integer, got {value!r}")
    if value <= 0:
        raise InventoryError(f"{where}: {field!r} must be positive, got {value}")
    return value


# --- Alibaba openb node list ----------------------------------------------------

_OPENB_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")


def parse_openb_node_csv(
    lines: Iterable[str], pool_for: Callable[[int], Pool] | None = None
) -> Inventory:
    """Parse the openb node list (``sn,cpu_milli,memory_mib,gpu,model``).

    CPU-only nodes are skipped. ``pool_for(i)`` labels the i-th kept GPU node
    (0-based, file order); without it every node is SHARED, since the trace's
    cluster runs serving and training on the same machines.
    """
    reader = csv.reader(lines)
    header = next(reader, None)
    if header is None:
        raise InventoryError("openb node list is empty")
    header = [column.strip() for column in header]
    missing = [column for column in _OPENB_COLUMNS if column not in header]
    if missing:
        raise InventoryError(f"openb node list: missing column(s) {', '.join(missing)}")
    position = {column: header.index(column) for column in _OPENB_COLUMNS}
    nodes: list[NodeSpec] = []
    seen: set[str] = set()
    for line_number, row in enumerate(reader, start=2):
        if not row or all(not cell.strip() for cell in row):
            continue
        where = f"line {line_number}"
        if len(row) < len(header):
            raise InventoryError(f"{where}: expected {len(header)} columns, got {len(row)}")
        cells = {column: row[index].strip() for column, index in position.items()}
        name = cells["sn"]
        if not name:
            raise InventoryError(f"{where}: empty node name")
        if name in seen:
            raise InventoryError(f"{where}: duplicate node {name!r}")
        seen.add(name)
        gpu_count = _csv_int(cells, "gpu", where)
        if gpu_count <= 0:
            continue
        model = cells["model"]
        if not model:
            raise InventoryError(f"{where}: node {name!r} has {gpu_count} GPUs but no model")
        pool = pool_for(len(nodes)) if pool_for is not None else Pool.SHARED
        memory = GPU_MEMORY_MIB.get(model, DEFAULT_GPU_MEMORY_MIB)
        nodes.append(
            NodeSpec(
                name,
                pool,
                _gpus_of(name, gpu_count, model, memory),
                _csv_int(cells, "cpu_milli", where),
                _csv_int(cells, "memory_mib", where),
            )
        )
    return Inventory(tuple(nodes))


def _csv_int(cells: Mapping[str, str], column: str, where: str) -> int:
    try:
        return int(cells[column])
    except ValueError:
        raise InventoryError(f"{where}: {column!r} is not an integer: {cells[column]!r}") from None
