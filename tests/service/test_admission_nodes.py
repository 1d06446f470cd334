"""Inventory changes on the real NATS and PostgreSQL: nodes drained, failed (by the
operator or the cluster agent's health report), recovered, added and removed, and the
ingest service's pool counts following them.

The cluster is one inference node (2 GPUs) and two shared nodes (4 GPUs each).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import ConsumerConfig, DeliverPolicy
from tests.service.test_agent_service import Cluster, sim
from tests.service.test_checkpoint_service import checkpoint_file
from tests.service.test_checkpoint_service import running as checkpoint_service
from tests.support.admission import Admission, Client, start_admission, with_inventory
from tests.support.identity import credentials_of
from tests.support.waiting import eventually

from gpusched.admission import store
from gpusched.admission.app import NAME as ADMISSION
from gpusched.agent.app import start_agent
from gpusched.contracts.envelope import Envelope, make_envelope, utcnow
from gpusched.contracts.messages import (
    CheckpointConfirmed,
    CheckpointInfo,
    CheckpointVerified,
    GpuReading,
    GpuSample,
    InventoryChanged,
    InventoryLoaded,
    InventoryNode,
    NodeChange,
    NodeHealth,
    NodeState,
    NodeVerb,
    PoolSnapshot,
    StageName,
    T,
)
from gpusched.contracts.subjects import untelemetered_note
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import AgentSettings, IngestSettings, Settings
from gpusched.ingest import app as ingest_app
from gpusched.simcluster.faults import SIM_NODE_HEALTH, SetNodeHealth

INVENTORY = """
nodes:
  - name: inf-00
    pool: inference
    gpu_model: A100-80GB
    gpus: 2
    cpu_milli: 32000
    memory_mib: 262144
  - name_prefix: shared
    count: 2
    pool: shared
    gpu_model: A100-80GB
    gpus: 4
    cpu_milli: 64000
    memory_mib: 524288
"""

NEW_NODE = {
    "name": "shared-02",
    "pool": "shared",
    "gpu_model": "A100-80GB",
    "gpus": 4,
    "cpu_milli": 64000,
    "memory_mib": 524288,
}


class Nodes:
    """The operator's side: `gpusched node ...` as requests."""

    def __init__(self, client: Client) -> None:
        self.client = client

    async def ask(self, verb: NodeVerb, **body: Any) -> dict[str, Any]:
        return await self.client.request(self.client.s.api_nodes(verb), json.dumps(body).encode())

    async def do(self, verb: NodeVerb, node: str, reason: str = "") -> dict[str, Any]:
        return await self.ask(verb, node=node, operator="ops", reason=reason)

    async def states(self) -> dict[str, str]:
        reply = await self.ask(NodeVerb.LIST)
        assert reply["ok"], reply
        return {n["name"]: n["state"] for n in reply["nodes"]}


@pytest.fixture
def admission_settings(settings: Settings, tmp_path: Path) -> Settings:
    return with_inventory(settings, tmp_path, INVENTORY)


@pytest.fixture
def nodes(client: Client) -> Nodes:
    return Nodes(client)


async def changes(client: Client) -> list[tuple[str, str]]:
    found = await client.all_events(client.s.event(ADMISSION, T.INVENTORY_CHANGED))
    return [(e.data["change"], e.data["node"]["name"]) for e in found]


async def confirm_checkpoint(client: Client, job_id: str, step: int) -> None:
    """The checkpoint service announces a checkpoint of the job it verified, as it would."""
    verified = CheckpointVerified(
        job_id=job_id,
        request_id=None,
        checkpoint=CheckpointInfo(
            checkpoint_id=f"ckpt-{step}",
            step=step,
            uri=f"file:///ckpt/{step}",
            bytes=2048,
            sha256="a" * 64,
            stage=StageName.PERSISTED,
        ),
        confirmed_at=utcnow(),
    )
    envelope = make_envelope(
        T.CHECKPOINT_VERIFIED, verified, source="checkpoint", correlation_id=job_id
    )
    subject = client.s.event("checkpoint", T.CHECKPOINT_VERIFIED)
    await client.js.publish(subject, envelope.to_bytes())


