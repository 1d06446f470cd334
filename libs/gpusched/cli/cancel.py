"""`gpusched cancel JOB_ID [--reason R]`: end a job, whatever state it is in.

A queued, held or parked job is cancelled at once; a running one is `cancelling` until
the cluster agent reports its workloads stopped. A finished job answers `conflict`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any

from gpusched.cli.client import ApiClient
from gpusched.contracts.messages import CancelJob, CancelReply
from gpusched.infra.settings import Settings


def add_parsers(sub: Any) -> None:
    cancel = sub.add_parser("cancel", help="end a job (queued, held, parked or running)")
    cancel.add_argument("job_id")
    cancel.add_argument("--reason", default="", help="why, for the audit record")
    cancel.add_argument("--operator", default=os.environ.get("USER") or "operator")
    cancel.set_defaults(run=_cancel)


def _cancel(args: argparse.Namespace) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            body = CancelJob(job_id=args.job_id, operator=args.operator, reason=args.reason)
            reply = CancelReply.model_validate_json(
                await api.request(api.subjects.api_jobs_cancel, body.model_dump_json().encode())
            )
        if reply.ok:
            print(f"job {reply.job_id} {reply.state}")
            return 0
        error = reply.error
        print(f"gpusched: {error.message if error else 'refused'}", file=sys.stderr)
        return 1

    # A CliError (unreachable, no answer) reaches main() and is printed as one line.
    return asyncio.run(go())
