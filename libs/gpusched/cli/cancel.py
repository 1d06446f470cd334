"""`gpusched cancel JOB_ID [--reason R]`: end a job, whatever state it is in.

A queued, held or parked job is cancelled at once; a running one is `cancelling` until
the cluster agent reports its workloads stopped. A finished job answers `conflict`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from gpusched.cli import output
from gpusched.cli.output import Format
from gpusched.cli.session import check, with_api

if TYPE_CHECKING:
    from gpusched.cli.client import ApiClient


def register(app: typer.Typer) -> None:
    app.command("cancel", help="End a job: queued, held, parked or running.")(cancel)


def cancel(
    job_id: Annotated[str, typer.Argument(help="the job id")],
    reason: Annotated[str, typer.Option(help="why, for the audit record")] = "",
    operator: Annotated[
        str, typer.Option(help="who cancels (an operator credential's name wins)")
    ] = os.environ.get("USER") or "operator",
    fmt: Annotated[Format, typer.Option("-o", "--output")] = Format.TABLE,
) -> int:
    from gpusched.contracts.messages import CancelJob, CancelReply

    body = CancelJob(job_id=job_id, operator=operator, reason=reason)

    async def go(api: ApiClient) -> int:
        reply = await api.ask(api.subjects.api_jobs_cancel, body, CancelReply)
        check(reply)
        output.emit(reply, fmt, lambda out: out.print(f"{reply.job_id} {reply.state}"))
        return 0

    return with_api(go)
