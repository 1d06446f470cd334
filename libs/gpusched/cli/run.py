"""`gpusched up | demo | service | migrate`: run the control plane.

`up` hands the work to stack.Stack (servers, migrations, supervised services,
readiness); `service` is what a container runs; `migrate` prepares an external
installation and says what it did, step by step.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import typer

from gpusched.cli.errors import EXIT_USAGE
from gpusched.cli.numbers import number
from gpusched.contracts.permissions import SERVICE_NAMES

if TYPE_CHECKING:
    from gpusched.infra.settings import Settings


def register(app: typer.Typer) -> None:
    app.command("up", help="Run NATS, PostgreSQL and every service until Ctrl-C.")(up)
    app.command("demo", help="Run the stack and play an inference surge, as a timeline.")(demo)
    app.command("service", help="Run one service in this process (what containers run).")(service)
    app.command("migrate", help="Create the streams and run every service's migrations.")(migrate)
    app.command("asyncapi", help="Print the AsyncAPI 3.0 document of the public contracts.")(
        asyncapi
    )


def asyncapi(
    prefix: Annotated[str, typer.Option(help="the subject prefix")] = "gpusched",
) -> int:
    import json

    from gpusched.contracts.asyncapi import document

    print(json.dumps(document(prefix), indent=2, sort_keys=True))
    return 0


def up(
    log_dir: Annotated[
        Path | None, typer.Option(help="write each service's output to LOG_DIR/<service>.log")
    ] = None,
    ready_timeout: Annotated[
        float,
        typer.Option(parser=number(1, 86400), help="seconds to wait for readiness (1-86400)"),
    ] = 180.0,
) -> int:
    import asyncio

    from gpusched.cli.session import load_settings
    from gpusched.cli.stack import Stack, StackNotReady, StackRunning, missing_files

    settings = load_settings()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(message)s")
    # Each migration's INFO lines say nothing an operator needs at every start.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.root.level))
    stack = Stack(settings, log_dir=log_dir)
    # Until the supervisor's own handlers take over in wait(), SIGTERM stops the start
    # the way Ctrl-C does (KeyboardInterrupt), so the cleanup below still runs.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    ready = False
    try:
        try:
            stack.claim()
        except StackRunning as exc:
            print(f"gpusched: {exc}", file=sys.stderr)
            return 1
        missing = missing_files(settings)
        if missing:
            print(f"gpusched: {missing[0]}", file=sys.stderr)
            return EXIT_USAGE
        print(f"gpusched: starting the stack in {stack.data_dir} ...", flush=True)
        resolved = stack.start()
        started = time.monotonic()

        def progress(line: str) -> None:
            # What each service waits for, then that it is ready (stack.wait_until_ready).
            print(f"  [{time.monotonic() - started:5.1f}s] {line}", flush=True)

        try:
            asyncio.run(stack.wait_until_ready(ready_timeout, progress))
        except StackNotReady as exc:
            print(f"gpusched: {exc}", file=sys.stderr)
            return 1
        ready = True
        print(
            f"gpusched is up and ready: NATS {resolved.nats_url}, "
            f"PostgreSQL {resolved.database_url}"
        )
        print(f"stack file: {stack.stack_file} (the CLI reads it; no URL to export)")
        print("Crashed services and servers are restarted. Ctrl-C stops everything.", flush=True)
        code = stack.wait()
        if stack.failure is not None:
            print(f"gpusched: {stack.failure}", file=sys.stderr)
        return code
    except KeyboardInterrupt:
        # A stop request once the stack served is a clean stop; before, an interrupted start.
        return 0 if ready else 130
    finally:
        stack.stop()
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def demo(
    keep_data: Annotated[bool, typer.Option(help="keep the demo's data dir")] = False,
) -> int:
    from gpusched.cli.demo import run_demo

    return run_demo(keep_data=keep_data)


def service(
    name: Annotated[str, typer.Argument(help=f"one of {', '.join(SERVICE_NAMES)}")],
) -> int:
    import importlib

    from gpusched.cli.session import load_settings

    if name not in SERVICE_NAMES:
        print(f"gpusched: no service {name!r}; one of {', '.join(SERVICE_NAMES)}", file=sys.stderr)
        return EXIT_USAGE
    # A setting the service cannot start with is the operator's to fix: one line.
    try:
        settings = load_settings(service=True)
        settings.require_urls()
    except RuntimeError as exc:
        print(f"gpusched: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if (missing := _missing_extra(name, settings)) is not None:
        print(f"gpusched: {missing}", file=sys.stderr)
        return EXIT_USAGE
    # A service process: its log keeps the full traceback of a crash.
    importlib.import_module(f"gpusched.{name}.app").main()
    return 0


def _missing_extra(name: str, settings: Settings) -> str | None:
    """What the service needs installed for these settings and lacks, in words."""
    import importlib.util

    if (
        name == "agent"
        and settings.agent.cluster == "kubernetes"
        and importlib.util.find_spec("kubernetes_asyncio") is None
    ):
        return (
            "the Kubernetes agent (GPUSCHED_AGENT__CLUSTER=kubernetes) needs the extra "
            "`kubernetes`: pip install 'gpusched[kubernetes]' (an image: docker build "
            "--build-arg EXTRAS=[kubernetes])"
        )
    return None


def migrate() -> int:
    import asyncio

    from gpusched.cli.client import require_database_url, require_nats_url, stack_settings
    from gpusched.cli.session import load_settings

    settings = stack_settings(load_settings())
    require_database_url(settings)
    require_nats_url(settings)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    asyncio.run(_migrate(settings))
    return 0


async def _migrate(settings: Settings) -> None:
    from gpusched.cli.stack import prepare, service_migrations
    from gpusched.infra.db import create_engine
    from gpusched.infra.migrations import migrate
    from gpusched.infra.tls import database_context

    started = time.monotonic()

    def step(text: str) -> None:
        print(f"[{time.monotonic() - started:5.1f}s] {text}", flush=True)

    step("checking NATS and PostgreSQL, creating the streams ...")
    await prepare(settings, services=())
    step("streams ready")
    _, db_url = settings.require_urls()
    engine = create_engine(db_url, pool_size=1, tls=database_context(settings))
    try:
        for name in SERVICE_NAMES:
            path = service_migrations(name)
            if path is None:
                step(f"{name}: no schema")
                continue
            await migrate(engine, name, path)
            step(f"{name}: schema up to date")
    finally:
        await engine.dispose()
    step("streams and migrations are up to date")
