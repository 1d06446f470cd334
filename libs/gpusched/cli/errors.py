"""The CLI's failures, each printed as one line with an exit code (no traceback).

Kept free of heavy imports: `gpusched --help` loads this module.
"""

from __future__ import annotations

# 2 for what the caller must fix (bad input, no stack known), 3 when the stack cannot be
# reached or does not answer.
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3


class CliError(RuntimeError):
    """A failure the CLI reports as one line and an exit code; no traceback."""

    exit_code = 1


class ApiError(CliError):
    pass


class NoAnswer(ApiError):
    """Nobody answered a request in time (the stack is down or overloaded)."""

    exit_code = EXIT_UNREACHABLE


class Unreachable(CliError):
    exit_code = EXIT_UNREACHABLE

    def __init__(self, server: str, url: str, reason: str, hint: str) -> None:
        super().__init__(f"cannot reach {server} at {url} ({reason}). {hint}")
        self.server = server
        self.url = url


class NotConfigured(CliError):
    exit_code = EXIT_USAGE


class BadInput(CliError):
    """A value on the command line (or in a file it names) the contract refuses."""

    exit_code = EXIT_USAGE


class Refused(CliError):
    """The stack answered and said no (not found, forbidden, conflict ...)."""
