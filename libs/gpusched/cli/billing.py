"""`gpusched bill [--team T]`: billing statements, per team.

A team reads its own statement only (its credentials say which). Naming a team with
nothing on record is an error (exit 1), not an empty success: a typo in a team name
must not read as "this team cost nothing".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpusched.cli import output
from gpusched.cli.errors import Refused
from gpusched.cli.output import Format
from gpusched.cli.session import with_api

if TYPE_CHECKING:
    from gpusched.cli.client import ApiClient


def register(app: typer.Typer) -> None:
    app.command("bill", help="Billing statements per team (usage, credits, totals).")(bill)


def bill(
    team: Annotated[str | None, typer.Option(help="this team only (a team sees its own)")] = None,
    fmt: Annotated[Format, typer.Option("-o", "--output")] = Format.TABLE,
) -> int:
    async def go(api: ApiClient) -> int:
        reply: dict[str, Any] = await api.call("api.billing.statement", {"team": team})
        if not reply.get("ok"):
            error = reply.get("error") or {}
            raise Refused(f"{error.get('code', 'refused')}: {error.get('message', '')}")
        if team is not None and not reply.get("statements"):
            raise Refused(
                f"no usage or credits on record for team {team!r}: check the name "
                "(`gpusched list --team NAME` shows a team's jobs), or it has not run anything yet"
            )
        output.emit(reply, fmt, lambda out: out.print(reply.get("text", ""), markup=False))
        return 0

    return with_api(go)
