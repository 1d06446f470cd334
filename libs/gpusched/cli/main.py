"""`gpusched`: run the control plane and talk to it.

gpusched up                 embedded NATS + PostgreSQL (unless GPUSCHED_NATS_URL /
                            GPUSCHED_DATABASE_URL are set), every service as a process,
                            all restarted if they die; writes <data dir>/stack.json
gpusched demo               `up` plus a scripted inference surge, as a timeline
gpusched service NAME       run one service (what containers run)
gpusched migrate            create streams and run every service's migrations
gpusched submit ...         submit a training job
gpusched get JOB_ID         a job's state, allocation and checkpoint
gpusched why JOB_ID         why a job waits, in words
gpusched approve JOB_ID     let a job held above its team's max priority class in
gpusched node VERB ...      add|reload|drain|undrain|fail|recover|remove|list GPU nodes
gpusched scale JOB_ID N     set an inference service's replica target
gpusched bill [--team T]    billing statements per team
gpusched audit [--follow]   the audit stream

Commands that talk to the stack find it through GPUSCHED_NATS_URL, else through the
stack file `gpusched up` wrote in GPUSCHED_DATA_DIR (default .gpusched). They fail within
seconds, in one line, when it cannot be reached (exit code 3; 2 when no stack is known).
`--debug` (or GPUSCHED_DEBUG=1) shows the traceback of an unexpected error.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from pydantic import ValidationError

from gpusched.cli import auth, cancel, nodes, replicas
from gpusched.cli.client import (
    EXIT_USAGE,
    ApiClient,
    CliError,
    connect_nats,
    require_database_url,
    require_nats_url,
    stack_identity,
    stack_settings,
)
from gpusched.cli.stack import (
    SERVICES,
    Stack,
    StackNotReady,
    StackRunning,
    missing_files,
    prepare,
)
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import (
    ApproveJob,
    ApproveReply,
    GpuRequest,
    JobKind,
    PriorityClassName,
    SubmitJob,
    WhyJob,
    WhyReply,
)
from gpusched.contracts.subjects import Subjects
from gpusched.contracts.validation import first_error
from gpusched.infra import natsauth
from gpusched.infra.settings import Settings
from gpusched.infra.tls import nats_context


def settings_error(exc: ValidationError) -> str:
    """The environment variable a settings error is about, and what is wrong with it."""
    where, message = first_error(exc)
    variable = "GPUSCHED_" + where.upper().replace(".", "__")
    return f"{variable}: {message}; set it right (or unset it for the default) and start again"


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.command == "service":
        # A setting the service cannot start with is the operator's to fix: one line.
        try:
            Settings().require_urls()
        except ValidationError as exc:
            print(f"gpusched: {settings_error(exc)}", file=sys.stderr)
            return EXIT_USAGE
        except RuntimeError as exc:
            print(f"gpusched: {exc}", file=sys.stderr)
            return EXIT_USAGE
        # A service process: its log keeps the full traceback of a crash.
        code: int = args.run(args)
        return code
    debug = args.debug or os.environ.get("GPUSCHED_DEBUG", "") not in ("", "0")
    try:
        code = args.run(args)
    except CliError as exc:
        if debug:
            traceback.print_exc()
        print(f"gpusched: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
    except ValidationError as exc:
        # A value given on the command line (or in a file it names) breaks the contract.
        if debug:
            traceback.print_exc()
        field, message = first_error(exc)
        print(f"gpusched: invalid {field}: {message}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:
        # Users never see a traceback unless they ask for one.
        if debug:
            traceback.print_exc()
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            print(
                f"gpusched: unexpected error: {type(exc).__name__}"
                + (f": {first}" if first else "")
                + " (run with --debug or GPUSCHED_DEBUG=1 for the traceback)",
                file=sys.stderr,
            )
        return 1
    return code


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpusched", description=__doc__.split("\n\n")[0])
    p.add_argument("--debug", action="store_true", help="show tracebacks (also GPUSCHED_DEBUG=1)")
    sub = p.add_subparsers(dest="command")

    up = sub.add_parser("up", help="run NATS, PostgreSQL and every service")
    up.add_argument("--log-dir", help="write each service's output to LOG_DIR/<service>.log")
    up.add_argument(
        "--ready-timeout", type=float, default=180.0, help="seconds to wait for readiness"
    )
    up.set_defaults(run=_up)

    demo = sub.add_parser("demo", help="run the stack and play an inference surge")
    demo.add_argument("--keep-data", action="store_true", help="keep the demo's data dir")
    demo.set_defaults(run=_demo)

    svc = sub.add_parser("service", help="run one service in this process")
    svc.add_argument("name", choices=SERVICES)
    svc.set_defaults(run=_service)

    mig = sub.add_parser("migrate", help="create streams and run every service's migrations")
    mig.set_defaults(run=_migrate)

    submit = sub.add_parser("submit", help="submit a training job")
    submit.add_argument("--name", required=True)
    submit.add_argument("--team", required=True)
    submit.add_argument("--gpus", type=int, required=True)
    submit.add_argument("--model")
    submit.add_argument("--milli", type=int, help="a fraction of one GPU in 1/1000 (1..999)")
    submit.add_argument(
        "--memory-gib", type=float, help="memory per GPU (a fraction's cap; picks a MIG slice)"
    )
    submit.add_argument(
        "--priority", default="p1-normal", choices=[c.value for c in PriorityClassName]
    )
    submit.add_argument("--kind", default="training", choices=[k.value for k in JobKind])
    submit.add_argument("--idempotency-key")
    submit.add_argument(
        "--replicas", type=replicas.parse_range, help="inference: N or MIN:MAX replicas"
    )
    submit.set_defaults(run=_submit)

    get = sub.add_parser("get", help="show a job")
    get.add_argument("job_id")
    get.set_defaults(run=_get)

    why = sub.add_parser("why", help="explain in words why a job waits")
    why.add_argument("job_id")
    why.set_defaults(run=_why)

    approve = sub.add_parser("approve", help="let a job held above its team's priority in")
    approve.add_argument("job_id")
    approve.add_argument("--operator", default=os.environ.get("USER") or "operator")
    approve.add_argument("--reason", default="")
    approve.set_defaults(run=_approve)

    nodes.add_parsers(sub)
    replicas.add_parsers(sub)
    cancel.add_parsers(sub)
    auth.add_parsers(sub)

    bill = sub.add_parser("bill", help="billing statements per team")
    bill.add_argument("--team")
    bill.set_defaults(run=_bill)

    spec = sub.add_parser("asyncapi", help="print the AsyncAPI document of the public contracts")
    spec.add_argument("--prefix", default="gpusched")
    spec.set_defaults(run=_asyncapi)

    audit = sub.add_parser("audit", help="print the audit stream")
    audit.add_argument("--follow", action="store_true")
    audit.set_defaults(run=_audit)
    return p


def _logging(settings: Settings) -> None:
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(message)s")


def _up(args: argparse.Namespace) -> int:
    settings = Settings()
    _logging(settings)
    # Each migration's INFO lines say nothing an operator needs at every start.
    logging.getLogger("alembic").setLevel(max(logging.WARNING, logging.root.level))
    stack = Stack(settings, log_dir=None if args.log_dir is None else Path(args.log_dir))
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
            print(f"  [{time.monotonic() - started:5.1f}s] {line}", flush=True)

        try:
            asyncio.run(stack.wait_until_ready(args.ready_timeout, progress))
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


def _demo(args: argparse.Namespace) -> int:
    from gpusched.cli.demo import run_demo

    return run_demo(keep_data=args.keep_data)


def _service(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"gpusched.{args.name}.app")
    module.main()
    return 0


def _migrate(_: argparse.Namespace) -> int:
    settings = stack_settings()
    require_database_url(settings)
    require_nats_url(settings)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    asyncio.run(prepare(settings))
    print("streams and migrations are up to date")
    return 0


def _submit(args: argparse.Namespace) -> int:
    settings = Settings()
    job = SubmitJob(
        name=args.name,
        team=args.team,
        kind=JobKind(args.kind),
        priority_class=PriorityClassName(args.priority),
        gpus=GpuRequest(
            count=args.gpus, model=args.model, milli=args.milli, memory_gib=args.memory_gib
        ),
        idempotency_key=args.idempotency_key,
        replicas=args.replicas,
    )

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            reply = await api.submit(job)
        print(reply.model_dump_json(indent=2, exclude_none=True))
        return 0 if reply.ok else 1

    return _api_call(go)


def _get(args: argparse.Namespace) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            reply = await api.get(args.job_id)
        print(reply.model_dump_json(indent=2, exclude_none=True))
        return 0 if reply.ok else 1

    return _api_call(go)


def _why(args: argparse.Namespace) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            body = WhyJob(job_id=args.job_id).model_dump_json().encode()
            reply = WhyReply.model_validate_json(await api.request(api.subjects.api_jobs_why, body))
        if not reply.ok:
            print(reply.model_dump_json(indent=2, exclude_none=True))
            return 1
        print(f"{reply.job_id} is {reply.state}:")
        for reason in reply.reasons:
            print(f"  - {reason}")
        return 0

    return _api_call(go)


def _approve(args: argparse.Namespace) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            body = ApproveJob(job_id=args.job_id, operator=args.operator, reason=args.reason)
            raw = await api.request(api.subjects.api_jobs_approve, body.model_dump_json().encode())
        reply = ApproveReply.model_validate_json(raw)
        print(reply.model_dump_json(indent=2, exclude_none=True))
        return 0 if reply.ok else 1

    return _api_call(go)


def _bill(args: argparse.Namespace) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            reply = await api.call("api.billing.statement", {"team": args.team})
        if not reply.get("ok"):
            print(json.dumps(reply, indent=2), file=sys.stderr)
            return 1
        print(reply.get("text", ""))
        return 0

    return _api_call(go)


def _asyncapi(args: argparse.Namespace) -> int:
    from gpusched.contracts.asyncapi import document

    print(json.dumps(document(args.prefix), indent=2, sort_keys=True))
    return 0


def _audit(args: argparse.Namespace) -> int:
    import nats
    from nats.js.api import ConsumerConfig, DeliverPolicy

    settings = stack_settings()
    subjects = Subjects(settings.subject_prefix)

    async def go() -> int:
        # The audit reader: the one identity that may read the audit stream.
        nc = await connect_nats(
            require_nats_url(settings),
            "gpusched-audit",
            credentials=stack_identity(settings, natsauth.AUDITOR),
            tls=nats_context(settings),
        )
        try:
            js = nc.jetstream()
            sub = await js.subscribe(
                subjects.audit(">"),
                stream=subjects.audit_stream,
                config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
                manual_ack=False,
            )
            while True:
                try:
                    msg = await sub.next_msg(timeout=1.0 if not args.follow else 3600)
                except nats.errors.TimeoutError:
                    if not args.follow:
                        return 0
                    continue
                env = Envelope.from_bytes(msg.data)
                d = env.data
                when = f"{env.time:%H:%M:%S}"
                print(f"{when} {d['actor']:<10} {d['action']:<24} {d['entity']}: {d['reason']}")
        finally:
            await nc.close()

    return _api_call(go)


def _api_call(go: Callable[[], Coroutine[Any, Any, int]]) -> int:
    """Run one command's coroutine; its CliError reaches main() as one line."""
    return asyncio.run(go())


if __name__ == "__main__":
    raise SystemExit(main())
