"""NATS identities: nkeys, signed JWTs and credentials files (NATS decentralized auth).

nats-server runs in operator mode and enforces every permission itself; nothing here
is a check in application code. The trust chain:

- an operator key signs three accounts: SYS (the server's own), GPUSCHED (the services,
  the jobs and the nodes; JetStream is enabled for it) and CLIENTS (teams and operators
  calling the API). CLIENTS imports `<p>.api.>` from GPUSCHED with `share`, so every
  API request arrives with a `Nats-Request-Info` header written by the server: the
  caller's identity, which no client can forge (see contracts.identity).
- the GPUSCHED account key signs the service users, each with the permissions of
  contracts.permissions. Two *scoped* signing keys of that account issue the
  short-lived users: the job issuer (a job may publish only `<name>.events` and
  subscribe only `<name>.control`, where the user's name is `<p>.jobs.<job id>`) and the
  node issuer (a node may publish only `<name>`, i.e. `<p>.telemetry.gpu.<node>`). The
  scope lives in the account JWT, so even a stolen issuer key cannot mint anything
  wider than one job or one node.
- the CLIENTS account key signs team and operator users (`gpusched auth issue`).
- a job, a node, a team or an operator publishes at most ``CLIENT_MAX_PAYLOAD`` (1 MiB,
  NATS's default) in one message, in the job and node scopes and the CLIENTS account;
  the services may send what the server takes (8 MiB in the stacks gpusched ships, for
  admission's inventory of a large cluster). A client over its limit is cut off by the
  server, so the SDK and the CLI refuse such a message before sending it.

The bundle lives in a directory (`<data_dir>/auth` for the embedded stack):
  keys/      seeds (mode 0600): operator, accounts, job-issuer.nk, node-issuer.nk
  server/    auth.conf, the fragment nats-server includes (operator, resolver_preload)
  creds/     <identity>.creds for the services, admin and the first operator
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import secrets
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nkeys

from gpusched.contracts import permissions
from gpusched.contracts.permissions import INBOX_ROOT, inbox_prefix
from gpusched.contracts.subjects import Subjects, check_token, node_token

__all__ = [
    "CLIENT_MAX_PAYLOAD",
    "INBOX_ROOT",
    "AuthBundle",
    "AuthError",
    "Identity",
    "Issuer",
    "Permissions",
    "creds_text",
    "inbox_prefix",
    "job_user_name",
    "message_size",
    "node_user_name",
]

UNLIMITED = -1
# The most a job, a node, a team or an operator may publish in one message.
CLIENT_MAX_PAYLOAD = 1 << 20
OPERATOR_NAME = "gpusched"
SERVICE_ACCOUNT = "GPUSCHED"
CLIENTS_ACCOUNT = "CLIENTS"
SYSTEM_ACCOUNT = "SYS"
# The roles of the scoped signing keys in the GPUSCHED account.
JOB_ROLE = "job"
NODE_ROLE = "node"


# The longest lifetime credentials may be minted with (10 years).
MAX_TTL_S = 10 * 365 * 86400.0


def message_size(data: bytes, headers: Mapping[str, str] | None = None) -> int:
    """The bytes a message counts against a max_payload: its data and its headers as
    NATS writes them (``NATS/1.0``, one ``key: value`` line each, a blank line)."""
    if not headers:
        return len(data)
    lines = "".join(f"{key}: {value}\r\n" for key, value in headers.items())
    return len(data) + len(f"NATS/1.0\r\n{lines}\r\n".encode())


class AuthError(RuntimeError):
    """A credentials bundle is missing, unreadable or inconsistent; the message says
    which file and what to do."""


@dataclass(frozen=True)
class Permissions:
    """What nats-server lets one user publish and subscribe (allow lists only:
    everything else is denied). `respond`: may answer requests it received (on
    the reply subject the server hands it), nothing more."""

    publish: tuple[str, ...] = ()
    subscribe: tuple[str, ...] = ()
    respond: bool = False

    def claims(self) -> dict[str, object]:
        out: dict[str, object] = {
            "pub": {"allow": sorted(set(self.publish))} if self.publish else {"deny": [">"]},
            "sub": {"allow": sorted(set(self.subscribe))} if self.subscribe else {"deny": [">"]},
        }
        if self.respond:
            out["resp"] = {"max": 1, "ttl": 0}
        return out


def job_user_name(prefix: str, job_id: str) -> str:
    return f"{prefix}.jobs.{job_id}"


def node_user_name(prefix: str, node: str) -> str:
    """The node's user: its name is the one subject it may publish on."""
    return f"{prefix}.telemetry.gpu.{node_token(node)}"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _new_key(prefix: int) -> nkeys.KeyPair:
    return nkeys.from_seed(nkeys.encode_seed(secrets.token_bytes(32), prefix))


