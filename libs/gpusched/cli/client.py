"""A small client of the request/reply API, for the CLI, the demo and the tests."""

from __future__ import annotations

import asyncio
import json
from types import TracebackType
from typing import Any, Self

import nats
from nats.aio.client import Client as NatsClient

from gpusched.contracts.messages import GetJob, GetReply, SubmitJob, SubmitReply
from gpusched.contracts.subjects import Subjects
from gpusched.infra import tracing


class ApiError(RuntimeError):
    pass


class ApiClient:
    def __init__(self, nats_url: str, prefix: str = "gpusched", timeout_s: float = 10.0) -> None:
        self.nats_url = nats_url
        self.subjects = Subjects(prefix)
        self.timeout_s = timeout_s
        self._nc: NatsClient | None = None

    async def __aenter__(self) -> Self:
        self._nc = await nats.connect(self.nats_url, name="gpusched-cli", connect_timeout=5)
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._nc is not None:
            await self._nc.close()

    @property
    def nc(self) -> NatsClient:
        assert self._nc is not None, "use `async with ApiClient(...)`"
        return self._nc

    async def request(self, subject: str, body: bytes) -> bytes:
        try:
            msg = await self.nc.request(
                subject, body, timeout=self.timeout_s, headers=tracing.inject() or None
            )
        except nats.errors.NoRespondersError as exc:
            raise ApiError(f"no service answers on {subject}: is the stack running?") from exc
        except nats.errors.TimeoutError as exc:
            raise ApiError(f"no reply on {subject} within {self.timeout_s}s") from exc
        return bytes(msg.data)

    async def wait_until_serving(self, within_s: float = 60.0) -> None:
        """Wait until admission answers (services start in parallel after `up`)."""
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            try:
                await self.get("job-000000000000")
                return
            except ApiError:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)

    async def submit(self, job: SubmitJob) -> SubmitReply:
        with tracing.tracer().start_as_current_span("client submit"):
            raw = await self.request(self.subjects.api_jobs_submit, job.model_dump_json().encode())
        return SubmitReply.model_validate_json(raw)

    async def get(self, job_id: str) -> GetReply:
        raw = await self.request(
            self.subjects.api_jobs_get, GetJob(job_id=job_id).model_dump_json().encode()
        )
        return GetReply.model_validate_json(raw)

    async def call(self, subject_suffix: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Any other API endpoint, by its suffix after the prefix (e.g. `api.billing.statement`)."""
        raw = await self.request(
            f"{self.subjects.prefix}.{subject_suffix}", json.dumps(payload, default=str).encode()
        )
        reply = json.loads(raw)
        assert isinstance(reply, dict)
        return reply
