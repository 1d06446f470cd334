"""The Kubernetes agent's least privilege, against the real nats-server and admission.

The agent submits its cluster's pods and keeps the node inventory with a cluster agent
credential (`agent:<name>`, CLIENTS account) that names the teams it may submit for; the
agent service's own identity may not ask the API at all. Each refusal is the server's
(permissions violation) or admission's (`forbidden`, audited), with nothing stored.
"""

from __future__ import annotations

import json
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NatsClient
from tests.conftest import Servers
from tests.security.test_attacks import (
    _auth,
    admission,
    audited_refusals,
    connect,
    harness,
    own_identities,
    request,
)
from tests.service.test_admission_inventory_source import NODE
from tests.support.admission import Admission

from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.natsauth import AuthError
from gpusched.infra.settings import Settings

__all__ = ["admission", "harness", "own_identities"]  # the fixtures this module uses

pytestmark = pytest.mark.timeout(120)


def as_agent(servers: Servers, *teams: str) -> str:
    return natsauth.issue_client(_auth(servers), "agent", "k8s", teams=teams)


async def test_the_agent_credential_submits_for_its_teams_only_and_reads_nothing(
    servers: Servers,
    own_identities: Settings,
    admission: Admission,
    harness: NatsClient,
    tmp_path: Path,
) -> None:
    s = Subjects(own_identities.subject_prefix)
    agent = await connect(servers.nats_url, as_agent(servers, "vision"), tmp_path, "agent")
    mine = await request(
        agent, s.api_jobs_submit, {"name": "pod", "team": "vision", "gpus": {"count": 1}}
    )
    assert mine["ok"], mine
    # Another team's pod (a namespace mapped to a team its credential does not name).
    theirs = await request(
        agent, s.api_jobs_submit, {"name": "pod", "team": "nlp", "gpus": {"count": 1}}
    )
    assert theirs["ok"] is False and theirs["error"]["code"] == "forbidden", theirs
    assert "--agent" in theirs["error"]["message"]
    assert await admission.rows("jobs") == 1
    [refusal] = await audited_refusals(harness, s, expect=1)
    assert refusal["details"]["caller"] == "agent:k8s"
    # Reading, cancelling, approving, billing, node list and reload: not its to ask.
    for subject in (
        s.api_jobs_get,
        s.api_jobs_cancel,
        s.api_jobs_approve,
        f"{s.prefix}.api.billing.statement",
        s.api_nodes("list"),
        s.api_nodes("reload"),
        s.api_nodes("fail"),
    ):
        with pytest.raises(nats.errors.Error):
            await agent.nc.request(subject, json.dumps({"job_id": mine["job_id"]}).encode(), 2)
        assert await agent.violated(subject)
    await agent.nc.close()


async def test_the_agent_credential_keeps_the_inventory_to_its_clusters_nodes(
    servers: Servers, own_identities: Settings, admission: Admission, tmp_path: Path
) -> None:
    s = Subjects(own_identities.subject_prefix)
    agent = await connect(servers.nats_url, as_agent(servers, "vision"), tmp_path, "agent")
    reason = {"operator": "agent k8s", "reason": "kubernetes: a GPU node"}
    added = await request(agent, s.api_nodes("add"), {"spec": NODE, **reason})
    assert added["ok"], added
    for verb in ("drain", "undrain", "remove"):
        if verb == "remove":
            await request(agent, s.api_nodes("drain"), {"node": "gpu-17", **reason})
        reply = await request(agent, s.api_nodes(verb), {"node": "gpu-17", **reason})
        assert reply["ok"], (verb, reply)
    await agent.nc.close()


async def test_the_agent_service_identity_may_not_ask_the_api(
    servers: Servers, own_identities: Settings, admission: Admission, tmp_path: Path
) -> None:
    _auth(servers)
    s = Subjects(own_identities.subject_prefix)
    assert own_identities.security.auth_dir is not None
    creds = (own_identities.security.auth_dir / "creds" / "agent.creds").read_text()
    service = await connect(servers.nats_url, creds, tmp_path, "agent-service")
    body = json.dumps({"name": "pod", "team": "vision", "gpus": {"count": 1}}).encode()
    await service.publish(s.api_jobs_submit, body)
    assert await service.violated(s.api_jobs_submit)
    await service.publish(s.api_nodes("add"), b"{}")
    assert await service.violated(s.api_nodes("add"))
    assert await admission.rows("jobs") == 0
    await service.nc.close()


def test_an_agent_credential_must_name_its_teams_and_only_an_agent_names_teams(
    servers: Servers,
) -> None:
    bundle = _auth(servers)
    with pytest.raises(AuthError, match="--teams"):
        natsauth.issue_client(bundle, "agent", "k8s")
    with pytest.raises(AuthError, match="only an agent"):
        natsauth.issue_client(bundle, "team", "vision", teams=["nlp"])
    with pytest.raises(ValueError, match="team name"):
        natsauth.issue_client(bundle, "agent", "k8s", teams=["a.b"])


def test_gpusched_auth_issue_writes_an_agent_credential_naming_its_teams(
    servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import base64

    from gpusched.cli.main import main

    bundle = _auth(servers)
    out = tmp_path / "agent-api.creds"
    argv = ["auth", "issue", "--agent", "k8s", "--teams", "vision, nlp", "--dir", str(bundle.root)]
    assert main([*argv, "--out", str(out)]) == 0
    jwt = out.read_text().split("-----BEGIN NATS USER JWT-----")[1].split("------END")[0].strip()
    claims = json.loads(base64.urlsafe_b64decode(jwt.split(".")[1] + "=="))
    assert claims["name"] == "agent:k8s"
    assert claims["nats"]["tags"] == ["team:nlp", "team:vision"]
    assert main(["auth", "issue", "--agent", "k8s", "--dir", str(bundle.root)]) != 0
    assert "--teams goes with --agent" in capsys.readouterr().err


def test_gpusched_auth_issue_gives_a_dotted_node_its_subject_and_refuses_a_typo(
    servers: Servers, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import base64

    from gpusched.cli.main import main

    bundle = _auth(servers)
    out = tmp_path / "node.creds"
    argv = ["auth", "issue", "--dir", str(bundle.root), "--prefix", "gpusched"]
    assert main([*argv, "--node", "ip-10-0-1-23.ec2.internal", "--out", str(out)]) == 0
    jwt = out.read_text().split("-----BEGIN NATS USER JWT-----")[1].split("------END")[0].strip()
    claims = json.loads(base64.urlsafe_b64decode(jwt.split(".")[1] + "=="))
    # The node issuer's scope lets a node publish on its own name: the subject token.
    assert claims["name"] == "gpusched.telemetry.gpu.ip-10-0-1-23~ec2~internal"

    assert main([*argv, "--node", "gpu node 7"]) != 0
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "cannot be used in a subject" in line
