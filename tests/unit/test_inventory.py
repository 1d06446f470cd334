from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpusched.domain.inventory import (
    DEFAULT_GPU_MEMORY_MIB,
    GpuRef,
    InventoryError,
    Pool,
    parse_inventory,
    parse_openb_node_csv,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
OPENB = REPO_ROOT.parent / "shared" / "traces" / "alibaba-gpu-v2023"


def node(**overrides: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "name": "gpu-a",
        "pool": "shared",
        "gpu_model": "A100-80GB",
        "gpus": 8,
        "gpu_memory_mib": 81920,
        "cpu_milli": 96000,
        "memory_mib": 1048576,
    }
    entry.update(overrides)
    return {key: value for key, value in entry.items() if value is not None}


def test_a_node_entry_becomes_a_node_with_indexed_gpus() -> None:
    inventory = parse_inventory({"nodes": [node(pool="inference", gpus=2)]})

    (only,) = inventory.nodes
    assert only.name == "gpu-a"
    assert only.pool is Pool.INFERENCE
    assert [gpu.ref for gpu in only.gpus] == [GpuRef("gpu-a", 0), GpuRef("gpu-a", 1)]
    assert {gpu.model for gpu in only.gpus} == {"A100-80GB"}
    assert {gpu.memory_mib for gpu in only.gpus} == {81920}
    assert (only.cpu_milli, only.memory_mib) == (96000, 1048576)


def test_count_shorthand_makes_identical_nodes_whose_names_sort_numerically() -> None:
    entry = node(name=None, name_prefix="train", count=12, pool="training", gpus=4)

    inventory = parse_inventory({"nodes": [entry]})

    names = [n.name for n in inventory.nodes]
    assert names[:3] == ["train-00", "train-01", "train-02"]
    assert names == sorted(names)
    assert len(names) == 12
    assert inventory.gpus_in(Pool.TRAINING) == 48


def test_gpu_memory_defaults_from_the_model_table_when_the_model_is_known() -> None:
    inventory = parse_inventory({"nodes": [node(gpu_model="T4", gpu_memory_mib=None)]})

    assert {gpu.memory_mib for gpu in inventory.gpus} == {16384}


def test_the_demo_inventory_splits_64_a100s_into_24_inference_and_40_shared() -> None:
    data = yaml.safe_load((REPO_ROOT / "deploy" / "inventory" / "demo.yaml").read_text())

    inventory = parse_inventory(data)

    assert len(inventory.nodes) == 8
    assert inventory.total_gpus == 64
    assert inventory.gpus_in(Pool.INFERENCE) == 24
    assert inventory.gpus_in(Pool.SHARED) == 40
    assert {gpu.model for gpu in inventory.gpus} == {"A100-80GB"}


def test_a_node_may_state_its_disk_and_without_it_the_disk_is_not_stated() -> None:
    inventory = parse_inventory({"nodes": [node(disk_gib=7680), node(name="gpu-b")]})

    assert [n.disk_gib for n in inventory.nodes] == [7680, 0]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([node(), node()], "duplicate node 'gpu-a'"),
        (
            [node(name="x-01"), node(name=None, name_prefix="x", count=3)],
            "duplicate node 'x-01'",
        ),
        ([node(pool="gpu")], "unknown pool 'gpu' (expected one of inference, shared, training)"),
        ([node(gpus=0)], "'gpus' must be positive, got 0"),
        ([node(gpus=-2)], "'gpus' must be positive, got -2"),
        ([node(gpus=True)], "'gpus' must be an integer"),
        ([node(gpus="8")], "'gpus' must be an integer"),
        ([node(cpu_milli=None)], "missing field 'cpu_milli'"),
        ([node(name=None)], "missing field 'name'"),
        ([node(gpu_model="X9", gpu_memory_mib=None)], "missing field 'gpu_memory_mib'"),
        ([node(gpu_mem=1)], "unknown field(s) gpu_mem"),
        ([node(disk_gib=-1)], "'disk_gib' must be positive, got -1"),
        ([node(count=2)], "use 'name_prefix' with 'count'"),
        ([node(name=None, name_prefix="p", count=0)], "'count' must be positive"),
    ],
)
def test_malformed_entries_are_refused_with_a_message_naming_the_problem(
    entries: list[dict[str, Any]], message: str
) -> None:
    with pytest.raises(InventoryError) as raised:
        parse_inventory({"nodes": entries})

    assert message in str(raised.value)


