"""One command's conversation with the stack: settings, a connected client, one line
for every way it can go wrong.

Imports of NATS, pydantic and the settings happen inside the functions: the commands
import this module at start, and `--help` must not pay for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
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


def unparsable_setting(field: str, environ: Mapping[str, str]) -> str:
    """The one line for a variable pydantic-settings could not parse: a list or mapping
    setting takes JSON, and `field` (its message names no more) is the section whose
    list and mapping variables are looked at."""
    from gpusched.infra.settings import Settings

    section = f"GPUSCHED_{field.upper()}"
    info = Settings.model_fields.get(field)
    model = info.annotation if info is not None else None
    fields = getattr(model, "model_fields", {})
    named = sorted(
        name
        for name, value in environ.items()
        if (
            (name.upper() == section and _takes_json(info))
            or (
                name.upper().startswith(section + "__")
                and _takes_json(fields.get(name[len(section) + 2 :].lower()))
            )
        )
        and not _is_json(value)
    )
    which = " or ".join(named) if named else f"a {section} variable"
    return (
        f"{which}: not JSON, which a list or mapping setting takes (a list as "
        """'["file", "s3"]', a mapping as '{"name": ["a", "b"]}'); set it right (or unset it """
        "for the default) and start again"
    )


def _takes_json(info: Any) -> bool:
    import typing

    annotation = getattr(info, "annotation", None)
    return typing.get_origin(annotation) in (list, dict) or annotation in (list, dict)


def _is_json(text: str) -> bool:
    import json

    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def load_settings(*, service: bool = False) -> Settings:
    """The settings from the environment. A bad variable is one line: for a command,
    `invalid <setting>: <what>` (main() turns the ValidationError into it); for a
    service process, naming the variable and what to do."""
    import os
    import re

    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from gpusched.infra.settings import Settings

    try:
        return Settings()
    except SettingsError as exc:
        # Raised before validation, for a list or mapping variable that is not JSON.
        field = re.search(r'field "(\w+)"', str(exc))
        raise NotConfigured(
            unparsable_setting(field.group(1) if field else "", os.environ)
        ) from None
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