async def claim_checkpoint(
    client: Client, job_id: str, step: int, **lie: Any
) -> tuple[str, int, str]:
    """The job, through the SDK, claims a checkpoint it wrote; `lie` overrides what the
    claim says about it (uri, bytes, sha256). The checkpoint service judges the claim."""
    uri, size, sha256 = checkpoint_file(job_id, step)
    claim = {"uri": uri, "bytes": size, "sha256": sha256, **lie}
    confirmed = CheckpointConfirmed(
        request_id=None,
        checkpoint_id=f"ckpt-{step}",
        step=step,
        stage=StageName.PERSISTED,
        **claim,
    )
    envelope = make_envelope(T.CHECKPOINT_CONFIRMED, confirmed, source="sdk", correlation_id=job_id)
    await client.js.publish(client.s.job_events(job_id), envelope.to_bytes())
    return claim["uri"], claim["bytes"], claim["sha256"]


def node_of(job: dict[str, Any]) -> str:
    [node] = {gpu["node"] for gpu in job["allocated"]}
    return str(node)


# --- drain ------------------------------------------------------------------------------


async def test_a_drained_node_takes_no_new_placements_but_keeps_running_ones(
    admission: Admission, client: Client, nodes: Nodes
) -> None:
    first = await client.job_in(await client.submitted(gpus={"count": 4}), "running")
    busy = node_of(first)
    other = "shared-01" if busy == "shared-00" else "shared-00"

    drained = await nodes.do(NodeVerb.DRAIN, busy, "kernel upgrade")
    assert drained["ok"], drained
    assert drained["nodes"][0]["state"] == "drained"
    assert drained["nodes"][0]["allocations"] == [first["allocation_id"]]
    assert (await nodes.do(NodeVerb.DRAIN, other))["ok"]

    waiting = await client.submitted(name="small", gpus={"count": 1})
    await client.audits("job.waiting", waiting, 1)
    assert (await client.job(waiting))["state"] == "queued"
    assert (await client.job(first["job_id"]))["state"] == "running"

    assert (await nodes.do(NodeVerb.UNDRAIN, other))["ok"]
    placed = await client.job_in(waiting, "running")
    assert node_of(placed) == other
    assert await nodes.states() == {"inf-00": "up", busy: "drained", other: "up"}
    assert await changes(client) == [("drained", busy), ("drained", other), ("undrained", other)]
    [audit] = await client.audits("node.drained", busy, 1)
    assert "kernel upgrade" in audit.data["reason"]


# --- failure ----------------------------------------------------------------------------


async def test_a_failed_node_requeues_training_from_its_latest_checkpoint_and_audits_lost_work(
    admission: Admission, client: Client, nodes: Nodes
) -> None:
    job = await client.job_in(await client.submitted(gpus={"count": 4}), "running")
    lost_node = node_of(job)
    await confirm_checkpoint(client, job["job_id"], step=300)
    await confirm_checkpoint(client, job["job_id"], step=200)  # late, older: ignored

    async def remembered() -> bool:
        latest = (await client.job(job["job_id"]))["latest_checkpoint"]
        return latest is not None and latest["checkpoint_id"] == "ckpt-300"

    await eventually(remembered, within=20)
    failed = await nodes.do(NodeVerb.FAIL, lost_node, "PSU smoke")
    assert failed["ok"], failed
    assert failed["nodes"][0] == {
        "name": lost_node, "pool": "shared", "gpu_model": "A100-80GB", "gpus": 4,
        "state": "failed", "cpu_milli": 64000, "memory_mib": 524288, "disk_gib": 0,
        "allocations": [],
    }  # fmt: skip

    released = [
        e
        for e in await client.all_events(client.s.event(ADMISSION, T.ALLOCATION_RELEASED))
        if e.data["allocation_id"] == job["allocation_id"]
    ]
    assert [e.data["reason"] for e in released] == ["node_failed"]
    [lost] = await client.audits("work.lost", job["job_id"], 1)
    assert lost.data["details"]["resume_from"] == "ckpt-300"
    assert lost.data["details"]["lost_gpu_seconds"] > 0
    [node_audit] = await client.audits("node.failed", lost_node, 1)
    assert node_audit.data["details"]["allocations_ended"] == [job["allocation_id"]]

    # The same requeue path as an eviction: placed again, on the healthy node, resumed.
    again = await client.job_in(job["job_id"], "running")
    assert again["attempt"] == 2
    assert node_of(again) != lost_node
    assert again["resume_from"]["checkpoint_id"] == "ckpt-300"
    starts = await client.events(client.s.command("agent", T.START_WORKLOAD), 2)
    assert starts[1].data["resume_from"]["checkpoint_id"] == "ckpt-300"
    assert (await changes(client))[-1] == ("failed", lost_node)
    assert (await nodes.states())[lost_node] == "failed"