def _public(key: nkeys.KeyPair) -> str:
    return str(key.public_key.decode())


def _seed(key: nkeys.KeyPair) -> str:
    return str(key.seed.decode())


_HEADER = _b64(json.dumps({"typ": "JWT", "alg": "ed25519-nkey"}).encode())


def sign_jwt(signer: nkeys.KeyPair, claims: Mapping[str, object], now: float | None = None) -> str:
    """A NATS JWT (v2): the claims signed by `signer`, with the jti NATS derives from
    them (base32 of SHA-512/256 of the claims without it)."""
    body: dict[str, object] = {**claims, "iat": int(now if now is not None else time.time())}
    body["iss"] = _public(signer)
    body["jti"] = ""
    digest = hashlib.new("sha512_256", json.dumps(body, separators=(",", ":")).encode())
    body["jti"] = base64.b32encode(digest.digest()).decode().rstrip("=")
    payload = _b64(json.dumps(body, separators=(",", ":")).encode())
    signature = signer.sign(f"{_HEADER}.{payload}".encode())
    return f"{_HEADER}.{payload}.{_b64(signature)}"


def creds_text(user_jwt: str, user_seed: str) -> str:
    """A `.creds` file as nats-server's tools write it and nats-py reads it."""
    return (
        "-----BEGIN NATS USER JWT-----\n"
        f"{user_jwt}\n"
        "------END NATS USER JWT------\n\n"
        "************************* IMPORTANT *************************\n"
        "NKEY Seed printed below can be used to sign and prove identity.\n"
        "NKEYs are sensitive and should be treated as secrets.\n\n"
        "-----BEGIN USER NKEY SEED-----\n"
        f"{user_seed}\n"
        "------END USER NKEY SEED------\n\n"
        "*************************************************************\n"
    )


@dataclass(frozen=True)
class Identity:
    """A user to mint: its name (audited by the server, shown to services as the
    caller), permissions, tags and lifetime (None: no expiry)."""

    name: str
    permissions: Permissions = field(default_factory=Permissions)
    tags: Sequence[str] = ()
    ttl_s: float | None = None

    def __post_init__(self) -> None:
        # NaN would mint credentials with no usable expiry, Infinity would not mint at
        # all (OverflowError), and an expiry past int64 is refused by the server.
        ttl = self.ttl_s
        if ttl is not None and not (ttl > 0 and ttl <= MAX_TTL_S):
            raise AuthError(
                f"credentials' lifetime must be more than 0 and at most {MAX_TTL_S:.0f} "
                f"seconds (10 years), not {ttl!r}; omit it for credentials that do not expire"
            )


def _user_jwt(
    signer: nkeys.KeyPair,
    identity: Identity,
    *,
    issuer_account: str | None,
    scoped: bool,
    now: float,
) -> tuple[str, str]:
    user = _new_key(nkeys.PREFIX_BYTE_USER)
    nats: dict[str, object] = {"type": "user", "version": 2}
    if not scoped:
        # A scoped signer's template is the whole permission set: the server refuses a
        # user of such a key that carries permissions or limits of its own.
        nats.update({"subs": UNLIMITED, "data": UNLIMITED, "payload": UNLIMITED})
        nats.update(identity.permissions.claims())
    if issuer_account is not None:
        nats["issuer_account"] = issuer_account
    if identity.tags:
        nats["tags"] = list(identity.tags)
    claims: dict[str, object] = {"sub": _public(user), "name": identity.name, "nats": nats}
    if identity.ttl_s is not None:
        claims["exp"] = int(now + identity.ttl_s)
    return sign_jwt(signer, claims, now), _seed(user)


@dataclass(frozen=True)
class Issuer:
    """A key that mints users of one account: the account key itself (any permissions)
    or one of its scoped signing keys (the scope's permissions only)."""

    key: nkeys.KeyPair
    account: str  # the public key of the account the users belong to
    scoped: bool

    @classmethod
    def from_seed_file(cls, path: Path, *, scoped: bool) -> Issuer:
        """A signing key from its seed file: the seed, then the public key of the account
        it signs for (AuthBundle.create writes both; an account's own key needs none)."""
        try:
            words = path.read_text().split()
            key = nkeys.from_seed(bytearray(words[0].encode()))
            account = words[1] if len(words) > 1 else _public(key)
            return cls(key, account, scoped)
        except (OSError, IndexError, nkeys.NkeysError, ValueError) as exc:
            raise AuthError(f"cannot read the signing key {path}: {exc}") from exc

    def creds(self, identity: Identity, now: float | None = None) -> str:
        at = time.time() if now is None else now
        own = _public(self.key) == self.account
        jwt, seed = _user_jwt(
            self.key,
            identity,
            issuer_account=None if own else self.account,
            scoped=self.scoped,
            now=at,
        )
        return creds_text(jwt, seed)


