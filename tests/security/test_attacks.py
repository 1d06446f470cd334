"""Every attack of the security review, against the real nats-server and PostgreSQL.

Each is refused by the server (authorization or permissions violation) or by the API
with `forbidden`, and nothing is stored. The services run with their own identities
(contracts.permissions); attackers are real users minted with the installation's keys:
a team, a job, a node, a service outside its grant, and nobody at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import ConsumerConfig, DeliverPolicy
from tests.conftest import Servers
from tests.support.admission import (
    SMALL_CLUSTER,
    Admission,
    Client,
    inventory_loaded_bytes,
    start_admission,
    with_inventory,
)
from tests.support.identity import harness_options
from tests.support.waiting import eventually

from gpusched.billing import app as billing_app
from gpusched.cli.client import ApiClient
from gpusched.cli.errors import BadInput
from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.contracts.messages import (
    AuditRecord,
    CheckpointConfirmed,
    StageName,
    StartWorkload,
    StopReason,
    T,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.natsauth import (
    CLIENT_MAX_PAYLOAD,
    AuthBundle,
    Identity,
    job_user_name,
    node_user_name,
)
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

pytestmark = pytest.mark.timeout(120)


@dataclass
class Attacker:
    """A connection of one identity, with the violations the server reported to it."""

    nc: NatsClient
    errors: list[str]

    async def publish(self, subject: str, body: bytes = b"{}") -> None:
        await self.nc.publish(subject, body)
        await self.nc.flush(timeout=5)

    async def violated(self, subject: str) -> bool:
        wanted = f'permissions violation for publish to "{subject.lower()}"'
        wanted_sub = f'permissions violation for subscription to "{subject.lower()}"'

        async def seen() -> bool:
            return any(wanted in e.lower() or wanted_sub in e.lower() for e in self.errors)

        return await eventually(seen, within=5)


async def connect(url: str, creds: str | None, tmp: Path, name: str) -> Attacker:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    options: dict[str, Any] = {}
    if creds is not None:
        path = tmp / f"{name}.creds"
        path.write_text(creds)
        options = natsauth.connect_options(path)
    nc = await nats.connect(
        url,
        error_cb=on_error,
        allow_reconnect=False,
        connect_timeout=3,
        max_reconnect_attempts=0,
        **options,
    )
    return Attacker(nc, errors)


def _auth(servers: Servers) -> AuthBundle:
    if servers.auth is None:
        pytest.skip("the external NATS of this run has no credentials bundle")
    return servers.auth


@pytest.fixture
def own_identities(settings: Settings, tmp_path: Path) -> Settings:
    """Settings under which each service connects as itself (not as the harness)."""
    configured = with_inventory(settings, tmp_path, SMALL_CLUSTER)
    security = configured.security.model_copy(update={"job_credential_ttl_s": 2.0})
    return configured.model_copy(update={"nats_credentials": None, "security": security})


@pytest.fixture
async def admission(own_identities: Settings) -> AsyncIterator[Admission]:
    running = await start_admission(own_identities)
    yield running
    await running.stop()


@pytest.fixture
async def billing(own_identities: Settings) -> AsyncIterator[ServiceRuntime]:
    runtime = ServiceRuntime(
        billing_app.NAME,
        billing_app.SCHEMA,
        own_identities,
        billing_app.migrations_dir(billing_app.__file__),
    )
    await runtime.start()
    await billing_app.build(runtime)
    task = asyncio.create_task(runtime.run())
    yield runtime
    runtime.request_stop()
    await asyncio.wait_for(task, 15)


@pytest.fixture
async def harness(own_identities: Settings) -> AsyncIterator[NatsClient]:
    assert own_identities.nats_url
    nc = await nats.connect(own_identities.nats_url, **harness_options(own_identities))
    yield nc
    await nc.close()


def as_team(servers: Servers, team: str) -> str:
    return natsauth.issue_client(_auth(servers), "team", team)


def as_operator(servers: Servers, name: str = "ops") -> str:
    return natsauth.issue_client(_auth(servers), "operator", name)


def as_job(servers: Servers, prefix: str, job_id: str, ttl_s: float | None = 60) -> str:
    issuer = _auth(servers).job_credentials_issuer()
    return issuer.creds(Identity(job_user_name(prefix, job_id), ttl_s=ttl_s))


async def request(attacker: Attacker, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await attacker.nc.request(subject, json.dumps(body).encode(), timeout=10)
    data: dict[str, Any] = json.loads(reply.data)
    return data


async def stored(nc: NatsClient, stream: str, subject: str) -> int:
    """How many messages `stream` holds on `subject`."""
    js = nc.jetstream()
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def stored_after(nc: NatsClient, stream: str, subject: str, expect: int = 1) -> int:
    """How many messages `stream` holds on `subject` once it holds `expect` (bounded):
    a core publish is stored a moment after the server has it, later under load."""

    async def count() -> int | None:
        held = await stored(nc, stream, subject)
        return held if held >= expect else None

    return await eventually(count, within=10)


async def audited_refusals(nc: NatsClient, s: Subjects, expect: int) -> list[dict[str, Any]]:
    js = nc.jetstream()

    async def read() -> list[dict[str, Any]] | None:
        sub = await js.subscribe(
            s.audit("access.forbidden"),
            stream=s.audit_stream,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
        )
        records: list[dict[str, Any]] = []
        try:
            while True:
                msg = await sub.next_msg(timeout=0.5)
                records.append(Envelope.from_bytes(msg.data).data)
        except nats.errors.TimeoutError:
            pass
        finally:
            await sub.unsubscribe()
        return records if len(records) >= expect else None

    found = await eventually(read, within=10)
    assert found is not None
    return found


# --- the bus: nats-server refuses -------------------------------------------------------
async def test_a_client_without_credentials_cannot_connect(
    servers: Servers, tmp_path: Path
) -> None:
    _auth(servers)
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
        await connect(servers.nats_url, None, tmp_path, "nobody")


async def test_credentials_signed_by_another_installation_are_refused(
    servers: Servers, tmp_path: Path
) -> None:
    _auth(servers)
    stranger = AuthBundle.create(tmp_path / "stranger")
    creds = natsauth.issue_client(stranger, "operator", "mallory")
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization violation"):
        await connect(servers.nats_url, creds, tmp_path, "stranger")


async def test_a_service_cannot_publish_outside_its_grant(
    servers: Servers, own_identities: Settings, harness: NatsClient, tmp_path: Path
) -> None:
    _auth(servers)
    s = Subjects(own_identities.subject_prefix)
    assert own_identities.security.auth_dir is not None
    ingest = (own_identities.security.auth_dir / "creds" / "ingest.creds").read_text()
    attacker = await connect(servers.nats_url, ingest, tmp_path, "ingest")
    start = s.command("agent", T.START_WORKLOAD)
    await attacker.publish(start, b"{}")
    assert await attacker.violated(start)
    assert await stored(harness, s.stream("COMMANDS"), start) == 0
    await attacker.nc.close()


async def test_a_job_a_node_and_a_team_are_cut_off_past_a_clients_message_size(
    servers: Servers, own_identities: Settings, harness: NatsClient, tmp_path: Path
) -> None:
    auth = _auth(servers)
    if harness.max_payload <= CLIENT_MAX_PAYLOAD:
        pytest.skip("the external NATS of this run takes no more than a client may send")
    s = Subjects(own_identities.subject_prefix)
    node = auth.node_credentials_issuer().creds(Identity(node_user_name(s.prefix, "shared-00")))
    for name, creds, subject in (
        ("job", as_job(servers, s.prefix, "job-big"), s.job_events("job-big")),
        ("node", node, s.telemetry_gpu("shared-00")),
        ("team", as_team(servers, "lab"), s.api_jobs_submit),
    ):
        attacker = await connect(servers.nats_url, creds, tmp_path, name)
        await attacker.publish(subject, b"{}")  # its grant: accepted
        assert not attacker.errors
        with contextlib.suppress(nats.errors.Error):
            await attacker.publish(subject, b"x" * (CLIENT_MAX_PAYLOAD + 1))

        async def cut_off(attacker: Attacker = attacker) -> bool:
            return attacker.nc.is_closed

        assert await eventually(cut_off, within=5), (name, attacker.errors)
    assert await stored_after(harness, s.stream("JOBS"), s.job_events("job-big")) == 1
    telemetry = s.stream("TELEMETRY")
    assert await stored_after(harness, telemetry, s.stored_telemetry_gpu("shared-00")) == 1

    # A service sends what the server takes: admission's inventory of 10,000 nodes.
    assert own_identities.security.auth_dir is not None
    admission = (own_identities.security.auth_dir / "creds" / "admission.creds").read_text()
    service = await connect(servers.nats_url, admission, tmp_path, "admission")
    inventory = inventory_loaded_bytes(10_000)
    assert len(inventory) > CLIENT_MAX_PAYLOAD
    loaded = s.event("admission", T.INVENTORY_LOADED)
    await service.nc.jetstream().publish(loaded, inventory)
    assert await stored_after(harness, s.stream("EVENTS"), loaded) == 1
    await service.nc.close()


async def test_the_cli_refuses_a_request_over_a_clients_message_size_before_sending_it(
    servers: Servers, own_identities: Settings, tmp_path: Path
) -> None:
    creds = tmp_path / "team.creds"
    creds.write_text(as_team(servers, "lab"))
    prefix = own_identities.subject_prefix
    async with ApiClient(servers.nats_url, prefix, credentials=creds) as api:
        with pytest.raises(BadInput, match="more than a client may send"):
            await api.request(api.subjects.api_jobs_submit, b"x" * (CLIENT_MAX_PAYLOAD + 1))
        # Not sent: the server would have cut the connection off.
        await api.nc.flush(timeout=5)
        assert api.nc.is_connected


async def test_a_job_cannot_confirm_for_read_or_disturb_another_job(
    servers: Servers, own_identities: Settings, harness: NatsClient, tmp_path: Path
) -> None:
    s = Subjects(own_identities.subject_prefix)
    job = await connect(
        servers.nats_url, as_job(servers, s.prefix, "job-mine"), tmp_path, "job-mine"
    )
    # Its own subject is fine.
    await job.publish(s.job_events("job-mine"), b"{}")
    assert await stored_after(harness, s.stream("JOBS"), s.job_events("job-mine")) == 1
    # A forged confirmation for another job's request, pointing at an attacker's bucket.
    forged = make_envelope(
        T.CHECKPOINT_CONFIRMED,
        CheckpointConfirmed(
            job_id="job-theirs",
            request_id="req-1",
            checkpoint_id="evil",
            step=1,
            uri="s3://attacker-bucket/evil.pt",
            bytes=1,
            sha256="0" * 64,
            stage=StageName.PERSISTED,
        ),
        source="job",
    )
    await job.publish(s.job_events("job-theirs"), forged.to_bytes())
    assert await job.violated(s.job_events("job-theirs"))
    assert await stored(harness, s.stream("JOBS"), s.job_events("job-theirs")) == 0
    # Reading another job's control subject, directly or through a stream consumer.
    await job.nc.subscribe(s.job_control("job-theirs"))
    await job.nc.flush()
    assert await job.violated(s.job_control("job-theirs"))
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await job.nc.jetstream(timeout=2).add_consumer(
            s.stream("JOBS"),
            ConsumerConfig(name="peek", filter_subject=s.job_control("job-theirs")),
        )
    with pytest.raises((nats.errors.TimeoutError, nats.js.errors.Error)):
        await job.nc.jetstream(timeout=2).add_consumer(
            s.stream("JOBS"), ConsumerConfig(filter_subject=f"{s.prefix}.jobs.>")
        )
    await job.nc.close()


async def test_nobody_but_the_services_sends_agent_commands_or_writes_the_audit_stream(
    servers: Servers, own_identities: Settings, harness: NatsClient, tmp_path: Path
) -> None:
    s = Subjects(own_identities.subject_prefix)
    start = make_envelope(
        T.START_WORKLOAD,
        StartWorkload.model_validate(
            {
                "allocation_id": "alloc-x",
                "job_id": "job-x",
                "attempt": 1,
                "gpus": [],
                "workload": {"kind": "process", "argv": ["id"]},
            }
        ),
        source="admission",
    )
    audit = make_envelope(
        T.AUDIT,
        AuditRecord.model_validate(
            {
                "action": "job.approved",
                "actor": "operator:alice",
                "entity": "job-x",
                "reason": "forged",
                "time": start.time.isoformat(),
            }
        ),
        source="admission",
    )
    command, record = s.command("agent", T.START_WORKLOAD), s.audit("job.approved")
    for who, creds in (
        ("job", as_job(servers, s.prefix, "job-x")),
        ("node", _auth(servers).node_credentials_issuer().creds(
            Identity(node_user_name(s.prefix, "shared-00"))
        )),
    ):  # fmt: skip
        attacker = await connect(servers.nats_url, creds, tmp_path, who)
        await attacker.publish(command, start.to_bytes())
        assert await attacker.violated(command), who
        await attacker.publish(record, audit.to_bytes())
        assert await attacker.violated(record), who
        await attacker.nc.close()
    # A team lives in another account: the service account's subjects do not exist for
    # it, so its publish reaches nobody.
    team = await connect(servers.nats_url, as_team(servers, "vision"), tmp_path, "team")
    await team.publish(command, start.to_bytes())
    await team.publish(record, audit.to_bytes())
    assert await team.violated(command)
    assert await stored(harness, s.stream("COMMANDS"), command) == 0
    assert await stored(harness, s.audit_stream, record) == 0
    await team.nc.close()


@pytest.mark.parametrize(
    ("own", "other"),
    [("shared-00", "inf-00"), ("ip-10-0-1-23.ec2.internal", "ip-10-0-1-24.ec2.internal")],
    ids=["token-name", "dotted-name"],
)
async def test_a_node_publishes_only_its_own_telemetry(
    servers: Servers,
    own_identities: Settings,
    harness: NatsClient,
    tmp_path: Path,
    own: str,
    other: str,
) -> None:
    s = Subjects(own_identities.subject_prefix)
    creds = _auth(servers).node_credentials_issuer().creds(Identity(node_user_name(s.prefix, own)))
    node = await connect(servers.nats_url, creds, tmp_path, "node")
    await node.publish(s.telemetry_gpu(own))
    await node.publish(s.telemetry_gpu(other))
    assert await node.violated(s.telemetry_gpu(other))
    # A dotted name's subject writes its dots as `~`; its raw name is other subjects.
    raw = f"{s.prefix}.telemetry.gpu.{own}"
    if "." in own:
        await node.publish(raw)
        assert await node.violated(raw)
    telemetry = s.stream("TELEMETRY")
    assert await stored_after(harness, telemetry, s.stored_telemetry_gpu(own)) == 1
    assert await stored(harness, telemetry, s.stored_telemetry_gpu(other)) == 0
    await node.nc.close()


# --- the API: the services refuse (forbidden) -------------------------------------------
async def test_a_team_reads_and_changes_only_its_own_jobs_and_bill(
    servers: Servers,
    own_identities: Settings,
    admission: Admission,
    billing: ServiceRuntime,
    harness: NatsClient,
    tmp_path: Path,
) -> None:
    s = Subjects(own_identities.subject_prefix)
    vision = await connect(servers.nats_url, as_team(servers, "vision"), tmp_path, "vision")
    nlp = await connect(servers.nats_url, as_team(servers, "nlp"), tmp_path, "nlp")
    mine = await request(
        vision, s.api_jobs_submit, {"name": "t", "team": "vision", "gpus": {"count": 1}}
    )
    assert mine["ok"], mine
    job_id = mine["job_id"]
    attempts: list[tuple[str, dict[str, Any]]] = [
        (s.api_jobs_get, {"job_id": job_id}),
        (s.api_jobs_why, {"job_id": job_id}),
        (s.api_jobs_cancel, {"job_id": job_id, "operator": "nlp"}),
        (s.api_jobs_submit, {"name": "t", "team": "vision", "gpus": {"count": 1}}),
        (f"{s.prefix}.api.billing.statement", {"team": "vision"}),
    ]
    for subject, body in attempts:
        reply = await request(nlp, subject, body)
        assert reply["ok"] is False and reply["error"]["code"] == "forbidden", (subject, reply)
    # The job is untouched and nothing was submitted for vision by nlp.
    own = await request(vision, s.api_jobs_get, {"job_id": job_id})
    assert own["ok"] and own["job"]["state"] != "cancelled"
    assert await admission.rows("jobs") == 1
    # A team's statement is its own, whatever the request asks (no team = its own).
    statement = await request(nlp, f"{s.prefix}.api.billing.statement", {})
    assert statement["ok"], statement
    refusals = await audited_refusals(harness, s, expect=len(attempts))
    assert {r["details"]["caller"] for r in refusals} == {"team:nlp"}
    for attacker in (vision, nlp):
        await attacker.nc.close()


async def test_operator_commands_need_the_operator_role(
    servers: Servers,
    own_identities: Settings,
    admission: Admission,
    harness: NatsClient,
    tmp_path: Path,
) -> None:
    s = Subjects(own_identities.subject_prefix)
    team = await connect(servers.nats_url, as_team(servers, "vision"), tmp_path, "team")
    operator = await connect(servers.nats_url, as_operator(servers), tmp_path, "operator")
    for subject, body in (
        (s.api_nodes("drain"), {"node": "shared-00"}),
        (s.api_nodes("list"), {}),
        (s.api_jobs_approve, {"job_id": "job-000000000000", "operator": "alice"}),
    ):
        reply = await request(team, subject, body)
        assert reply["ok"] is False and reply["error"]["code"] == "forbidden", (subject, reply)
        # The server's caller header cannot be forged: a team claiming to be an operator
        # is still the team.
        forged = json.dumps({"acc": "x", "name_tag": "operator:alice"})
        msg = await team.nc.request(
            subject, json.dumps(body).encode(), timeout=10, headers={"Nats-Request-Info": forged}
        )
        assert json.loads(msg.data)["error"]["code"] == "forbidden"
    # The same requests as an operator are served; the team's drain changed nothing.
    nodes = await request(operator, s.api_nodes("list"), {})
    assert nodes["ok"], nodes
    assert {n["name"]: n["state"] for n in nodes["nodes"]}["shared-00"] != "drained"
    await audited_refusals(harness, s, expect=6)
    for attacker in (team, operator):
        await attacker.nc.close()


# --- per-job credentials ----------------------------------------------------------------
async def _commands(harness: NatsClient, s: Subjects, message_type: str) -> list[Envelope]:
    """Every agent command of `message_type` stored so far, oldest first."""
    sub = await harness.jetstream().subscribe(
        s.command("agent", message_type),
        stream=s.stream("COMMANDS"),
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    found: list[Envelope] = []
    try:
        while True:
            found.append(Envelope.from_bytes((await sub.next_msg(timeout=0.5)).data))
    except nats.errors.TimeoutError:
        return found
    finally:
        await sub.unsubscribe()


async def _start_command(harness: NatsClient, s: Subjects, job_id: str) -> StartWorkload:
    async def read() -> StartWorkload | None:
        starts = [e.payload(StartWorkload) for e in await _commands(harness, s, T.START_WORKLOAD)]
        return next((start for start in starts if start.job_id == job_id), None)

    found = await eventually(read, within=15)
    assert found is not None
    return found


async def test_a_job_credential_dies_with_its_allocation(
    servers: Servers,
    own_identities: Settings,
    admission: Admission,
    harness: NatsClient,
    tmp_path: Path,
) -> None:
    s = Subjects(own_identities.subject_prefix)
    operator = await connect(servers.nats_url, as_operator(servers), tmp_path, "operator")
    placed = await request(
        operator, s.api_jobs_submit, {"name": "t", "team": "vision", "gpus": {"count": 1}}
    )
    job_id = placed["job_id"]
    start = await _start_command(harness, s, job_id)
    assert start.credentials and start.credentials_expire_at is not None
    # Renewed while the allocation lives (the lifetime is 2 s here): still valid after
    # several lifetimes.
    await asyncio.sleep(5)
    renewed = await _latest_renewal(harness, s, start.allocation_id)
    job = await connect(servers.nats_url, renewed, tmp_path, "job")
    await job.publish(s.job_events(job_id))
    await job.nc.close()
    # The job ends (the test plays the agent): its allocation is released.
    agent = Client(harness, harness.jetstream(), s)
    ending = {"allocation_id": start.allocation_id, "job_id": job_id}
    await agent.stopped(ending, StopReason.COMPLETED)
    await _allocation_gone(admission, start.allocation_id)
    last = await _latest_renewal(harness, s, start.allocation_id)
    await asyncio.sleep(3)  # past the last credential's lifetime; no renewal follows
    with pytest.raises(nats.errors.Error, match=r"(?i)authorization|expired"):
        await connect(servers.nats_url, last, tmp_path, "job-after")
    await operator.nc.close()


async def _latest_renewal(harness: NatsClient, s: Subjects, allocation_id: str) -> str:
    renewals = [
        e.data["credentials"]
        for e in await _commands(harness, s, T.RENEW_CREDENTIALS)
        if e.data["allocation_id"] == allocation_id
    ]
    assert renewals, "no renewal for a live allocation"
    latest: str = renewals[-1]
    return latest


async def _allocation_gone(admission: Admission, allocation_id: str) -> None:
    async def gone() -> bool:
        return allocation_id not in (await admission.ledger()).allocations

    assert await eventually(gone, within=15)
