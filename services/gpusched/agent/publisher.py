"""Publishing from the edge: to JetStream through a buffer, de-duplicated by envelope id.

The agent has no database and so no outbox. Its events are facts about processes it
can observe again, so it makes their envelope ids deterministic (see `event_id`): a
retry after a failed publish, or a redelivered command, produces the same id, which
JetStream's duplicate window and every consumer's inbox drop.

Events go through the SDK's bounded in-memory buffer (gpusched.sdk.delivery), so the
agent keeps its workloads running while NATS is away and reports what happened once it
is back: results (a workload started or stopped, a node's health, a MIG change) are
never dropped; telemetry is droppable and is not sent once stale.
"""

from __future__ import annotations

import uuid

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from pydantic import BaseModel

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.infra import tracing
from gpusched.sdk.delivery import DeliveryState, EventBuffer, Outgoing

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "gpusched/agent")


def event_id(*parts: str) -> str:
    """A stable envelope id for one fact, e.g. event_id(allocation_id, "started")."""
    return str(uuid.uuid5(_NAMESPACE, "/".join(parts)))


class Publisher:
    def __init__(self, nc: NatsClient, js: JetStreamContext, source: str) -> None:
        self._events = EventBuffer(nc, js, name=source)
        self.source = source

    @property
    def state(self) -> DeliveryState:
        return self._events.state

    async def flush(self, timeout: float) -> int:  # noqa: ASYNC109 - a bounded wait
        """Wait at most `timeout` s for buffered events to go out; how many are left."""
        return await self._events.flush(timeout)

    async def close(self, timeout: float) -> int:  # noqa: ASYNC109 - a bounded wait
        """Deliver what is buffered for at most `timeout` s, then stop; how many were lost."""
        return await self._events.close(timeout)

    def envelope(
        self,
        message_type: str,
        payload: BaseModel,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        envelope_id: str | None = None,
    ) -> Envelope:
        return make_envelope(
            message_type,
            payload,
            source=self.source,
            correlation_id=correlation_id,
            causation_id=causation_id,
            envelope_id=envelope_id,
        )

    async def publish(
        self,
        subject: str,
        message_type: str,
        payload: BaseModel,
        *,
        correlation_id: str | None = None,
        causation_id: str | None = None,
        envelope_id: str | None = None,
        stale_after_s: float | None = None,
    ) -> Envelope:
        """Publish one event. With `stale_after_s` it is droppable (telemetry): dropped
        first when the buffer is full, and not sent once older than that."""
        envelope = self.envelope(
            message_type,
            payload,
            correlation_id=correlation_id,
            causation_id=causation_id,
            envelope_id=envelope_id,
        )
        await self.send(subject, envelope, stale_after_s=stale_after_s)
        return envelope

    async def send(
        self, subject: str, envelope: Envelope, *, stale_after_s: float | None = None
    ) -> None:
        await self._events.send(
            Outgoing(
                subject,
                envelope.to_bytes(),
                envelope.id,
                envelope.type,
                droppable=stale_after_s is not None,
                max_age_s=stale_after_s,
                headers=tracing.inject(),
            )
        )