async def test_a_claim_the_checkpoint_service_rejected_is_never_resumed_from_shown_or_counted(
    admission_settings: Settings, admission: Admission, client: Client, nodes: Nodes
) -> None:
    async with checkpoint_service(admission_settings):
        job = await client.job_in(await client.submitted(gpus={"count": 4}), "running")
        job_id = job["job_id"]
        await claim_checkpoint(client, job_id, step=100)
        [announced] = await client.events(client.s.event("checkpoint", T.CHECKPOINT_VERIFIED), 1)
        verified = announced.payload(CheckpointVerified)
        assert (verified.job_id, verified.checkpoint.checkpoint_id) == (job_id, "ckpt-100")

        async def shown() -> bool:
            latest = (await client.job(job_id))["latest_checkpoint"]
            return latest is not None and latest["checkpoint_id"] == "ckpt-100"

        await eventually(shown, within=20)
        # Later claims that storage contradicts: a missing file, then a wrong sha256.
        await asyncio.sleep(2)  # so lost work from a claim's time would show
        await claim_checkpoint(client, job_id, step=200, uri="file:///nowhere/ckpt-200.bin")
        await claim_checkpoint(client, job_id, step=300, sha256="f" * 64)
        await client.audits("checkpoint.unverified", job_id, 2)

        assert (await client.job(job_id))["latest_checkpoint"]["checkpoint_id"] == "ckpt-100"
        failed = await nodes.do(NodeVerb.FAIL, node_of(job), "PSU smoke")
        assert failed["ok"], failed
        [lost] = await client.audits("work.lost", job_id, 1)
        assert lost.data["details"]["resume_from"] == "ckpt-100"
        since_verified = (lost.time - verified.confirmed_at).total_seconds()
        assert lost.data["details"]["lost_gpu_seconds"] == pytest.approx(4 * since_verified, abs=2)

        again = await client.job_in(job_id, "running")
        assert again["resume_from"]["checkpoint_id"] == "ckpt-100"
        assert again["latest_checkpoint"]["checkpoint_id"] == "ckpt-100"
        starts = await client.events(client.s.command("agent", T.START_WORKLOAD), 2)
        assert starts[1].data["resume_from"]["checkpoint_id"] == "ckpt-100"
        # Only the verified claim was ever announced.
        announced_all = await client.all_events(client.s.event("checkpoint", T.CHECKPOINT_VERIFIED))
        assert [e.data["checkpoint"]["checkpoint_id"] for e in announced_all] == ["ckpt-100"]


async def test_the_agents_health_reports_fail_and_recover_a_node(
    admission: Admission, client: Client, nodes: Nodes
) -> None:
    job = await client.job_in(
        await client.submitted(
            name="chat", kind="inference", priority_class="inference", gpus={"count": 2}
        ),
        "running",
    )
    assert node_of(job) == "inf-00"

    async def health(healthy: bool) -> None:
        await client.publish(
            client.s.event("agent", T.NODE_HEALTH),
            T.NODE_HEALTH,
            NodeHealth(node="inf-00", healthy=healthy, reason="XID 79", time=utcnow()),
        )

    await health(False)
    await health(False)  # reported again: no second failure
    requeued = await client.audits("job.requeued", job["job_id"], 1)
    assert "inf-00 failed" in requeued[0].data["reason"]
    assert (await nodes.states())["inf-00"] == "failed"
    await client.audits("job.waiting", job["job_id"], 1)  # the only inference GPUs are gone
    await health(True)
    again = await client.job_in(job["job_id"], "running")
    assert node_of(again) == "inf-00" and again["attempt"] == 2

    assert await changes(client) == [("failed", "inf-00"), ("recovered", "inf-00")]
    [audit] = await client.audits("node.failed", "inf-00", 1)
    assert "XID 79" in audit.data["reason"]


# --- added and removed -----------------------------------------------------------------


