"""`gpusched submit | get | why | list | approve`: the jobs API.

`get` and `why` put together what three services own: the job (admission), its
evictions and checkpoints (the checkpoint service) and what it cost and was credited
(billing), each asked on its own endpoint, which decides on its own who may read it.
A service that does not answer leaves its part out, with a note; the job still shows.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpusched.cli import output
from gpusched.cli.choices import Kind, Priority, State
from gpusched.cli.errors import BadInput, CliError
from gpusched.cli.output import Format
from gpusched.cli.session import check, with_api

if TYPE_CHECKING:
    from rich.console import Console

    from gpusched.cli.client import ApiClient
    from gpusched.contracts.messages import JobView, ListReply, Replicas

Output = Annotated[
    Format, typer.Option("-o", "--output", help="table for people, json or yaml for scripts")
]
JobId = Annotated[str, typer.Argument(help="the job id (`gpusched list` shows them)")]

# Where each request option goes in the submit request, so a refusal names the option
# the user typed, and a new request field is one option and one line here.
REQUEST_FIELDS: dict[str, str] = {
    "name": "name",
    "team": "team",
    "kind": "kind",
    "priority": "priority_class",
    "gpus": "gpus.count",
    "model": "gpus.model",
    "models": "gpus.models",
    "milli": "gpus.milli",
    "memory_gib": "gpus.memory_gib",
    "min_gpus": "gpus.min_count",
    "cpu_milli": "host.cpu_milli",
    "host_memory_mib": "host.memory_mib",
    "replicas": "replicas",
    "idempotency_key": "idempotency_key",
    "command": "workload.argv",
}


def register(app: typer.Typer) -> None:
    app.command(
        "submit",
        help="Submit a training job or an inference service.",
        epilog="Example: gpusched submit --name llm --team nlp --gpus 8 -- torchrun train.py",
    )(submit)
    app.command("get", help="A job: state, GPUs, checkpoints, evictions and bill.")(get)
    app.command("why", help="Why a job waits (or is where it is), in words.")(why)
    app.command("list", help="Jobs, newest first: filter by team, state, class, kind.")(list_jobs)
    app.command("approve", help="Let a held job in, or retry a parked one (operators).")(approve)


# --- submit ------------------------------------------------------------------------------


def _replicas(text: str | None) -> Replicas | None:
    if text is None:
        return None
    from gpusched.cli.replicas import parse_range

    return parse_range(text)


def submit(
    name: Annotated[str | None, typer.Option(help="the job's name")] = None,
    team: Annotated[str | None, typer.Option(help="your team (as your credentials say)")] = None,
    gpus: Annotated[int | None, typer.Option(help="GPUs (per replica for a service)")] = None,
    model: Annotated[str | None, typer.Option(help="GPU model, e.g. A100-80GB")] = None,
    models: Annotated[
        str | None,
        typer.Option(help="several acceptable GPU models, any one of them: V100M16|V100M32"),
    ] = None,
    milli: Annotated[
        int | None, typer.Option(help="a fraction of one GPU in 1/1000 (1..999)")
    ] = None,
    memory_gib: Annotated[
        float | None, typer.Option(help="GPU memory (a fraction's cap; picks a MIG slice)")
    ] = None,
    min_gpus: Annotated[
        int | None, typer.Option(help="the fewest GPUs accepted after a long wait")
    ] = None,
    cpu_milli: Annotated[
        int | None,
        typer.Option(
            help="host CPU in 1/1000 of a core (per replica); with --gpus 0 a CPU-only job"
        ),
    ] = None,
    host_memory_mib: Annotated[
        int | None, typer.Option(help="host memory in MiB (per replica)")
    ] = None,
    priority: Annotated[Priority | None, typer.Option(help="priority class")] = None,
    kind: Annotated[Kind | None, typer.Option(help="training (default) or inference")] = None,
    replicas: Annotated[
        str | None, typer.Option(help="inference: N or MIN:MAX replicas", metavar="N|MIN:MAX")
    ] = None,
    idempotency_key: Annotated[
        str | None, typer.Option(help="resubmitting the same key returns the same job")
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option("--file", "-f", help="a job file (YAML or JSON, the submit request's fields)"),
    ] = None,
    command: Annotated[
        list[str] | None,
        typer.Argument(help="the command the job runs, after `--`", show_default=False),
    ] = None,
    fmt: Output = Format.TABLE,
) -> int:
    """Command-line values override the job file's."""
    given = {
        "name": name,
        "team": team,
        "kind": kind,
        "priority": priority,
        "gpus": gpus,
        "model": model,
        "models": None if models is None else [m.strip() for m in models.split("|")],
        "milli": milli,
        "memory_gib": memory_gib,
        "min_gpus": min_gpus,
        "cpu_milli": cpu_milli,
        "host_memory_mib": host_memory_mib,
        "replicas": _replicas(replicas),
        "idempotency_key": idempotency_key,
        "command": command or None,
    }
    document = _job_file(file) if file is not None else {}
    for option, value in given.items():
        if value is not None:
            _put(document, REQUEST_FIELDS[option], value)
    if command:
        # A command is a real process: the agent runs it (the `process` workload).
        document.setdefault("workload", {})["kind"] = "process"
    job = _submit_request(document)

    async def go(api: ApiClient) -> int:
        reply = await api.submit(job)
        check(reply)

        def render(out: Console) -> None:
            out.print(f"{reply.job_id} submitted ({job.name}, team {job.team})")

        output.emit(reply, fmt, render)
        return 0

    return with_api(go)


