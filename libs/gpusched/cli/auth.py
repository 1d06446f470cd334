"""`gpusched auth`: the installation's NATS keys and credentials (infra.natsauth).

gpusched auth init DIR [--prefix P] [--force]
    A new bundle in DIR: keys/, server/auth.conf (for nats-server to include) and
    creds/ for every service, the installer (admin), the audit reader, the
    simulated cluster's driver and a first operator. With an existing bundle, only
    the credentials are written again (a rotation); --force makes new keys, which
    invalidates every credential the old ones signed once NATS loads the new
    auth.conf.
gpusched auth issue (--team T | --operator NAME | --node NODE) [--dir DIR]
                    [--ttl SECONDS] [--out FILE]
    Credentials for one team or operator (the API), or one node (its own telemetry
    subject only). DIR defaults to the running stack's bundle.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from gpusched.cli.client import NotConfigured, stack_settings
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.natsauth import AuthBundle, AuthError, Identity, node_user_name
from gpusched.infra.settings import Settings


def add_parsers(sub: Any) -> None:
    auth = sub.add_parser("auth", help="NATS keys and credentials of this installation")
    verbs = auth.add_subparsers(dest="auth_command", required=True)

    init = verbs.add_parser("init", help="make (or refresh) a credentials bundle in DIR")
    init.add_argument("dir", type=Path)
    init.add_argument("--prefix", help="the subject prefix (default: GPUSCHED_SUBJECT_PREFIX)")
    init.add_argument("--force", action="store_true", help="new keys: every old credential dies")
    init.set_defaults(run=_init)

    issue = verbs.add_parser("issue", help="credentials for a team, an operator or a node")
    who = issue.add_mutually_exclusive_group(required=True)
    who.add_argument("--team")
    who.add_argument("--operator")
    who.add_argument("--node")
    issue.add_argument("--dir", type=Path, help="the bundle (default: the stack's)")
    issue.add_argument("--prefix", help="the subject prefix (nodes only)")
    issue.add_argument("--ttl", type=float, help="seconds until the credentials expire")
    issue.add_argument("--out", type=Path, help="write here (mode 0600) instead of stdout")
    issue.set_defaults(run=_issue)


def _bundle_dir(given: Path | None, settings: Settings) -> Path:
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
    try:
        return AuthBundle.load(root)
    except AuthError as exc:
        raise NotConfigured(str(exc)) from None


def _init(args: argparse.Namespace) -> int:
    settings = Settings()
    root: Path = args.dir
    fresh = args.force or not (root / "keys" / "operator.nk").is_file()
    bundle = AuthBundle.create(root) if fresh else _load(root)
    bundle.write_server_config()
    written = natsauth.write_installation(bundle, Subjects(args.prefix or settings.subject_prefix))
    print(f"{'new keys' if fresh else 'keys kept'} in {bundle.keys_dir} (keep them secret)")
    print(f"nats-server fragment: {bundle.server_config} (include it from the server config)")
    for identity, path in sorted(written.items()):
        print(f"  {identity:<11} {path}")
    print(f"clients account: {bundle.clients_account_id} (GPUSCHED_SECURITY__CLIENTS_ACCOUNT)")
    print(f"job issuer key:  {bundle.job_issuer_path} (GPUSCHED_SECURITY__JOB_SIGNING_KEY)")
    return 0


def _issue(args: argparse.Namespace) -> int:
    settings = Settings()
    bundle = _load(_bundle_dir(args.dir, settings))
    try:
        if args.node:
            prefix = args.prefix or stack_settings(settings).subject_prefix
            identity = Identity(node_user_name(prefix, args.node), ttl_s=args.ttl)
            Subjects(prefix).telemetry_gpu(args.node)  # a node name that is a subject token
            creds = bundle.node_credentials_issuer().creds(identity)
        elif args.team:
            creds = natsauth.issue_client(bundle, "team", args.team, ttl_s=args.ttl)
        else:
            creds = natsauth.issue_client(bundle, "operator", args.operator, ttl_s=args.ttl)
    except (AuthError, ValueError) as exc:
        raise NotConfigured(str(exc)) from None
    if args.out is None:
        sys.stdout.write(creds)
    else:
        natsauth.write_secret(args.out, creds)
        print(f"wrote {args.out}")
    return 0
