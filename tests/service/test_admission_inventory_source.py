"""Admission whose inventory comes from the cluster agent (the Kubernetes install): it
starts with no inventory file and no nodes, and the nodes the agent adds are placed on."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.support.admission import Admission, Client, start_admission

from gpusched.contracts.messages import NodeVerb, T
from gpusched.infra.settings import Settings

NODE = {
    "name": "gpu-17",
    "pool": "shared",
    "gpu_model": "A100-80GB",
    "gpus": 4,
    "cpu_milli": 64000,
    "memory_mib": 524288,
}


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    admission = settings.admission.model_copy(
        update={
            "inventory_source": "agent",
            # Not there: with the agent as the source, no file is read.
            "inventory_path": tmp_path / "no-such-inventory.yaml",
            "schedule_interval_s": 0.3,
        }
    )
    return settings.model_copy(update={"admission": admission})


@pytest.fixture
async def agent_sourced(admission_settings: Settings) -> AsyncIterator[Admission]:
    running = await start_admission(admission_settings)
    yield running
    await running.stop()


async def test_admission_starts_without_an_inventory_file_and_places_on_the_nodes_the_agent_adds(
    agent_sourced: Admission, client: Client
) -> None:
    assert sum(c.total for c in (await agent_sourced.capacity()).values()) == 0
    listed = await client.request(client.s.api_nodes(NodeVerb.LIST), b"{}")
    assert listed["ok"] and listed["nodes"] == []
    # No node yet: nothing fits (the Kubernetes agent adds the nodes before it submits).
    early = await client.submit(gpus={"count": 2})
    assert early["error"]["code"] == "unsatisfiable"

    body = {"spec": NODE, "operator": "agent k8s", "reason": "kubernetes: a GPU node"}
    added = await client.request(client.s.api_nodes(NodeVerb.ADD), json.dumps(body).encode())
    assert added["ok"], added
    job = await client.job_in(await client.submitted(gpus={"count": 2}), "running")
    assert {g["node"] for g in job["allocated"]} == {"gpu-17"}


async def test_reloading_the_inventory_file_is_refused_when_the_agent_is_the_source(
    agent_sourced: Admission, client: Client
) -> None:
    body = json.dumps({"operator": "ops", "reason": "try"}).encode()
    reply = await client.request(client.s.api_nodes(NodeVerb.RELOAD), body)
    assert not reply["ok"]
    assert reply["error"]["code"] == "inventory_unavailable"
    assert "INVENTORY_SOURCE=agent" in reply["error"]["message"]
    assert (await agent_sourced.rows("nodes")) == 0


async def test_a_restart_with_the_agent_as_source_keeps_the_nodes_the_agent_added(
    admission_settings: Settings, client: Client
) -> None:
    first = await start_admission(admission_settings)
    try:
        body = {"spec": NODE, "operator": "agent k8s", "reason": "kubernetes: a GPU node"}
        added = await client.request(client.s.api_nodes(NodeVerb.ADD), json.dumps(body).encode())
        assert added["ok"], added
    finally:
        await first.stop()
    again = await start_admission(admission_settings)
    try:
        listed = await client.request(client.s.api_nodes(NodeVerb.LIST), b"{}")
        assert [n["name"] for n in listed["nodes"]] == ["gpu-17"]
    finally:
        await again.stop()


async def test_an_inference_node_the_agent_adds_gives_mig_slices(
    agent_sourced: Admission, client: Client
) -> None:
    node = {**NODE, "name": "inf-07", "pool": "inference"}
    body = {"spec": node, "operator": "agent k8s", "reason": "kubernetes: a GPU node"}
    added = await client.request(client.s.api_nodes(NodeVerb.ADD), json.dumps(body).encode())
    assert added["ok"], added
    await client.submitted(
        kind="inference", priority_class="inference", gpus={"count": 1, "memory_gib": 15}
    )
    [configure] = await client.events(client.s.command("agent", T.MIG_CONFIGURE), 1)
    assert configure.data["node"] == "inf-07"
    assert configure.data["profiles"] == ["2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb"]
