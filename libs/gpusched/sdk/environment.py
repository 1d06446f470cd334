"""How a launched job learns where it runs: the environment the cluster agent sets."""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError

from gpusched.infra.tls import NATS_TLS, TlsConfigError, TlsSettings, check_files, client_context
from gpusched.sdk.errors import JobClientError


class EnvVar(StrEnum):
    NATS_URL = "GPUSCHED_NATS_URL"
    SUBJECT_PREFIX = "GPUSCHED_SUBJECT_PREFIX"
    JOB_ID = "GPUSCHED_JOB_ID"
    ATTEMPT = "GPUSCHED_ATTEMPT"
    RESUME_URI = "GPUSCHED_RESUME_URI"
    RESUME_CHECKPOINT_ID = "GPUSCHED_RESUME_CHECKPOINT_ID"
    CHECKPOINT_DIR = "GPUSCHED_CHECKPOINT_DIR"
    # The job's own NATS credentials (a .creds file the agent writes and renews).
    CREDENTIALS = "GPUSCHED_NATS_CREDENTIALS"
    # The CA of a NATS that requires TLS; the other GPUSCHED_NATS_TLS__* are read too.
    NATS_TLS_CA_FILE = "GPUSCHED_NATS_TLS__CA_FILE"


# TLS to NATS, as the services read it: GPUSCHED_NATS_TLS__CA_FILE (what the agent passes
# a job), __VERIFY, __SERVER_NAME, __CERT_FILE, __KEY_FILE. An empty value is unset.
_TLS_FIELDS = tuple(TlsSettings.model_fields)


DEFAULT_PREFIX = "gpusched"


def without_credentials(nats_url: str) -> str:
    """NATS URL(s) without the user and password (or token) they may carry: what a job
    is given (those are the agent's identity, not the job's) and what a message shows."""
    urls = []
    for url in nats_url.split(","):
        parts = urlsplit(url.strip())
        urls.append(urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2])))
    return ",".join(urls)


@dataclass(frozen=True, slots=True)
class JobEnvironment:
    nats_url: str
    job_id: str
    attempt: int
    prefix: str = DEFAULT_PREFIX
    resume_uri: str | None = None
    resume_checkpoint_id: str | None = None
    checkpoint_dir: Path | None = None
    credentials: Path | None = None
    nats_tls: TlsSettings | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnvironment:
        env = os.environ if environ is None else environ
        missing = [v.value for v in (EnvVar.NATS_URL, EnvVar.JOB_ID) if not env.get(v)]
        if missing:
            raise JobClientError(
                f"{', '.join(missing)} not set: this process was not launched by a gpusched "
                "agent (set them by hand to run it against a control plane)"
            )
        attempt_text = env.get(EnvVar.ATTEMPT) or "1"
        try:
            attempt = int(attempt_text)
        except ValueError:
            raise JobClientError(f"{EnvVar.ATTEMPT}={attempt_text!r} is not a number") from None
        checkpoint_dir = env.get(EnvVar.CHECKPOINT_DIR)
        return cls(
            nats_url=env[EnvVar.NATS_URL],
            job_id=env[EnvVar.JOB_ID],
            attempt=attempt,
            prefix=env.get(EnvVar.SUBJECT_PREFIX) or DEFAULT_PREFIX,
            resume_uri=env.get(EnvVar.RESUME_URI) or None,
            resume_checkpoint_id=env.get(EnvVar.RESUME_CHECKPOINT_ID) or None,
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir else None,
            credentials=Path(creds) if (creds := env.get(EnvVar.CREDENTIALS)) else None,
            nats_tls=_nats_tls(env),
        )

    def nats_tls_context(self) -> ssl.SSLContext | None:
        """The TLS context of the connection to NATS; None: as the URL says."""
        try:
            return client_context(self.nats_tls, NATS_TLS)
        except TlsConfigError as exc:
            raise JobClientError(str(exc)) from None

    def to_environ(self) -> dict[str, str]:
        """The variables for a child process; absent values are empty, not inherited
        (the TLS ones are left out when unset)."""
        return {
            EnvVar.NATS_URL: self.nats_url,
            EnvVar.SUBJECT_PREFIX: self.prefix,
            EnvVar.JOB_ID: self.job_id,
            EnvVar.ATTEMPT: str(self.attempt),
            EnvVar.RESUME_URI: self.resume_uri or "",
            EnvVar.RESUME_CHECKPOINT_ID: self.resume_checkpoint_id or "",
            EnvVar.CHECKPOINT_DIR: str(self.checkpoint_dir) if self.checkpoint_dir else "",
            EnvVar.CREDENTIALS: str(self.credentials) if self.credentials else "",
            **_tls_environ(self.nats_tls),
        }


def _nats_tls(env: Mapping[str, str]) -> TlsSettings | None:
    given = {name: env[_tls_var(name)] for name in _TLS_FIELDS if env.get(_tls_var(name))}
    if not given:
        return None
    try:
        tls = TlsSettings.model_validate(given)
        check_files(tls, NATS_TLS)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        name = _tls_var(str(error["loc"][0])) if error.get("loc") else NATS_TLS
        raise JobClientError(f"{name}: {error['msg']}") from None
    except TlsConfigError as exc:
        raise JobClientError(str(exc)) from None
    return tls


def _tls_environ(tls: TlsSettings | None) -> dict[str, str]:
    # Only what is set: an empty GPUSCHED_NATS_TLS__VERIFY would be an invalid setting
    # for a process that reads Settings (the agent strips its own GPUSCHED_* anyway).
    if tls is None:
        return {}
    values = tls.model_dump(exclude_none=True)
    return {
        _tls_var(name): str(value).lower() if isinstance(value, bool) else str(value)
        for name, value in values.items()
    }


def _tls_var(name: str) -> str:
    return f"{NATS_TLS}__{name.upper()}"
