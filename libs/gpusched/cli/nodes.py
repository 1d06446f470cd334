"""`gpusched node add|reload|drain|undrain|fail|recover|remove|list`: the inventory's lifecycle.

Each command is one request to admission (`<p>.api.nodes.<verb>`); `fail`/`recover`
with `--via-agent` instead tell the simulated cluster that the node broke (or was
fixed), and the agent reports the node's health as a real one would.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import yaml

from gpusched.cli.client import (
    ApiClient,
    connect_nats,
    require_nats_url,
    stack_identity,
    stack_settings,
)
from gpusched.contracts.envelope import make_envelope
from gpusched.contracts.messages import (
    AddNode,
    ListNodes,
    NodeCommand,
    NodeReply,
    NodeVerb,
    ReloadInventory,
    Wire,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra import natsauth
from gpusched.infra.settings import Settings
from gpusched.simcluster.faults import SIM_NODE_HEALTH, SetNodeHealth

_OPERATOR = os.environ.get("USER") or "operator"


def add_parsers(sub: Any) -> None:
    """Register `gpusched node ...` on the top-level subparsers."""
    node = sub.add_parser("node", help="add, drain, fail, recover, remove or list GPU nodes")
    verbs = node.add_subparsers(dest="verb", required=True)

    add = verbs.add_parser("add", help="add a node (inventory YAML shape)")
    add.add_argument("--file", type=Path, help="a YAML file holding one inventory entry")
    add.add_argument("--name")
    add.add_argument("--pool", choices=["inference", "shared", "training"])
    add.add_argument("--gpu-model")
    add.add_argument("--gpus", type=int)
    add.add_argument("--cpu-milli", type=int)
    add.add_argument("--memory-mib", type=int)
    add.add_argument("--gpu-memory-mib", type=int)
    add.add_argument("--disk-gib", type=int)
    _who(add)
    add.set_defaults(run=_add)

    reload = verbs.add_parser("reload", help="add the nodes the inventory file gained")
    _who(reload)
    reload.set_defaults(run=_reload)

    for verb, text in (
        (NodeVerb.DRAIN, "no new placements; what runs there runs to its end"),
        (NodeVerb.UNDRAIN, "take placements again"),
        (NodeVerb.FAIL, "end everything on it (training requeued from its checkpoint)"),
        (NodeVerb.RECOVER, "bring a failed node back"),
        (NodeVerb.REMOVE, "take an empty node out of the inventory"),
    ):
        parser = verbs.add_parser(verb.value, help=text)
        parser.add_argument("node")
        _who(parser)
        if verb in (NodeVerb.FAIL, NodeVerb.RECOVER):
            parser.add_argument(
                "--via-agent",
                action="store_true",
                help="tell the simulated cluster instead; its agent reports the node's health",
            )
        parser.set_defaults(run=_command, node_verb=verb)

    listing = verbs.add_parser("list", help="every node, its state and allocations")
    listing.set_defaults(run=_list)


def _who(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--operator", default=_OPERATOR)
    parser.add_argument("--reason", default="")


def _add(args: argparse.Namespace) -> int:
    spec: dict[str, Any] = {}
    if args.file is not None:
        loaded = yaml.safe_load(args.file.read_text(encoding="utf-8"))
        if not isinstance(loaded, dict):
            print(f"error: {args.file} must hold one inventory entry (a mapping)", file=sys.stderr)
            return 2
        spec.update(loaded)
    for field in (
        "name",
        "pool",
        "gpu_model",
        "gpus",
        "cpu_milli",
        "memory_mib",
        "gpu_memory_mib",
        "disk_gib",
    ):
        value = getattr(args, field)
        if value is not None:
            spec[field] = value
    request = AddNode(spec=spec, operator=args.operator, reason=args.reason)
    return _ask(NodeVerb.ADD, request)


def _reload(args: argparse.Namespace) -> int:
    return _ask(NodeVerb.RELOAD, ReloadInventory(operator=args.operator, reason=args.reason))


def _command(args: argparse.Namespace) -> int:
    verb: NodeVerb = args.node_verb
    if getattr(args, "via_agent", False):
        return _tell_agent(args.node, healthy=verb is NodeVerb.RECOVER, reason=args.reason)
    return _ask(verb, NodeCommand(node=args.node, operator=args.operator, reason=args.reason))


def _list(_: argparse.Namespace) -> int:
    return _ask(NodeVerb.LIST, ListNodes(), table=True)


def _ask(verb: NodeVerb, request: Wire, *, table: bool = False) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            body = request.model_dump_json().encode()
            raw = await api.request(api.subjects.api_nodes(verb), body)
        reply = NodeReply.model_validate_json(raw)
        if table and reply.ok:
            print(
                f"{'NODE':<20} {'POOL':<10} {'GPUS':>4} {'MODEL':<12} {'STATE':<8} {'CPUS':>5} "
                f"{'MEM_GIB':>7} {'DISK_GIB':>8} ALLOCATIONS"
            )
            for n in reply.nodes:
                print(
                    f"{n.name:<20} {n.pool:<10} {n.gpus:>4} {n.gpu_model:<12} {n.state:<8} "
                    f"{n.cpu_milli // 1000:>5} {n.memory_mib // 1024:>7} {n.disk_gib or '-':>8} "
                    f"{', '.join(n.allocations) or '-'}"
                )
        else:
            print(reply.model_dump_json(indent=2, exclude_none=True))
        return 0 if reply.ok else 1

    return _run(go)


def _tell_agent(node: str, *, healthy: bool, reason: str) -> int:
    settings = Settings()

    async def go() -> int:
        # The simulated cluster's driver, not the operator's API identity: only it may
        # send the simulator its commands.
        resolved = stack_settings(settings)
        nc = await connect_nats(
            require_nats_url(resolved),
            "gpusched-simulator",
            credentials=stack_identity(resolved, natsauth.SIMULATOR),
        )
        try:
            command = SetNodeHealth(node=node, healthy=healthy, reason=reason)
            envelope = make_envelope(SIM_NODE_HEALTH, command, source="cli")
            subject = Subjects(resolved.subject_prefix).command("agent", SIM_NODE_HEALTH)
            await nc.jetstream().publish(subject, envelope.to_bytes())
        finally:
            await nc.close()
        print(f"told the simulated cluster that {node} is {'healthy' if healthy else 'down'}")
        return 0

    return _run(go)


def _run(go: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run one command's coroutine; its CliError reaches main() as one line."""
    return asyncio.run(go())