async def test_an_added_node_takes_queued_work(
    admission: Admission, client: Client, nodes: Nodes
) -> None:
    for node in ("shared-00", "shared-01"):
        assert (await nodes.do(NodeVerb.DRAIN, node))["ok"]
    waiting = await client.submitted(gpus={"count": 4})
    await client.audits("job.waiting", waiting, 1)

    added = await nodes.ask(NodeVerb.ADD, spec=NEW_NODE, operator="ops", reason="new rack")
    assert added["ok"], added
    assert added["nodes"][0]["state"] == "up"
    job = await client.job_in(waiting, "running")
    assert node_of(job) == "shared-02"
    event = (await client.events(client.s.event(ADMISSION, T.INVENTORY_CHANGED), 3))[-1]
    assert event.data["node"] == {
        "name": "shared-02", "pool": "shared", "gpu_model": "A100-80GB", "gpus": 4,
        "gpu_groups": [],
    }  # fmt: skip
    assert await admission.rows("nodes") == 4
    assert await admission.rows("gpus") == 14
    assert added["notes"] == []


async def test_a_node_whose_name_is_no_subject_token_is_added_with_a_note(
    admission: Admission, nodes: Nodes
) -> None:
    spaced = {**NEW_NODE, "name": "gpu node 7"}

    added = await nodes.ask(NodeVerb.ADD, spec=spaced, operator="ops", reason="typo")

    assert added["ok"], added
    assert added["notes"] == [untelemetered_note("gpu node 7")]
    assert "no GPU telemetry" in added["notes"][0]


async def test_a_node_named_as_kubernetes_names_it_is_added_without_a_note(
    admission: Admission, nodes: Nodes
) -> None:
    dotted = {**NEW_NODE, "name": "ip-10-0-1-23.ec2.internal"}

    added = await nodes.ask(NodeVerb.ADD, spec=dotted, operator="ops", reason="eks node")

    assert added["ok"], added
    assert added["notes"] == []


async def test_an_added_node_keeps_its_mig_flag_and_disk_across_a_restart(
    admission_settings: Settings, nodes: Nodes
) -> None:
    first = await start_admission(admission_settings)
    spec = {**NEW_NODE, "mig": False, "disk_gib": 7680}
    try:
        added = await nodes.ask(NodeVerb.ADD, spec=spec, operator="ops", reason="new rack")
        assert added["ok"], added
    finally:
        await first.stop()

    restarted = await start_admission(admission_settings)
    try:
        async with restarted.rt.uow() as uow:
            inventory, _ = await store.load_ledger(uow)
        added = inventory.node("shared-02")
        assert (added.mig, added.disk_gib) == (False, 7680)
        listed = {n["name"]: n for n in (await nodes.ask(NodeVerb.LIST))["nodes"]}
        assert listed["shared-02"]["disk_gib"] == 7680
        assert listed["inf-00"]["disk_gib"] == 0
    finally:
        await restarted.stop()


async def test_a_busy_node_is_not_removed_and_an_empty_one_is(
    admission: Admission, client: Client, nodes: Nodes
) -> None:
    job = await client.job_in(await client.submitted(gpus={"count": 4}), "running")
    busy = node_of(job)
    idle = "shared-01" if busy == "shared-00" else "shared-00"

    refused = await nodes.do(NodeVerb.REMOVE, busy)
    assert refused["ok"] is False
    assert refused["error"]["code"] == "node_busy"
    assert job["allocation_id"] in refused["error"]["message"]
    removed = await nodes.do(NodeVerb.REMOVE, idle)
    assert removed["ok"], removed
    assert await nodes.states() == {"inf-00": "up", busy: "up"}
    assert await admission.rows("nodes") == 2
    assert await admission.rows("gpus") == 6
    assert await changes(client) == [("removed", idle)]


