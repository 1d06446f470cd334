"""One command's conversation with the stack: settings, a connected client, one line
for every way it can go wrong.

Imports of NATS, pydantic and the settings happen inside the functions: the commands
import this module at start, and `--help` must not pay for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from gpusched.cli.errors import NotConfigured, Refused

if TYPE_CHECKING:
    from pydantic import ValidationError

    from gpusched.cli.client import ApiClient
    from gpusched.infra.settings import Settings

T = TypeVar("T")


def settings_error(exc: ValidationError) -> str:
    """The environment variable a settings error is about, and what is wrong with it."""
    from gpusched.contracts.validation import first_error

    where, message = first_error(exc)
    variable = "GPUSCHED_" + where.upper().replace(".", "__")
    return f"{variable}: {message}; set it right (or unset it for the default) and start again"


def load_settings(*, service: bool = False) -> Settings:
    """The settings from the environment. A bad variable is one line: for a command,
    `invalid <setting>: <what>` (main() turns the ValidationError into it); for a
    service process, naming the variable and what to do."""
    from pydantic import ValidationError

    from gpusched.infra.settings import Settings

    try:
        return Settings()
    except ValidationError as exc:
        if not service:
            raise
        raise NotConfigured(settings_error(exc)) from None


def with_api(go: Callable[[ApiClient], Awaitable[T]], *, timeout_s: float = 10.0) -> T:
    """Connect to the stack the environment names, run `go`, close."""
    from gpusched.cli.client import ApiClient

    settings = load_settings()

    async def session() -> T:
        async with ApiClient.for_stack(settings, timeout_s=timeout_s) as api:
            return await go(api)

    return asyncio.run(session())


def check(reply: Any) -> None:
    """Raise Refused (one line, exit 1) for a reply with `ok: false`."""
    if getattr(reply, "ok", True):
        return
    error = getattr(reply, "error", None)
    if error is None:
        raise Refused("the request was refused")
    field = f" (field {error.field})" if getattr(error, "field", None) else ""
    raise Refused(f"{error.code}: {error.message}{field}")
