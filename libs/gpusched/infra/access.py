"""Refusing a caller: one `forbidden` reply and one audit record naming who asked.

Endpoints decide what a caller may do from contracts.identity.current_caller (which
the server vouches for); this is how every refusal looks, whichever service refuses.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from gpusched.contracts.identity import Caller, CallerKind, current_caller
from gpusched.contracts.messages import ApiError
from gpusched.infra import metrics
from gpusched.infra.db import UnitOfWorkFactory

log = logging.getLogger(__name__)
R = TypeVar("R")

__all__ = ["FORBIDDEN", "caller", "forbid", "operators_only"]

FORBIDDEN = "forbidden"


def caller() -> Caller:
    return current_caller.get()


async def forbid(uow: UnitOfWorkFactory, action: str, entity: str, why: str) -> ApiError:
    """Audit the refusal (`access.forbidden`, with the caller) and return its error."""
    who = caller()
    message = f"{who} may not {action}: {why}"
    async with uow() as unit:
        await unit.audit(
            "access.forbidden",
            entity=entity,
            reason=message,
            details={"caller": str(who), "caller_kind": who.kind.value, "action": action},
        )
        await unit.commit()
    metrics.ACCESS_REFUSED.labels(uow.source, action).inc()
    log.info("refused: %s", message)
    return ApiError(code=FORBIDDEN, message=message)


def operators_only(
    uow: UnitOfWorkFactory,
    action: str,
    endpoint: Callable[[bytes], Awaitable[R]],
    refused: Callable[[ApiError], R],
    *,
    agents: bool = False,
) -> Callable[[bytes], Awaitable[R]]:
    """`endpoint` for operators (and the services), and with `agents` for cluster agents
    too; anyone else gets `refused(error)`."""

    async def guarded(raw: bytes) -> R:
        who = caller()
        if not (who.is_operator or (agents and who.kind is CallerKind.AGENT)):
            return refused(await forbid(uow, action, action, "it is an operator command"))
        return await endpoint(raw)

    return guarded