async def test_bad_node_requests_are_refused_and_nothing_is_stored(
    admission: Admission, client: Client, nodes: Nodes
) -> None:
    cases: list[tuple[NodeVerb, dict[str, Any], str]] = [
        (NodeVerb.DRAIN, {"node": "ghost-00", "operator": "ops"}, "unknown_node"),
        (NodeVerb.REMOVE, {"node": "ghost-00", "operator": "ops"}, "unknown_node"),
        (NodeVerb.UNDRAIN, {"node": "shared-00", "operator": "ops"}, "wrong_node_state"),
        (NodeVerb.RECOVER, {"node": "shared-00", "operator": "ops"}, "wrong_node_state"),
        (NodeVerb.DRAIN, {"node": "shared-00"}, "invalid"),
        (NodeVerb.ADD, {"spec": {**NEW_NODE, "name": "shared-00"}, "operator": "ops"},
         "duplicate_node"),
        (NodeVerb.ADD, {"spec": {**NEW_NODE, "gpus": -1}, "operator": "ops"},
         "invalid_node_spec"),
        (NodeVerb.ADD, {"spec": {**NEW_NODE, "pool": "gaming"}, "operator": "ops"},
         "invalid_node_spec"),
    ]  # fmt: skip
    for verb, body, code in cases:
        reply = await nodes.ask(verb, **body)
        assert reply["ok"] is False, (verb, body)
        assert reply["error"]["code"] == code, (verb, reply)
        assert reply["error"]["message"]
    garbage = await client.request(client.s.api_nodes(NodeVerb.FAIL), b"not json")
    assert garbage["error"]["code"] == "invalid"

    assert await admission.rows("nodes") == 3
    assert await admission.rows("gpus") == 10
    assert await nodes.states() == {"inf-00": "up", "shared-00": "up", "shared-01": "up"}
    assert await changes(client) == []


async def test_a_reload_adds_the_nodes_the_file_gained_and_names_those_it_lost(
    admission: Admission, admission_settings: Settings, client: Client, nodes: Nodes
) -> None:
    path = admission_settings.admission.inventory_path
    text = (
        path.read_text()
        .replace("count: 2", "count: 3")
        .replace("  - name: inf-00", "  - name: inf-09")
    )
    path.write_text(text)

    reply = await nodes.ask(NodeVerb.RELOAD, operator="ops")
    assert reply["ok"], reply
    assert sorted(n["name"] for n in reply["nodes"]) == ["inf-09", "shared-02"]
    assert any("inf-00" in note for note in reply["notes"])
    assert (await nodes.states()).keys() == {"inf-00", "inf-09", "shared-00", "shared-01",
                                               "shared-02"}  # fmt: skip
    assert sorted(await changes(client)) == [("added", "inf-09"), ("added", "shared-02")]


# --- the counting consumers follow --------------------------------------------------------


@pytest.fixture
async def ingest(admission_settings: Settings) -> AsyncIterator[ServiceRuntime]:
    fast = admission_settings.model_copy(
        update={"ingest": IngestSettings(window_s=30.0, snapshot_interval_s=0.1)}
    )
    runtime = ServiceRuntime(
        ingest_app.NAME, ingest_app.SCHEMA, fast, migrations_dir(ingest_app.__file__)
    )
    await runtime.start()
    await ingest_app.build(runtime)
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


async def pool_sizes(client: Client, inference: int, shared: int) -> None:
    """Wait for a pool snapshot with these sizes; fail with the last one seen."""
    sub = await client.js.subscribe(
        client.s.event("ingest", T.POOL_SNAPSHOT),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
        manual_ack=False,
    )
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    last: dict[str, int] = {}
    try:
        while (remaining := deadline - loop.time()) > 0:
            # A sample per round keeps the snapshots coming (none is sent without one).
            sample = GpuSample(
                node="inf-00",
                time=utcnow(),
                gpus=[GpuReading(index=0, util=0.5, mem_used_mib=1, mem_total_mib=81920)],
            )
            await client.publish(client.s.telemetry_gpu("inf-00"), T.GPU_SAMPLE, sample)
            try:
                msg = await sub.next_msg(timeout=min(remaining, 1.0))
            except NatsTimeout:
                continue
            snapshot = Envelope.from_bytes(msg.data).payload(PoolSnapshot)
            last = {pool.pool: pool.gpus for pool in snapshot.pools}
            if last.get("inference") == inference and last.get("shared") == shared:
                return
    finally:
        await sub.unsubscribe()
    raise AssertionError(f"pools never were inference={inference} shared={shared}: {last}")