def _job_file(path: Path) -> dict[str, Any]:
    import yaml

    from gpusched.infra.textfiles import FileRefused, read_small_text

    try:
        loaded = yaml.safe_load(read_small_text(path))
    except OSError as exc:
        raise BadInput(f"cannot read the job file {path}: {exc.strerror or exc}") from None
    except FileRefused as exc:
        raise BadInput(f"the job file: {exc}") from None
    except UnicodeDecodeError:
        raise BadInput(f"the job file {path} is not UTF-8 text") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise BadInput(f"the job file {path} is not YAML or JSON{where}") from None
    if not isinstance(loaded, dict):
        raise BadInput(f"the job file {path} must hold one job: a mapping of its fields")
    return loaded


def _put(document: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    node = document
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[last] = value.model_dump() if hasattr(value, "model_dump") else value


def _submit_request(document: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from gpusched.contracts.messages import SubmitJob
    from gpusched.contracts.validation import first_error

    try:
        return SubmitJob.model_validate(document)
    except ValidationError as exc:
        field, message = first_error(exc)
        # The option of the field, or of its parent; a rule over a whole group (`host`)
        # names the group's options when they are few.
        options = [
            o
            for o, f in REQUEST_FIELDS.items()
            if o != "command" and (field == f or field.startswith(f + "."))
        ] or [o for o, f in REQUEST_FIELDS.items() if f.startswith(field + ".")]
        hint = ""
        if 0 < len(options) <= 2:
            hint = f" ({', '.join('--' + o.replace('_', '-') for o in options)})"
        raise BadInput(f"invalid {field}{hint}: {message}") from None


# --- get ---------------------------------------------------------------------------------


def get(job_id: JobId, fmt: Output = Format.TABLE) -> int:
    async def go(api: ApiClient) -> int:
        reply = await api.get(job_id)
        check(reply)
        assert reply.job is not None
        history, bill = await asyncio.gather(_history(api, job_id), _bill(api, job_id))
        document = {"job": reply.job, "history": history, "bill": bill}
        job = reply.job
        output.emit(document, fmt, lambda out: _render_job(out, job, history, bill))
        return 0

    return with_api(go)


async def _optional(api: ApiClient, suffix: str, body: dict[str, Any], what: str) -> Any:
    """Another service's part of the picture, or a note saying why it is missing."""
    try:
        reply = await api.call(suffix, body)
    except CliError as exc:
        return {"ok": False, "error": {"code": "unavailable", "message": f"{what}: {exc}"}}
    return reply


async def _history(api: ApiClient, job_id: str) -> Any:
    return await _optional(
        api, "api.checkpoints.history", {"job_id": job_id}, "the checkpoint service"
    )


async def _bill(api: ApiClient, job_id: str) -> Any:
    return await _optional(api, "api.billing.job", {"job_id": job_id}, "billing")


def _render_job(out: Console, job: JobView, history: Any, bill: Any) -> None:
    out.print(f"[bold]{job.job_id}[/bold]  {job.name}")
    rows: list[tuple[str, str]] = [
        ("team", job.team),
        ("class", f"{job.priority_class} ({job.kind})"),
        ("state", f"{job.state}, attempt {job.attempt}"),
        ("submitted", f"{output.clock(job.submitted_at)} ({output.ago(job.submitted_at)})"),
        ("asks", _asked(job)),
    ]
    if job.allocated:
        placed = output.gpus_by_node([(g.node, g.index) for g in job.allocated])
        models = sorted({g.model for g in job.allocated})
        rows.append(("gpus", f"{len(job.allocated)} x {'/'.join(models)} on " + "; ".join(placed)))
    if job.share is not None:
        share = job.share
        kind = f"MIG {share.mig_profile}" if share.mig_profile else f"{share.milli}/1000 of a GPU"
        rows.append(("share", f"{kind}, {share.memory_mib} MiB"))
    if job.allocation_id:
        rows.append(("allocation", job.allocation_id))
    if job.replicas is not None:
        r = job.replicas
        rows.append(("replicas", f"{r.placed} placed, target {r.target} in [{r.min}, {r.max}]"))
    if job.latest_checkpoint is not None:
        rows.append(("checkpoint", _checkpoint(job.latest_checkpoint)))
    if job.resume_from is not None:
        rows.append(("resumes from", _checkpoint(job.resume_from)))
    if job.reservation is not None:
        rows.append(("reserved", f"{', '.join(job.reservation.nodes)}: {job.reservation.reason}"))
    if job.parked_reason:
        rows.append(("parked", job.parked_reason))
    for warning in job.warnings:
        rows.append(("warning", warning))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        out.print(f"  {key:<{width}}  {value}", markup=False)
    _render_history(out, history)
    _render_bill(out, bill)


def _asked(job: JobView) -> str:
    g = job.gpus
    plural = "s" if g.count != 1 else ""
    text = f"{g.milli}/1000 of a GPU" if g.milli else f"{g.count} GPU{plural}"
    if g.model:
        text += f" of {g.model}"
    if g.memory_gib:
        text += f", {g.memory_gib:g} GiB"
    if g.min_count:
        text += f" (at least {g.min_count} after a long wait)"
    return text


def _checkpoint(c: Any) -> str:
    return f"{c.checkpoint_id} at step {c.step} ({c.stage}, {output.size(c.bytes)})"


def _missing(out: Console, what: str, reply: Any) -> bool:
    if reply.get("ok"):
        return False
    error = reply.get("error") or {}
    out.print(f"\n{what}: not shown ({error.get('message', 'refused')})", markup=False)
    return True


def _render_history(out: Console, history: Any) -> None:
    if _missing(out, "evictions and checkpoints", history):
        return
    sagas = history.get("sagas") or []
    out.print(f"\n[bold]evictions[/bold] ({len(sagas) or 'none'})")
    if sagas:
        grid = output.table(
            "SAGA", "STATE", "OUTCOME", "WAITED FOR", "CHECKPOINT", "LOST GPU-S", "STARTED"
        )
        for s in sagas:
            checkpoint = s.get("checkpoint") or {}
            grid.add_row(
                s["saga_id"],
                s["state"],
                s.get("outcome") or "-",
                f"{s['stage_required']} ({s['policy']})",
                checkpoint.get("checkpoint_id", "-"),
                f"{s.get('lost_gpu_seconds', 0):.0f}",
                output.clock(_when(s.get("created_at"))),
            )
        out.print(grid)
    checkpoints = history.get("checkpoints") or []
    out.print(f"\n[bold]checkpoints[/bold] ({len(checkpoints) or 'none verified'})")
    if checkpoints:
        grid = output.table("CHECKPOINT", "STEP", "STAGE", "SIZE", "FOR", "CONFIRMED", "URI")
        for c in checkpoints:
            info = c["checkpoint"]
            grid.add_row(
                info["checkpoint_id"],
                str(info["step"]),
                info["stage"],
                output.size(info["bytes"]),
                "eviction" if c.get("request_id") else "periodic",
                output.clock(_when(c.get("confirmed_at"))),
                info["uri"],
            )
        out.print(grid)


def _render_bill(out: Console, bill: Any) -> None:
    if _missing(out, "bill", bill):
        return
    statement = bill.get("statement")
    if statement is None:
        out.print("\n[bold]bill[/bold]: nothing metered yet")
        return
    currency = statement["currency"]
    credits = statement.get("credits") or []
    lost = sum(float(c["lost_gpu_seconds"]) for c in credits)
    out.print(
        f"\n[bold]bill[/bold]: {statement['subtotal']} {currency} used, "
        f"{statement['credits_total']} {currency} credited, total {statement['total']} {currency}"
    )
    if credits:
        out.print(
            f"  credits for {len(credits)} forced eviction(s): {lost:.0f} GPU-seconds of work lost",
            markup=False,
        )


def _when(text: Any) -> Any:
    from datetime import datetime

    return datetime.fromisoformat(text) if isinstance(text, str) else None


# --- why ---------------------------------------------------------------------------------


def why(job_id: JobId, fmt: Output = Format.TABLE) -> int:
    from gpusched.contracts.messages import WhyJob, WhyReply

    async def go(api: ApiClient) -> int:
        reply = await api.ask(api.subjects.api_jobs_why, WhyJob(job_id=job_id), WhyReply)
        check(reply)
        history = await _history(api, job_id)

        def render(out: Console) -> None:
            out.print(f"{reply.job_id} is {reply.state}:", markup=False)
            for reason in reply.reasons:
                out.print(f"  - {reason}", markup=False)
            if history.get("ok") and history.get("sagas"):
                out.print("evictions, newest first:")
                for s in history["sagas"][:5]:
                    lost = s.get("lost_gpu_seconds") or 0
                    out.print(
                        f"  - {output.clock(_when(s.get('created_at')))} {s['state']}"
                        + (f" ({s['outcome']})" if s.get("outcome") else "")
                        + f": {s['reason']}"
                        + (f"; {lost:.0f} GPU-seconds lost" if lost else ""),
                        markup=False,
                    )

        output.emit({"why": reply, "history": history}, fmt, render)
        return 0

    return with_api(go)


# --- list --------------------------------------------------------------------------------


def list_jobs(
    team: Annotated[str | None, typer.Option(help="only this team's jobs")] = None,
    state: Annotated[
        list[State] | None, typer.Option(help="only jobs in this state (repeat for several)")
    ] = None,
    priority: Annotated[
        Priority | None, typer.Option("--class", "--priority", help="only this priority class")
    ] = None,
    kind: Annotated[Kind | None, typer.Option(help="training or inference")] = None,
    limit: Annotated[int, typer.Option(min=1, max=500, help="jobs per page")] = 50,
    after: Annotated[
        str | None, typer.Option(help="start after this job id (the previous page's last)")
    ] = None,
    all_pages: Annotated[bool, typer.Option("--all", help="every page, not just one")] = False,
    fmt: Output = Format.TABLE,
) -> int:
    from gpusched.contracts.messages import ListJobs, ListReply

    request = ListJobs.model_validate(
        {
            "team": team,
            "states": [s.value for s in state or ()],
            "priority_class": priority,
            "kind": kind,
            "limit": limit,
            "after": after,
        }
    )

    async def go(api: ApiClient) -> int:
        pages: list[ListReply] = []
        ask = request
        while True:
            reply = await api.ask(api.subjects.api_jobs_list, ask, ListReply)
            check(reply)
            pages.append(reply)
            if not all_pages or reply.next is None:
                break
            ask = ask.model_copy(update={"after": reply.next})
        jobs = [job for page in pages for job in page.jobs]
        more = pages[-1].next
        output.emit({"jobs": jobs, "next": more}, fmt, lambda out: _render_list(out, jobs))
        if more is not None and fmt is Format.TABLE:
            print(f"more jobs: add --after {more} (or --all)", file=sys.stderr)
        return 0

    return with_api(go)


def _render_list(out: Console, jobs: list[Any]) -> None:
    if not jobs:
        out.print("no jobs match")
        return
    grid = output.table("JOB", "NAME", "TEAM", "CLASS", "STATE", "GPUS", "ATTEMPT", "SUBMITTED")
    for j in jobs:
        gpus = f"{j.milli}m" if j.milli else str(j.gpus)
        if j.model:
            gpus += f" {j.model}"
        grid.add_row(
            j.job_id,
            j.name,
            j.team,
            j.priority_class,
            j.state,
            gpus,
            str(j.attempt),
            output.ago(j.submitted_at),
        )
    out.print(grid)


# --- approve -----------------------------------------------------------------------------


def approve(
    job_id: JobId,
    operator: Annotated[
        str, typer.Option(help="who approves (an operator credential's name wins)")
    ] = os.environ.get("USER") or "operator",
    reason: Annotated[str, typer.Option(help="why, for the audit record")] = "",
    fmt: Output = Format.TABLE,
) -> int:
    from gpusched.contracts.messages import ApproveJob, ApproveReply

    body = ApproveJob(job_id=job_id, operator=operator, reason=reason)

    async def go(api: ApiClient) -> int:
        reply = await api.ask(api.subjects.api_jobs_approve, body, ApproveReply)
        check(reply)
        output.emit(reply, fmt, lambda out: out.print(f"{job_id} approved"))
        return 0

    return with_api(go)
