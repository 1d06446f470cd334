"""`gpusched`: run the control plane and talk to it.

Every command that talks to the stack finds it through the stack file that `gpusched up`
writes in GPUSCHED_DATA_DIR (default .gpusched), else through GPUSCHED_NATS_URL; it
fails within seconds, in one line, when it cannot reach it. Modules that pull in
database drivers, NATS or the contracts are imported inside the commands, so `--help`
and shell completion stay fast.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence
from typing import Annotated

import typer

from gpusched.cli import audit, auth, billing, cancel, jobs, nodes, replay, replicas, run
from gpusched.cli.errors import EXIT_USAGE, CliError

HELP = """Run the gpusched control plane and talk to it.

\b
Finding the stack: commands read the stack file that `gpusched up` writes in
GPUSCHED_DATA_DIR (default .gpusched, relative to where you run it); set
GPUSCHED_DATA_DIR to reach a stack started elsewhere, or GPUSCHED_NATS_URL (and
GPUSCHED_NATS_CREDENTIALS) for an external one. Your identity is the stack's operator
credentials unless GPUSCHED_NATS_CREDENTIALS names another (`gpusched auth issue`).

\b
Exit codes: 0 done, 1 refused or failed, 2 bad input or no stack known, 3 the stack
cannot be reached or did not answer. --debug (or GPUSCHED_DEBUG=1) shows tracebacks.
Shell completion: `gpusched --install-completion` (bash, zsh, fish).
"""

app = typer.Typer(
    name="gpusched",
    help=HELP,
    no_args_is_help=True,
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


class _State:
    debug = False


@app.callback()
def _root(
    debug: Annotated[
        bool, typer.Option("--debug", help="show the traceback of an error (GPUSCHED_DEBUG=1)")
    ] = False,
) -> None:
    if debug:
        _State.debug = True


run.register(app)
jobs.register(app)
cancel.register(app)
replicas.register(app)
audit.register(app)
billing.register(app)
replay.register(app)
app.add_typer(nodes.app, name="node")
app.add_typer(auth.app, name="auth")


def _debugging() -> bool:
    return _State.debug or os.environ.get("GPUSCHED_DEBUG", "") not in ("", "0")


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit code. A person never sees a traceback unless asked."""
    from typer._click.exceptions import ClickException
    from typer.exceptions import Abort
    from typer.main import get_command

    _State.debug = False
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        result = get_command(app).main(args=args, prog_name="gpusched", standalone_mode=False)
    except ClickException as exc:
        # A usage error (unknown option, bad value of an option): click's own one line.
        exc.show()
        return exc.exit_code
    except (Abort, KeyboardInterrupt):
        return 130
    except CliError as exc:
        if _debugging():
            traceback.print_exc()
        print(f"gpusched: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        return _unexpected(exc)
    return result if isinstance(result, int) else 0


def _unexpected(exc: Exception) -> int:
    if _debugging():
        traceback.print_exc()
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        # A value given on the command line (or in a file it names) breaks the contract.
        from gpusched.contracts.validation import first_error

        field, message = first_error(exc)
        print(f"gpusched: invalid {field}: {message}", file=sys.stderr)
        return EXIT_USAGE
    if not _debugging():
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        print(
            f"gpusched: unexpected error: {type(exc).__name__}"
            + (f": {first}" if first else "")
            + " (run with --debug or GPUSCHED_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