def test_error_messages_point_at_the_entry() -> None:
    with pytest.raises(InventoryError, match=r"nodes\[1\] \('gpu-b'\): missing field 'pool'"):
        parse_inventory({"nodes": [node(), node(name="gpu-b", pool=None)]})


def test_an_inventory_without_nodes_is_refused() -> None:
    with pytest.raises(InventoryError, match="non-empty 'nodes' list"):
        parse_inventory({"nodes": []})


OPENB_SAMPLE = """\
sn,cpu_milli,memory_mib,gpu,model
openb-node-0000,32000,262144,0,
openb-node-0001,64000,262144,2,P100
openb-node-0002,96000,786432,8,G2
openb-node-0003,96000,393216,8,V100M32
""".splitlines()


def test_openb_csv_skips_cpu_only_nodes_and_sizes_gpu_memory_by_model() -> None:
    inventory = parse_openb_node_csv(OPENB_SAMPLE, None)

    assert [n.name for n in inventory.nodes] == [
        "openb-node-0001",
        "openb-node-0002",
        "openb-node-0003",
    ]
    assert inventory.total_gpus == 18
    memory = {n.name: n.gpus[0].memory_mib for n in inventory.nodes}
    assert memory == {
        "openb-node-0001": 16384,
        "openb-node-0002": DEFAULT_GPU_MEMORY_MIB,
        "openb-node-0003": 32768,
    }
    assert {n.pool for n in inventory.nodes} == {Pool.SHARED}
    assert inventory.node("openb-node-0002").cpu_milli == 96000


def test_openb_csv_labels_pools_by_the_ordinal_of_the_gpu_node() -> None:
    seen: list[int] = []

    def pool_for(ordinal: int) -> Pool:
        seen.append(ordinal)
        return Pool.INFERENCE if ordinal == 0 else Pool.SHARED

    inventory = parse_openb_node_csv(OPENB_SAMPLE, pool_for)

    assert seen == [0, 1, 2]
    assert [n.pool for n in inventory.nodes] == [Pool.INFERENCE, Pool.SHARED, Pool.SHARED]


def test_openb_csv_errors_name_the_line() -> None:
    lines = [*OPENB_SAMPLE, "openb-node-0004,lots,262144,2,T4"]

    with pytest.raises(InventoryError, match="line 6: 'cpu_milli' is not an integer: 'lots'"):
        parse_openb_node_csv(lines, None)


def test_openb_csv_without_the_expected_columns_is_refused() -> None:
    with pytest.raises(InventoryError, match="missing column"):
        parse_openb_node_csv(["sn,cpu,memory_mib,gpu,model", "n,1,1,1,T4"], None)


def test_the_real_openb_node_list_has_1213_gpu_nodes_and_6212_gpus() -> None:
    path = OPENB / "openb_node_list_gpu_node.csv"
    if not path.exists():
        pytest.skip(f"trace not available at {path}")

    with path.open(newline="") as lines:
        inventory = parse_openb_node_csv(lines, None)

    assert len(inventory.nodes) == 1213
    assert inventory.total_gpus == 6212
    by_model = Counter(n.gpus[0].model for n in inventory.nodes)
    assert by_model["G2"] == 549
    assert by_model["T4"] == 404


def test_nvlink_islands_and_numa_groups_are_read_and_islands_rank_first() -> None:
    entry = node(nvlink_islands=[[0, 1, 2, 3], [4, 5, 6, 7]], numa=[[0, 1, 2, 3, 4, 5, 6, 7]])

    (only,) = parse_inventory({"nodes": [entry]}).nodes

    assert only.nvlink_islands == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert only.gpu_groups == only.nvlink_islands
    (plain,) = parse_inventory({"nodes": [node(numa=[[0, 1], [2, 3, 4, 5, 6, 7]])]}).nodes
    assert plain.gpu_groups == ((0, 1), (2, 3, 4, 5, 6, 7))


@pytest.mark.parametrize(
    ("groups", "message"),
    [
        ([[0, 1], [1, 2]], "lists a GPU twice"),
        ([[0, 9]], r"unknown GPU\(s\) \[9\]"),
        ([[]], "empty group"),
        ([0, 1], "list of lists"),
    ],
)
def test_malformed_gpu_groups_are_refused_with_the_node_named(
    groups: list[Any], message: str
) -> None:
    with pytest.raises(InventoryError, match=message):
        parse_inventory({"nodes": [node(nvlink_islands=groups)]})
