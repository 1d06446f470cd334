"""`gpusched auth`: the installation's NATS keys and credentials (infra.natsauth).

gpusched auth init DIR [--prefix P] [--force]
    A new bundle in DIR: keys/, server/auth.conf (for nats-server to include) and
    creds/ for every service, the installer (admin), the audit reader, the
    simulated cluster's driver and a first operator. With an existing bundle, only
    the credentials are written again (a rotation); --force makes new keys, which
    invalidates every credential the old ones signed once NATS loads the new
    auth.conf.
gpusched auth issue (--team T | --operator NAME | --node NODE | --agent NAME --teams T,..)
                    [--dir DIR] [--ttl SECONDS] [--out FILE]
    Credentials for one team or operator (the API), one node (its own telemetry
    subject only), or a cluster agent (submits for the teams named, node commands;
    the Kubernetes agent's GPUSCHED_AGENT__KUBERNETES__API_CREDENTIALS). DIR defaults
    to the running stack's bundle.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpusched.cli.errors import BadInput, NotConfigured
from gpusched.cli.numbers import number

if TYPE_CHECKING:
    from gpusched.infra.natsauth import AuthBundle
    from gpusched.infra.settings import Settings

app = typer.Typer(help="NATS keys and credentials of this installation.", no_args_is_help=True)


def _bundle_dir(given: Path | None, settings: Settings) -> Path:
    from gpusched.cli.client import stack_settings

    if given is not None:
        return given
    resolved = stack_settings(settings)
    if resolved.security.auth_dir is None:
        raise NotConfigured(
            "no credentials bundle: give --dir, or set GPUSCHED_SECURITY__AUTH_DIR, or run "
            "it where `gpusched up` keeps its data (GPUSCHED_DATA_DIR)"
        )
    return resolved.security.auth_dir


def _load(root: Path) -> AuthBundle:
    from gpusched.infra.natsauth import AuthBundle, AuthError

    try:
        return AuthBundle.load(root)
    except AuthError as exc:
        raise NotConfigured(str(exc)) from None


@app.command("init", help="Make (or refresh) a credentials bundle in DIR.")
def init(
    dir: Annotated[Path, typer.Argument(help="where the bundle goes")],
    prefix: Annotated[
        str | None, typer.Option(help="the subject prefix (default: GPUSCHED_SUBJECT_PREFIX)")
    ] = None,
    force: Annotated[bool, typer.Option(help="new keys: every old credential dies")] = False,
) -> int:
    from gpusched.cli.session import load_settings
    from gpusched.contracts.subjects import Subjects
    from gpusched.infra import natsauth
    from gpusched.infra.natsauth import AuthBundle

    settings = load_settings()
    fresh = force or not (dir / "keys" / "operator.nk").is_file()
    bundle = AuthBundle.create(dir) if fresh else _load(dir)
    bundle.write_server_config()
    written = natsauth.write_installation(bundle, Subjects(prefix or settings.subject_prefix))
    print(f"{'new keys' if fresh else 'keys kept'} in {bundle.keys_dir} (keep them secret)")
    print(f"nats-server fragment: {bundle.server_config} (include it from the server config)")
    for identity, path in sorted(written.items()):
        print(f"  {identity:<11} {path}")
    print(f"clients account: {bundle.clients_account_id} (GPUSCHED_SECURITY__CLIENTS_ACCOUNT)")
    print(f"job issuer key:  {bundle.job_issuer_path} (GPUSCHED_SECURITY__JOB_SIGNING_KEY)")
    return 0


@app.command("issue", help="Credentials for one team or operator (the API), one node, or an agent.")
def issue(
    team: Annotated[str | None, typer.Option(help="a team's credentials")] = None,
    operator: Annotated[str | None, typer.Option(help="an operator's credentials")] = None,
    node: Annotated[str | None, typer.Option(help="a node's (its own telemetry only)")] = None,
    agent: Annotated[
        str | None, typer.Option(help="a cluster agent's (submits for --teams only)")
    ] = None,
    teams: Annotated[
        str | None, typer.Option(help="with --agent: the teams it submits for, comma-separated")
    ] = None,
    dir: Annotated[Path | None, typer.Option(help="the bundle (default: the stack's)")] = None,
    prefix: Annotated[str | None, typer.Option(help="the subject prefix (nodes only)")] = None,
    ttl: Annotated[
        float | None,
        typer.Option(parser=number(1), help="seconds until the credentials expire (>= 1)"),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="write here (mode 0600) instead of stdout")
    ] = None,
) -> int:
    from gpusched.cli.client import stack_settings
    from gpusched.cli.session import load_settings
    from gpusched.contracts.subjects import Subjects
    from gpusched.infra import natsauth
    from gpusched.infra.natsauth import AuthError, Identity, node_user_name

    if sum(x is not None for x in (team, operator, node, agent)) != 1:
        raise BadInput("give exactly one of --team, --operator, --node and --agent")
    if (agent is None) != (teams is None):
        raise BadInput("--teams goes with --agent (the teams the agent submits for)")
    settings = load_settings()
    bundle = _load(_bundle_dir(dir, settings))
    try:
        if node is not None:
            node_prefix = prefix or stack_settings(settings).subject_prefix
            identity = Identity(node_user_name(node_prefix, node), ttl_s=ttl)
            Subjects(node_prefix).telemetry_gpu(node)  # a name a subject token stands for
            creds = bundle.node_credentials_issuer().creds(identity)
        elif team is not None:
            creds = natsauth.issue_client(bundle, "team", team, ttl_s=ttl)
        elif agent is not None:
            named = [t.strip() for t in (teams or "").split(",") if t.strip()]
            creds = natsauth.issue_client(bundle, "agent", agent, ttl_s=ttl, teams=named)
        else:
            assert operator is not None
            creds = natsauth.issue_client(bundle, "operator", operator, ttl_s=ttl)
    except (AuthError, ValueError) as exc:
        raise NotConfigured(str(exc)) from None
    if out is None:
        sys.stdout.write(creds)
    else:
        try:
            natsauth.write_secret(out, creds)
        except AuthError as exc:
            raise BadInput(str(exc)) from None
        except OSError as exc:
            raise BadInput(f"cannot write {out}: {exc.strerror or exc}") from None
        print(f"wrote {out}")
    return 0