def write_secret(path: Path, text: str) -> None:
    """Written whole or not at all, readable by the owner only. It replaces a file, never
    a device or a directory (the replacing rename would put the secret in /dev/stdout's
    place, or fail half done)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(path.lstat().st_mode) and not path.is_symlink():
            raise AuthError(f"{path} is not a regular file: give the path of a file to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)


def _scope(role: str, key: nkeys.KeyPair, permissions: Permissions) -> dict[str, object]:
    return {
        "kind": "user_scope",
        "key": _public(key),
        "role": role,
        "template": {
            **permissions.claims(),
            "subs": UNLIMITED,
            "data": UNLIMITED,
            "payload": CLIENT_MAX_PAYLOAD,
        },
    }


# What a job may do, whatever its issuer asks for: its name is `<p>.jobs.<id>`.
JOB_SCOPE = Permissions(
    publish=("{{name()}}.events",),
    subscribe=("{{name()}}.control", f"{INBOX_ROOT}.{{{{name()}}}}.>"),
)
# The JetStream API calls the SDK makes: publish an event and wait for its ack, and an
# ephemeral push consumer whose filter is the job's own control subject (the filtered
# create subject: the server refuses any other filter).
JOB_SCOPE_JS = ("$JS.API.CONSUMER.CREATE.*.*.{{name()}}.control",)
# What a node may do: publish its own telemetry subject, nothing else.
NODE_SCOPE = Permissions(
    publish=("{{name()}}",),
    subscribe=(f"{INBOX_ROOT}.{{{{name()}}}}.>",),
)


@dataclass
class AuthBundle:
    """The keys and account JWTs of one installation (see the module docstring)."""

    root: Path
    operator: nkeys.KeyPair
    system: nkeys.KeyPair
    service_account: nkeys.KeyPair
    clients_account: nkeys.KeyPair
    job_issuer: nkeys.KeyPair
    node_issuer: nkeys.KeyPair

    _KEYS = (
        "operator",
        "system",
        "service-account",
        "clients-account",
        "job-issuer",
        "node-issuer",
    )

    # --- files ------------------------------------------------------------------------
    @property
    def keys_dir(self) -> Path:
        return self.root / "keys"

    @property
    def creds_dir(self) -> Path:
        return self.root / "creds"

    @property
    def server_config(self) -> Path:
        return self.root / "server" / "auth.conf"

    @property
    def job_issuer_path(self) -> Path:
        return self.keys_dir / "job-issuer.nk"

    @property
    def node_issuer_path(self) -> Path:
        return self.keys_dir / "node-issuer.nk"

    def creds_path(self, identity: str) -> Path:
        return self.creds_dir / f"{identity}.creds"

    @classmethod
    def create(cls, root: Path) -> AuthBundle:
        """New keys (the old ones, if any, are replaced: every user they signed dies
        when the server loads the new auth.conf)."""
        bundle = cls(
            root=root,
            operator=_new_key(nkeys.PREFIX_BYTE_OPERATOR),
            system=_new_key(nkeys.PREFIX_BYTE_ACCOUNT),
            service_account=_new_key(nkeys.PREFIX_BYTE_ACCOUNT),
            clients_account=_new_key(nkeys.PREFIX_BYTE_ACCOUNT),
            job_issuer=_new_key(nkeys.PREFIX_BYTE_ACCOUNT),
            node_issuer=_new_key(nkeys.PREFIX_BYTE_ACCOUNT),
        )
        for name in cls._KEYS:
            text = _seed(bundle._key(name)) + "\n"
            if name in ("job-issuer", "node-issuer"):
                # The account a scoped key signs for (its users name it issuer_account).
                text += bundle.service_account_id + "\n"
            write_secret(bundle.keys_dir / f"{name}.nk", text)
        bundle.write_server_config()
        return bundle

    @classmethod
    def load(cls, root: Path) -> AuthBundle:
        keys: dict[str, nkeys.KeyPair] = {}
        for name in cls._KEYS:
            path = root / "keys" / f"{name}.nk"
            try:
                keys[name] = nkeys.from_seed(bytearray(path.read_bytes().split()[0]))
            except (OSError, nkeys.NkeysError, ValueError) as exc:
                raise AuthError(
                    f"cannot read {path}: {exc}; make a new bundle with `gpusched auth init`"
                ) from exc
        return cls(
            root=root,
            operator=keys["operator"],
            system=keys["system"],
            service_account=keys["service-account"],
            clients_account=keys["clients-account"],
            job_issuer=keys["job-issuer"],
            node_issuer=keys["node-issuer"],
        )

    @classmethod
    def ensure(cls, root: Path) -> AuthBundle:
        """The bundle in `root`, made on first use."""
        if (root / "keys" / "operator.nk").is_file():
            return cls.load(root)
        return cls.create(root)

    def _key(self, name: str) -> nkeys.KeyPair:
        key: nkeys.KeyPair = getattr(self, name.replace("-", "_"))
        return key

    # --- public keys ------------------------------------------------------------------
    @property
    def service_account_id(self) -> str:
        return _public(self.service_account)

    @property
    def clients_account_id(self) -> str:
        return _public(self.clients_account)

    # --- issuers ----------------------------------------------------------------------
    def service_issuer(self) -> Issuer:
        return Issuer(self.service_account, self.service_account_id, scoped=False)

    def client_issuer(self) -> Issuer:
        return Issuer(self.clients_account, self.clients_account_id, scoped=False)

    def job_credentials_issuer(self) -> Issuer:
        return Issuer(self.job_issuer, self.service_account_id, scoped=True)

    def node_credentials_issuer(self) -> Issuer:
        return Issuer(self.node_issuer, self.service_account_id, scoped=True)

    def write_creds(self, identity: str, creds: str) -> Path:
        path = self.creds_path(identity)
        write_secret(path, creds)
        return path

    # --- the server's side ------------------------------------------------------------
    def account_jwts(self, now: float | None = None) -> dict[str, str]:
        op = self.operator
        limits = {
            "subs": UNLIMITED,
            "data": UNLIMITED,
            "payload": UNLIMITED,
            "imports": UNLIMITED,
            "exports": UNLIMITED,
            "wildcards": True,
            "conn": UNLIMITED,
            "leaf": UNLIMITED,
        }
        jetstream = {"mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1}
        job_scope = _scope(
            JOB_ROLE,
            self.job_issuer,
            Permissions(JOB_SCOPE.publish + JOB_SCOPE_JS, JOB_SCOPE.subscribe),
        )
        system = sign_jwt(
            op,
            {
                "sub": _public(self.system),
                "name": SYSTEM_ACCOUNT,
                "nats": {"type": "account", "version": 2, "limits": limits},
            },
            now,
        )
        service = sign_jwt(
            op,
            {
                "sub": self.service_account_id,
                "name": SERVICE_ACCOUNT,
                "nats": {
                    "type": "account",
                    "version": 2,
                    "limits": {**limits, **jetstream},
                    "signing_keys": [job_scope, _scope(NODE_ROLE, self.node_issuer, NODE_SCOPE)],
                    # The API, served to the CLIENTS account (teams, operators).
                    "exports": [
                        {
                            "name": "api",
                            "subject": "*.api.>",
                            "type": "service",
                            "response_type": "Singleton",
                        }
                    ],
                    # A user of this account gets nothing it was not granted.
                    "default_permissions": {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}},
                },
            },
            now,
        )
        clients = sign_jwt(
            op,
            {
                "sub": self.clients_account_id,
                "name": CLIENTS_ACCOUNT,
                "nats": {
                    "type": "account",
                    "version": 2,
                    "limits": {**limits, "payload": CLIENT_MAX_PAYLOAD},
                    "imports": [
                        {
                            "name": "api",
                            "subject": "*.api.>",
                            "account": self.service_account_id,
                            "type": "service",
                            # The server adds Nats-Request-Info: who is asking.
                            "share": True,
                        }
                    ],
                    "default_permissions": {"pub": {"deny": [">"]}, "sub": {"deny": [">"]}},
                },
            },
            now,
        )
        return {
            _public(self.system): system,
            self.service_account_id: service,
            self.clients_account_id: clients,
        }

    def operator_jwt(self, now: float | None = None) -> str:
        return sign_jwt(
            self.operator,
            {
                "sub": _public(self.operator),
                "name": OPERATOR_NAME,
                "nats": {
                    "type": "operator",
                    "version": 2,
                    "system_account": _public(self.system),
                },
            },
            now,
        )

    def server_config_text(self) -> str:
        preload = "\n".join(f'  {key}: "{jwt}"' for key, jwt in self.account_jwts().items())
        return (
            "# gpusched: NATS decentralized auth (operator mode). Made by `gpusched auth init`;\n"
            "# include it from the server configuration. Keep it with the keys it names.\n"
            f'operator: "{self.operator_jwt()}"\n'
            f"system_account: {_public(self.system)}\n"
            "resolver: MEMORY\n"
            "resolver_preload: {\n"
            f"{preload}\n"
            "}\n"
        )

    def write_server_config(self) -> Path:
        write_secret(self.server_config, self.server_config_text())
        return self.server_config


def creds_user_name(path: Path) -> str:
    """The user name in a credentials file's JWT (read, not verified: the server does
    that), for the inbox prefix the server lets that user subscribe to."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise AuthError(f"cannot read the NATS credentials file {path}: {exc}") from exc
    try:
        jwt = text.split("-----BEGIN NATS USER JWT-----", 1)[1].split("---", 1)[0].strip()
        payload = jwt.split(".")[1]
        claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        name = claims["name"]
    except (IndexError, KeyError, ValueError) as exc:
        raise AuthError(
            f"{path} is not a NATS credentials file (no user JWT with a name in it)"
        ) from exc
    if not isinstance(name, str) or not name:
        raise AuthError(f"{path}: the user JWT has no name")
    return name


