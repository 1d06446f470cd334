"""Who is asking: the caller of an API request, as nats-server vouches for it.

Teams and operators connect to the CLIENTS account, which reaches the API only through
a service import with `share`; for every such request the server writes the
`Nats-Request-Info` header (the caller's account and user JWT name), replacing any
header of that name the client sent. A user's name is `team:<team>`,
`operator:<name>` or `agent:<name>` (`gpusched auth issue`); a cluster agent's
credential also names, as `team:<team>` tags, the teams it may submit for. A request
without the header comes from inside the service account, i.e. from a service (jobs
and nodes may not publish there).

The endpoint runtime (bus.serve_requests) puts the caller in `current_caller` for the
handler; `team` never comes from a payload when a team asks.
"""

from __future__ import annotations

import contextvars
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "AGENT_TAG",
    "REQUEST_INFO_HEADER",
    "Caller",
    "CallerKind",
    "caller_from_headers",
    "current_caller",
]

REQUEST_INFO_HEADER = "Nats-Request-Info"
TEAM_TAG = "team:"
OPERATOR_TAG = "operator:"
AGENT_TAG = "agent:"


class CallerKind(enum.StrEnum):
    SERVICE = "service"
    OPERATOR = "operator"
    TEAM = "team"
    # A cluster agent (the Kubernetes agent): submits on behalf of the teams its
    # credential names and keeps the node inventory; nothing else.
    AGENT = "agent"
    UNKNOWN = "unknown"  # an authenticated user of no role: may do nothing


@dataclass(frozen=True)
class Caller:
    kind: CallerKind
    name: str  # the team, the operator's or agent's name, or "internal"
    # The teams an agent may submit for (its credential's `team:` tags).
    teams: frozenset[str] = frozenset()

    @property
    def is_operator(self) -> bool:
        """Operators and the services themselves may do what the operator API allows."""
        return self.kind in (CallerKind.OPERATOR, CallerKind.SERVICE)

    @property
    def team(self) -> str | None:
        return self.name if self.kind is CallerKind.TEAM else None

    def may_act_for(self, team: str) -> bool:
        """Whether this caller may read or change what belongs to `team`."""
        return self.is_operator or self.team == team

    def may_submit_for(self, team: str) -> bool:
        """Whether this caller may submit a job of `team`: as may_act_for, and a cluster
        agent for the teams its credential names (it may read or change nothing)."""
        return self.may_act_for(team) or (self.kind is CallerKind.AGENT and team in self.teams)

    def __str__(self) -> str:
        return "internal" if self.kind is CallerKind.SERVICE else f"{self.kind}:{self.name}"


INTERNAL = Caller(CallerKind.SERVICE, "internal")

current_caller: contextvars.ContextVar[Caller] = contextvars.ContextVar(
    "current_caller", default=INTERNAL
)


def caller_from_headers(headers: Mapping[str, str] | None, clients_account: str | None) -> Caller:
    """The caller of a request with these headers. `clients_account`: the public key of
    the CLIENTS account; a header naming any other account is nobody we know."""
    raw = (headers or {}).get(REQUEST_INFO_HEADER)
    if raw is None:
        return INTERNAL
    try:
        info = json.loads(raw)
        account = info.get("acc")
        name = info.get("name_tag") or ""
        tags = info.get("tags") or []
    except (ValueError, AttributeError, RecursionError, MemoryError):
        return Caller(CallerKind.UNKNOWN, "unreadable")
    if not isinstance(name, str) or (clients_account is not None and account != clients_account):
        return Caller(CallerKind.UNKNOWN, str(account)[:64])
    for tag, kind in ((TEAM_TAG, CallerKind.TEAM), (OPERATOR_TAG, CallerKind.OPERATOR)):
        if name.startswith(tag) and len(name) > len(tag):
            return Caller(kind, name[len(tag) :])
    if name.startswith(AGENT_TAG) and len(name) > len(AGENT_TAG):
        teams = frozenset(
            t[len(TEAM_TAG) :]
            for t in (tags if isinstance(tags, list) else [])
            if isinstance(t, str) and t.startswith(TEAM_TAG) and len(t) > len(TEAM_TAG)
        )
        return Caller(CallerKind.AGENT, name[len(AGENT_TAG) :], teams)
    return Caller(CallerKind.UNKNOWN, name[:64])
