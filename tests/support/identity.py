"""The test's own NATS identity (the harness): anything in the service account.

Services under test connect with their real identities (contracts.permissions); the
test itself, which plays jobs, nodes and observers at will, uses this one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpusched.infra import natsauth
from gpusched.infra.natsauth import AuthBundle
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