def connect_options(credentials: Path | None) -> dict[str, object]:
    """The nats-py connect options of a process that holds `credentials` (none: an
    unauthenticated connection, which an authenticated server refuses)."""
    if credentials is None:
        return {}
    name = creds_user_name(credentials)
    return {"user_credentials": str(credentials), "inbox_prefix": inbox_prefix(name)}


# The identities `gpusched up` (and `gpusched auth init`) write into creds/, besides
# one file per service: the installer, the audit reader, the simulated cluster's
# driver, and the first operator.
ADMIN, AUDITOR, SIMULATOR, FIRST_OPERATOR = "admin", "auditor", "simulator", "operator"


def issue_client(
    bundle: AuthBundle,
    role: str,
    name: str,
    ttl_s: float | None = None,
    teams: Sequence[str] = (),
) -> str:
    """Credentials of a team (`role` "team"), an operator, or a cluster agent (`agent`:
    it may submit for `teams` only, and send node commands) for the CLIENTS account."""
    from gpusched.contracts.identity import AGENT_TAG, OPERATOR_TAG, TEAM_TAG

    tags = {"team": TEAM_TAG, "operator": OPERATOR_TAG, "agent": AGENT_TAG}
    if role not in tags:
        raise AuthError(f"unknown role {role!r}: use team, operator or agent")
    check_token(name, f"{role} name")
    user = f"{tags[role]}{name}"
    if role == "agent":
        if not teams:
            raise AuthError("an agent's credentials name the teams it submits for: give --teams")
        for team in teams:
            check_token(team, "team name")
        publish, subscribe = permissions.agent_client_permissions(user)
    elif teams:
        raise AuthError("only an agent's credentials name teams")
    else:
        publish, subscribe = permissions.client_permissions(user)
    identity = Identity(
        user,
        Permissions(tuple(publish), tuple(subscribe)),
        tags=tuple(f"{TEAM_TAG}{team}" for team in sorted(set(teams))),
        ttl_s=ttl_s,
    )
    return bundle.client_issuer().creds(identity)


