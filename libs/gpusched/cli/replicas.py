"""`gpusched scale JOB N`: move an inference service's replica target inside [min, max]."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from gpusched.cli import output
from gpusched.cli.errors import BadInput
from gpusched.cli.output import Format
from gpusched.cli.session import check, with_api

if TYPE_CHECKING:
    from rich.console import Console

    from gpusched.cli.client import ApiClient
    from gpusched.contracts.messages import Replicas


def register(app: typer.Typer) -> None:
    app.command("scale", help="Set an inference service's replica target.")(scale)


def parse_range(text: str) -> Replicas:
    """`--replicas 2` (exactly 2) or `--replicas 2:5` (min 2, max 5)."""
    from pydantic import ValidationError

    from gpusched.contracts.messages import Replicas
    from gpusched.contracts.validation import first_error

    low, _, high = text.partition(":")
    try:
        return Replicas(min=int(low), max=int(high or low))
    except ValidationError as exc:
        _, message = first_error(exc)
        raise BadInput(f"invalid replicas {text!r} (--replicas): {message}") from None
    except ValueError:
        raise BadInput(f"invalid replicas {text!r} (--replicas): use N or MIN:MAX") from None


def scale(
    job_id: Annotated[str, typer.Argument(help="the inference service's job id")],
    replicas: Annotated[int, typer.Argument(help="the new replica target", min=0, max=1024)],
    fmt: Annotated[Format, typer.Option("-o", "--output")] = Format.TABLE,
) -> int:
    from gpusched.contracts.messages import ScaleJob, ScaleReply

    body = ScaleJob(job_id=job_id, replicas=replicas)

    async def go(api: ApiClient) -> int:
        reply = await api.ask(api.subjects.api_jobs_scale, body, ScaleReply)
        check(reply)

        def render(out: Console) -> None:
            r = reply.replicas
            assert r is not None
            out.print(
                f"{job_id}: target {r.target} replicas in [{r.min}, {r.max}], {r.placed} placed"
            )

        output.emit(reply, fmt, render)
        return 0

    return with_api(go)
