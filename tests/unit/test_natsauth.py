"""The credentials a bundle mints: signed JWTs of the right shape (the server is the
judge of them: tests/security runs them against nats-server)."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import nkeys
import pytest

from gpusched.contracts.permissions import grants, service_permissions
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.natsauth import AuthBundle, AuthError, Identity, Issuer, job_user_name


def _unpad(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def claims_of(creds: str, signer: nkeys.KeyPair) -> dict[str, Any]:
    """The claims of the user JWT in `creds`, after checking `signer` signed them."""
    jwt = creds.split("-----BEGIN NATS USER JWT-----")[1].split("---")[0].strip()
    header, payload, signature = jwt.split(".")
    signer.verify(f"{header}.{payload}".encode(), _unpad(signature))  # raises if forged
    claims: dict[str, Any] = json.loads(_unpad(payload))
    assert claims["iss"] == signer.public_key.decode()
    return claims


def test_a_job_user_is_scoped_named_after_its_subjects_and_expires(tmp_path: Path) -> None:
    bundle = AuthBundle.create(tmp_path / "auth")
    creds = bundle.job_credentials_issuer().creds(
        Identity(job_user_name("gp", "job-1"), ttl_s=300), now=1_000_000
    )
    claims = claims_of(creds, bundle.job_issuer)
    assert claims["name"] == "gp.jobs.job-1"
    assert claims["exp"] == 1_000_300
    # A scoped key's user carries no permissions of its own: the account's scope rules.
    assert "pub" not in claims["nats"] and "sub" not in claims["nats"]
    assert claims["nats"]["issuer_account"] == bundle.service_account_id
    path = tmp_path / "job.creds"
    path.write_text(creds)
    assert natsauth.connect_options(path)["inbox_prefix"] == "_GS_INBOX.gp.jobs.job-1"


def test_the_job_issuer_file_names_its_account_and_a_bad_file_is_one_clear_error(
    tmp_path: Path,
) -> None:
    bundle = AuthBundle.create(tmp_path / "auth")
    issuer = Issuer.from_seed_file(bundle.job_issuer_path, scoped=True)
    assert issuer.account == bundle.service_account_id
    (tmp_path / "bad.nk").write_text("not a seed\n")
    with pytest.raises(AuthError, match=r"bad\.nk"):
        Issuer.from_seed_file(tmp_path / "bad.nk", scoped=True)
    with pytest.raises(AuthError, match="not a NATS credentials file"):
        (tmp_path / "x.creds").write_text("hello")
        natsauth.creds_user_name(tmp_path / "x.creds")


def test_a_reloaded_bundle_signs_for_the_same_accounts(tmp_path: Path) -> None:
    made = AuthBundle.create(tmp_path / "auth")
    again = AuthBundle.ensure(tmp_path / "auth")
    assert again.service_account_id == made.service_account_id
    assert again.clients_account_id == made.clients_account_id


def test_no_service_may_write_commands_it_does_not_send_or_another_services_events() -> None:
    s = Subjects("gp")
    for service in grants():
        _, publish, _ = service_permissions(s, service)
        for subject in publish:
            if subject.startswith("gp.evt."):
                assert subject == f"gp.evt.{service}.>", (service, subject)
        assert "gp.>" not in publish and ">" not in publish
    _, agent_publish, _ = service_permissions(s, "agent")
    assert not [p for p in agent_publish if p.startswith("gp.cmd.")]


@pytest.mark.parametrize("ttl", [float("nan"), float("inf"), 1e300, 0.0, -5.0])
def test_a_lifetime_that_is_not_a_usable_number_of_seconds_mints_nothing(ttl: float) -> None:
    with pytest.raises(natsauth.AuthError, match="lifetime must be more than 0"):
        natsauth.Identity("team.lab", ttl_s=ttl)


def test_the_longest_lifetime_is_minted_with_its_expiry(tmp_path: Path) -> None:
    identity = natsauth.Identity("team.lab", ttl_s=natsauth.MAX_TTL_S)
    issuer = natsauth.AuthBundle.create(tmp_path).client_issuer()

    creds = issuer.creds(identity)

    token = creds.split("-----BEGIN NATS USER JWT-----\n")[1].split("\n")[0]
    claims = json.loads(base64.urlsafe_b64decode(token.split(".")[1] + "=="))
    assert claims["exp"] - claims["iat"] == int(natsauth.MAX_TTL_S)


def test_a_messages_size_counts_its_headers_as_nats_writes_them() -> None:
    assert natsauth.message_size(b"abc") == 3
    assert natsauth.message_size(b"abc", {}) == 3
    # "NATS/1.0\r\n" + "Nats-Msg-Id: e1\r\n" + "\r\n" = 10 + 17 + 2
    assert natsauth.message_size(b"abc", {"Nats-Msg-Id": "e1"}) == 3 + 29