def write_installation(bundle: AuthBundle, subjects: Subjects) -> dict[str, Path]:
    """(Re)write the credentials of every service and helper identity for `subjects`'
    prefix; returns identity -> creds path. Cheap, so `up` does it at every start:
    that is also how service credentials are rotated."""
    issuer = bundle.service_issuer()
    written: dict[str, Path] = {}
    makers = {
        ADMIN: permissions.admin_permissions,
        AUDITOR: permissions.auditor_permissions,
        SIMULATOR: permissions.simulator_permissions,
    }
    for service in permissions.SERVICE_NAMES:
        name, pub, sub = permissions.service_permissions(subjects, service)
        identity = Identity(name, Permissions(tuple(pub), tuple(sub), respond=True))
        written[service] = bundle.write_creds(service, issuer.creds(identity))
    for identity_name, make in makers.items():
        name, pub, sub = make(subjects)
        identity = Identity(name, Permissions(tuple(pub), tuple(sub)))
        written[identity_name] = bundle.write_creds(identity_name, issuer.creds(identity))
    if not bundle.creds_path(FIRST_OPERATOR).is_file():
        written[FIRST_OPERATOR] = bundle.write_creds(
            FIRST_OPERATOR, issue_client(bundle, "operator", "admin")
        )
    else:
        written[FIRST_OPERATOR] = bundle.creds_path(FIRST_OPERATOR)
    return written
