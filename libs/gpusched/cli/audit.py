"""`gpusched audit`: the decisions on the audit stream, filtered, once or as they come.

The stream keeps a year; reading starts at `--since` (default: the last hour) on the
server, so a follow never replays the year. `--action` (a prefix: `preempt` is every
`preempt.*`), `--job` and `--team` filter what is read. A follow ends on Ctrl-C, and in
one line (exit 3) when the stack goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import sys
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Annotated, Any

import typer

from gpusched.cli import output
from gpusched.cli.errors import EXIT_UNREACHABLE, BadInput, CliError
from gpusched.cli.output import Format

if TYPE_CHECKING:
    from nats.aio.msg import Msg

# How long a read without --follow waits for the next record before it says it is done.
QUIET_S = 1.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
# A start this far ahead of this machine's clock is still taken as now (clock skew).
_SKEW = timedelta(minutes=5)


class StackGone(CliError):
    exit_code = EXIT_UNREACHABLE


def register(app: typer.Typer) -> None:
    app.command(
        "audit",
        help="The audit stream: every decision with its reason.",
        epilog="Example: gpusched audit --since 2h --action preempt --follow",
    )(audit)


def since_time(text: str, now: datetime) -> datetime | None:
    """`30m`, `2h`, `7d` ago, an ISO time (`2026-05-01T12:00Z`), or `all` (None).

    A start before 1970 (no record is older) is `all`; a start in the future is refused:
    no record has been written then yet, and `--follow` is how to wait for new ones."""
    if text == "all":
        return None
    match = _DURATION.fullmatch(text.strip())
    if match:
        seconds = float(match.group(1)) * _UNITS[match.group(2)]
        if seconds >= (now - _EPOCH).total_seconds():
            return None
        return now - timedelta(seconds=seconds)
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
        if when.year < _EPOCH.year:
            return None
        when = when if when.tzinfo is not None else when.astimezone()
    except (ValueError, OverflowError):
        raise BadInput(
            f"invalid --since {text!r}: use a duration (30m, 2h, 7d), an ISO time "
            "(2026-05-01T12:00:00Z) or all"
        ) from None
    if when > now + _SKEW:
        raise BadInput(
            f"--since {text!r} is in the future: give a past time "
            "(--follow prints new records as they come)"
        )
    return when


def matches(record: dict[str, Any], action: str | None, job: str | None, team: str | None) -> bool:
    """Whether an audit record passes the filters. `action` is a prefix of dotted words;
    a job matches its entity or a `job_id` in the details; a team its entity, a `team`
    in the details, or a caller `team:<name>`."""
    name = str(record.get("action", ""))
    if action and not (name == action or name.startswith(action + ".")):
        return False
    details = record.get("details") or {}
    if not isinstance(details, dict):
        details = {}
    if job and job not in (record.get("entity"), details.get("job_id")):
        return False
    return not team or team in (
        record.get("entity"),
        details.get("team"),
        str(details.get("caller", "")).removeprefix("team:") or None,
    )


def audit(
    since: Annotated[
        str, typer.Option(help="from when: 30m, 2h, 7d ago, an ISO time, or all")
    ] = "1h",
    action: Annotated[
        str | None, typer.Option(help="only this action or its sub-actions (preempt, job.parked)")
    ] = None,
    job: Annotated[str | None, typer.Option(help="only records about this job")] = None,
    team: Annotated[str | None, typer.Option(help="only records about this team")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="keep printing new records (Ctrl-C stops)")
    ] = False,
    fmt: Annotated[
        Format,
        typer.Option(
            "-o", "--output", help="table, json (a record a line) or yaml (a document a record)"
        ),
    ] = Format.TABLE,
) -> int:
    start = since_time(since, datetime.now(UTC))
    try:
        return asyncio.run(_read(start, action, job, team, follow, fmt))
    except KeyboardInterrupt:
        # Ctrl-C is how a follow ends.
        return 0


async def _read(
    start: datetime | None,
    action: str | None,
    job: str | None,
    team: str | None,
    follow: bool,
    fmt: Format,
) -> int:
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    from gpusched.cli.client import connect_nats, require_nats_url, stack_identity, stack_settings
    from gpusched.cli.session import load_settings
    from gpusched.contracts.subjects import Subjects
    from gpusched.infra import natsauth
    from gpusched.infra.tls import nats_context

    settings = stack_settings(load_settings())
    subjects = Subjects(settings.subject_prefix)
    url = require_nats_url(settings)
    gone = asyncio.Event()
    # The audit reader: the one identity that may read the audit stream.
    nc = await connect_nats(
        url,
        "gpusched-audit",
        credentials=stack_identity(settings, natsauth.AUDITOR),
        tls=nats_context(settings),
        on_closed=gone.set,
    )
    config = (
        ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
        if start is None
        else ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_TIME, opt_start_time=start)
    )
    try:
        sub = await asyncio.wait_for(
            nc.jetstream().subscribe(
                subjects.audit(">"), stream=subjects.audit_stream, config=config, manual_ack=False
            ),
            10,
        )
        while True:
            try:
                msg = await sub.next_msg(timeout=QUIET_S)
            except nats.errors.TimeoutError:
                if gone.is_set() or nc.is_closed:
                    raise StackGone(
                        f"lost the connection to NATS at {url}: the stack stopped "
                        "(start it again with `gpusched up`)"
                    ) from None
                if not follow:
                    return 0
                continue
            except nats.errors.ConnectionClosedError:
                raise StackGone(
                    f"lost the connection to NATS at {url}: the stack stopped "
                    "(start it again with `gpusched up`)"
                ) from None
            _print(msg, action, job, team, fmt)
    finally:
        if not nc.is_closed:
            with contextlib.suppress(TimeoutError, nats.errors.Error):
                await asyncio.wait_for(nc.close(), 2)


def _print(msg: Msg, action: str | None, job: str | None, team: str | None, fmt: Format) -> None:
    try:
        envelope = json.loads(msg.data)
        record = envelope["data"]
        when = datetime.fromisoformat(str(envelope["time"]))
    except (ValueError, KeyError, TypeError):
        # Only services write the stream; a record this reader cannot read is skipped.
        return
    if not isinstance(record, dict) or not matches(record, action, job, team):
        return
    if fmt is Format.TABLE:
        line = (
            f"{output.clock(when)} {record.get('actor', '-'):<10} "
            f"{record.get('action', '-'):<24} {record.get('entity', '-')}: "
            f"{record.get('reason', '')}"
        )
    elif fmt is Format.YAML:
        import yaml

        # A YAML stream: one document per record, so a follow stays readable as it grows.
        document = {**output.plain(record), "time": when.isoformat(), "id": envelope.get("id")}
        line = "---\n" + yaml.safe_dump(document, sort_keys=False, allow_unicode=True).rstrip()
    else:
        # One record a line: a follow can be piped into jq line by line.
        line = json.dumps({**record, "time": when.isoformat(), "id": envelope.get("id")})
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
