"""The test's own NATS identity (the harness): anything in the service account.

Services under test connect with their real identities (contracts.permissions); the
test itself, which plays jobs, nodes and observers at will, uses this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpusched.infra import natsauth
from gpusched.infra.natsauth import AuthBundle, Identity, Issuer, job_user_name
from gpusched.infra.settings import Settings

HARNESS = "harness"


def write_harness(bundle: AuthBundle) -> Path:
    everything = natsauth.Permissions((">",), (">",), respond=True)
    identity = natsauth.Identity(HARNESS, everything)
    return bundle.write_creds(HARNESS, bundle.service_issuer().creds(identity))


def harness_credentials(settings: Settings) -> Path | None:
    """The harness's creds for `settings`' installation (minted on first use where the
    installation's keys are at hand, e.g. a stack's data dir)."""
    auth_dir = settings.security.auth_dir
    if auth_dir is None:
        return None
    path = auth_dir / "creds" / f"{HARNESS}.creds"
    if not path.exists() and (auth_dir / "keys" / "operator.nk").exists():
        write_harness(AuthBundle.load(auth_dir))
    return path


def harness_options(settings: Settings) -> dict[str, Any]:
    """nats.connect options for the test's own connection to `settings`' NATS."""
    return natsauth.connect_options(harness_credentials(settings))


def credentials_of(settings: Settings, identity: str) -> Path | None:
    auth_dir = settings.security.auth_dir
    return None if auth_dir is None else auth_dir / "creds" / f"{identity}.creds"


def job_credentials(settings: Settings, job_id: str, ttl_s: float = 3600) -> str | None:
    """A job's own credentials, as admission issues them at placement (None where the
    NATS of `settings` has no auth)."""
    key = settings.security.job_signing_key
    if key is None:
        return None
    issuer = Issuer.from_seed_file(key, scoped=True)
    return issuer.creds(Identity(job_user_name(settings.subject_prefix, job_id), ttl_s=ttl_s))


def job_credentials_file(
    bundle: AuthBundle | None, prefix: str, job_id: str, into: Path
) -> Path | None:
    """The same, written to a file in `into` for a job process or client."""
    if bundle is None:
        return None
    creds = bundle.job_credentials_issuer().creds(
        Identity(job_user_name(prefix, job_id), ttl_s=3600)
    )
    path = into / f"{job_id}.creds"
    path.write_text(creds)
    return path


def service_env(settings: Settings) -> dict[str, str]:
    """The variables a service process started by a test needs to connect as itself
    (its own credentials from the installation's bundle, as `gpusched up` passes them)."""
    security = settings.security
    env: dict[str, str] = {}
    if security.auth_dir is not None:
        env["GPUSCHED_SECURITY__AUTH_DIR"] = str(security.auth_dir)
    if security.clients_account is not None:
        env["GPUSCHED_SECURITY__CLIENTS_ACCOUNT"] = security.clients_account
    return env