async def test_ingest_pool_counts_follow_failed_recovered_and_added_nodes(
    admission: Admission, ingest: ServiceRuntime, client: Client, nodes: Nodes
) -> None:
    await pool_sizes(client, inference=2, shared=8)
    assert (await nodes.do(NodeVerb.FAIL, "shared-01"))["ok"]
    await pool_sizes(client, inference=2, shared=4)
    assert (await nodes.do(NodeVerb.DRAIN, "shared-00"))["ok"]  # still there: still counted
    assert (await nodes.do(NodeVerb.RECOVER, "shared-01"))["ok"]
    await pool_sizes(client, inference=2, shared=8)
    assert (await nodes.ask(NodeVerb.ADD, spec=NEW_NODE, operator="ops"))["ok"]
    await pool_sizes(client, inference=2, shared=12)


# --- the simulated cluster breaks a node and reports it --------------------------------


@pytest.fixture
async def sim_cluster(settings: Settings, tmp_path: Path) -> AsyncIterator[Cluster]:
    fast = settings.model_copy(
        update={"agent": AgentSettings(telemetry_interval_s=0.2, workdir=tmp_path / "agent")}
    )
    rt = ServiceRuntime("agent", "agent", fast, None)
    await rt.start()
    agent = await start_agent(rt)
    harness = Cluster(rt, agent, asyncio.create_task(rt.run()))
    await harness.send(
        rt.subjects.event("admission", T.INVENTORY_LOADED),
        T.INVENTORY_LOADED,
        InventoryLoaded(
            nodes=[
                InventoryNode(name="inf-00", pool="inference", gpu_model="A100-80GB", gpus=2),
                InventoryNode(name="shared-00", pool="shared", gpu_model="A100-80GB", gpus=4),
            ]
        ),
    )

    async def loaded() -> bool:
        return len(agent.view.nodes) == 2

    await eventually(loaded, within=20)
    try:
        yield harness
    finally:
        await agent.close()
        await harness.stop_service()


async def test_the_simulated_agent_told_a_node_broke_stops_its_work_and_reports_its_health(
    sim_cluster: Cluster,
) -> None:
    c = sim_cluster
    await c.start("alloc-1", "job-1", sim())
    await c.agent_events(T.WORKLOAD_STARTED)

    await c.command(SIM_NODE_HEALTH, SetNodeHealth(node="shared-00", healthy=False, reason="fan"))
    [health] = await c.agent_events(T.NODE_HEALTH)
    assert health.data["node"] == "shared-00"
    assert health.data["healthy"] is False
    assert health.data["reason"] == "fan"
    assert c.agent.running_allocations == []
    # The failure is the news: no stop report races it to admission.
    assert await c.stored(c.s.event("agent", T.WORKLOAD_STOPPED)) == 0

    node = InventoryNode(name="shared-00", pool="shared", gpu_model="A100-80GB", gpus=4)
    changed = InventoryChanged(
        change=NodeChange.FAILED, node=node, state=NodeState.FAILED, reason="agent"
    )
    await c.send(c.s.event("admission", T.INVENTORY_CHANGED), T.INVENTORY_CHANGED, changed)

    async def dropped() -> bool:
        return set(c.agent.view.nodes) == {"inf-00"}

    await eventually(dropped, within=20)


async def test_the_node_commands_of_the_cli_drain_and_list(
    admission: Admission, admission_settings: Settings
) -> None:
    env = {
        **os.environ,
        "GPUSCHED_NATS_URL": str(admission_settings.nats_url),
        "GPUSCHED_SUBJECT_PREFIX": admission_settings.subject_prefix,
        # An operator's identity: node commands need the operator role.
        "GPUSCHED_NATS_CREDENTIALS": str(credentials_of(admission_settings, "operator") or ""),
    }

    async def cli(*args: str) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gpusched.cli.main", "node", *args, env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await asyncio.wait_for(process.communicate(), 60)
        return process.returncode or 0, out.decode()

    code, out = await cli("drain", "shared-01", "--operator", "ops", "--reason", "firmware")
    assert code == 0, out
    assert '"state": "drained"' in out
    code, out = await cli("list")
    assert code == 0, out
    [row] = [line for line in out.splitlines() if line.startswith("shared-01")]
    assert row.split()[:5] == ["shared-01", "shared", "4", "A100-80GB", "drained"]
    code, out = await cli("remove", "ghost-00", "--operator", "ops")
    assert code == 1 and "unknown_node" in out
