"""`gpusched scale JOB N`: move an inference service's replica target inside [min, max]."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from pydantic import ValidationError

from gpusched.cli.client import ApiClient
from gpusched.contracts.messages import Replicas, ScaleJob, ScaleReply
from gpusched.contracts.validation import first_error
from gpusched.infra.settings import Settings


def add_parsers(sub: Any) -> None:
    scale = sub.add_parser("scale", help="set an inference service's replica target")
    scale.add_argument("job_id")
    scale.add_argument("replicas", type=int)
    scale.set_defaults(run=_scale)


def parse_range(text: str) -> Replicas:
    """`--replicas 2` (exactly 2) or `--replicas 2:5` (min 2, max 5)."""
    low, _, high = text.partition(":")
    try:
        return Replicas(min=int(low), max=int(high or low))
    except ValidationError as exc:
        _, message = first_error(exc)
        raise argparse.ArgumentTypeError(f"replicas {text!r}: {message}") from None
    except ValueError:
        raise argparse.ArgumentTypeError(f"replicas {text!r}: use N or MIN:MAX") from None


def _scale(args: argparse.Namespace) -> int:
    settings = Settings()

    async def go() -> int:
        async with ApiClient.for_stack(settings) as api:
            body = ScaleJob(job_id=args.job_id, replicas=args.replicas).model_dump_json().encode()
            reply = ScaleReply.model_validate_json(
                await api.request(api.subjects.api_jobs_scale, body)
            )
        print(reply.model_dump_json(indent=2, exclude_none=True))
        return 0 if reply.ok else 1

    # A CliError (unreachable, no answer) reaches main() and is printed as one line.
    return asyncio.run(go())
