"""`gpusched node add|reload|drain|undrain|fail|recover|remove|list`: the inventory's lifecycle.

Each command is one request to admission (`<p>.api.nodes.<verb>`); `fail`/`recover`
with `--via-agent` instead tell the simulated cluster that the node broke (or was
fixed), and the agent reports the node's health as a real one would. A change prints
admission's reply (JSON by default, as scripts read it); `list` is a table.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpusched.cli import output
from gpusched.cli.errors import BadInput
from gpusched.cli.output import Format
from gpusched.cli.session import check, load_settings, with_api

if TYPE_CHECKING:
    from rich.console import Console

    from gpusched.cli.client import ApiClient
    from gpusched.contracts.messages import NodeReply, Wire

app = typer.Typer(help="Add, drain, fail, recover, remove or list GPU nodes.", no_args_is_help=True)

Operator = Annotated[str, typer.Option(help="who asks (an operator credential's name wins)")]
Reason = Annotated[str, typer.Option(help="why, for the audit record")]
NodeName = Annotated[str, typer.Argument(help="the node's name")]
Output = Annotated[Format, typer.Option("-o", "--output")]
_OPERATOR = os.environ.get("USER") or "operator"
# The options of `node add`, by the inventory entry's field they set.
SPEC_FIELDS = (
    "name",
    "pool",
    "gpu_model",
    "gpus",
    "cpu_milli",
    "memory_mib",
    "gpu_memory_mib",
    "disk_gib",
)


@app.command("add", help="Add a node (one inventory entry: a file, options, or both).")
def add(
    file: Annotated[
        Path | None, typer.Option(help="a YAML file holding one inventory entry")
    ] = None,
    name: Annotated[str | None, typer.Option()] = None,
    pool: Annotated[str | None, typer.Option(help="inference, shared or training")] = None,
    gpu_model: Annotated[str | None, typer.Option()] = None,
    gpus: Annotated[int | None, typer.Option()] = None,
    cpu_milli: Annotated[int | None, typer.Option()] = None,
    memory_mib: Annotated[int | None, typer.Option()] = None,
    gpu_memory_mib: Annotated[int | None, typer.Option()] = None,
    disk_gib: Annotated[int | None, typer.Option()] = None,
    operator: Operator = _OPERATOR,
    reason: Reason = "",
    fmt: Output = Format.JSON,
) -> int:
    from gpusched.contracts.messages import AddNode, NodeVerb

    spec: dict[str, Any] = {}
    if file is not None:
        import yaml

        from gpusched.infra.textfiles import FileRefused, read_small_text

        try:
            loaded = yaml.safe_load(read_small_text(file))
        except OSError as exc:
            raise BadInput(f"cannot read {file}: {exc.strerror or exc}") from None
        except FileRefused as exc:
            raise BadInput(str(exc)) from None
        except UnicodeDecodeError:
            raise BadInput(f"{file} is not UTF-8 text") from None
        except yaml.YAMLError as exc:
            raise BadInput(f"{file} is not YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise BadInput(f"{file} must hold one inventory entry (a mapping)")
        spec.update(loaded)
    given = dict(
        zip(
            SPEC_FIELDS,
            (name, pool, gpu_model, gpus, cpu_milli, memory_mib, gpu_memory_mib, disk_gib),
            strict=True,
        )
    )
    spec.update({k: v for k, v in given.items() if v is not None})
    return _ask(NodeVerb.ADD, AddNode(spec=spec, operator=operator, reason=reason), fmt)


@app.command("reload", help="Add the nodes the inventory file gained.")
def reload(operator: Operator = _OPERATOR, reason: Reason = "", fmt: Output = Format.JSON) -> int:
    from gpusched.contracts.messages import NodeVerb, ReloadInventory

    return _ask(NodeVerb.RELOAD, ReloadInventory(operator=operator, reason=reason), fmt)


def _lifecycle(verb: str, text: str, *, via_agent: bool = False) -> None:
    def command(
        node: NodeName,
        operator: Operator = _OPERATOR,
        reason: Reason = "",
        fmt: Output = Format.JSON,
    ) -> int:
        from gpusched.contracts.messages import NodeCommand, NodeVerb

        return _ask(NodeVerb(verb), NodeCommand(node=node, operator=operator, reason=reason), fmt)

    def command_or_agent(
        node: NodeName,
        operator: Operator = _OPERATOR,
        reason: Reason = "",
        agent: Annotated[
            bool,
            typer.Option(
                "--via-agent",
                help="tell the simulated cluster; its agent reports the node's health",
            ),
        ] = False,
        fmt: Output = Format.JSON,
    ) -> int:
        if agent:
            return _tell_agent(node, healthy=verb == "recover", reason=reason)
        return command(node, operator, reason, fmt)

    app.command(verb, help=text)(command_or_agent if via_agent else command)


_lifecycle("drain", "No new placements; what runs there runs to its end.")
_lifecycle("undrain", "Take placements again.")
_lifecycle("fail", "End everything on it (training requeued from its checkpoint).", via_agent=True)
_lifecycle("recover", "Bring a failed node back.", via_agent=True)
_lifecycle("remove", "Take an empty node out of the inventory.")


@app.command("list", help="Every node, its state and allocations.")
def list_nodes(fmt: Output = Format.TABLE) -> int:
    from gpusched.contracts.messages import ListNodes, NodeVerb

    return _ask(NodeVerb.LIST, ListNodes(), fmt)


def _ask(verb: Any, request: Wire, fmt: Format) -> int:
    from gpusched.contracts.messages import NodeReply

    async def go(api: ApiClient) -> int:
        reply = await api.ask(api.subjects.api_nodes(verb), request, NodeReply)
        check(reply)
        output.emit(reply, fmt, lambda out: _render(out, reply))
        return 0

    return with_api(go)


def _render(out: Console, reply: NodeReply) -> None:
    grid = output.table(
        "NODE", "POOL", "GPUS", "MODEL", "STATE", "CPUS", "MEM_GIB", "DISK_GIB", "ALLOCATIONS"
    )
    for n in reply.nodes:
        grid.add_row(
            n.name,
            n.pool,
            str(n.gpus),
            n.gpu_model,
            n.state,
            str(n.cpu_milli // 1000),
            str(n.memory_mib // 1024),
            str(n.disk_gib or "-"),
            ", ".join(n.allocations) or "-",
        )
    out.print(grid)
    for note in reply.notes:
        out.print(f"note: {note}", markup=False)


def _tell_agent(node: str, *, healthy: bool, reason: str) -> int:
    from gpusched.cli.client import connect_nats, require_nats_url, stack_identity, stack_settings
    from gpusched.contracts.envelope import make_envelope
    from gpusched.contracts.subjects import Subjects
    from gpusched.infra import natsauth
    from gpusched.simcluster.faults import SIM_NODE_HEALTH, SetNodeHealth

    resolved = stack_settings(load_settings())

    async def go() -> None:
        # The simulated cluster's driver, not the operator's API identity: only it may
        # send the simulator its commands.
        nc = await connect_nats(
            require_nats_url(resolved),
            "gpusched-simulator",
            credentials=stack_identity(resolved, natsauth.SIMULATOR),
        )
        try:
            command = SetNodeHealth(node=node, healthy=healthy, reason=reason)
            envelope = make_envelope(SIM_NODE_HEALTH, command, source="cli")
            subject = Subjects(resolved.subject_prefix).command("agent", SIM_NODE_HEALTH)
            await asyncio.wait_for(nc.jetstream().publish(subject, envelope.to_bytes()), 10)
        finally:
            await nc.close()

    asyncio.run(go())
    print(f"told the simulated cluster that {node} is {'healthy' if healthy else 'down'}")
    return 0
