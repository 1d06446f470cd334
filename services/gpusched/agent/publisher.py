"""Publishing from the edge: straight to JetStream, de-duplicated by envelope id.

The agent has no database and so no outbox. Its events are facts about processes it
can observe again, so it makes their envelope ids deterministic (see `event_id`): a
retry after a failed publish, or a redelivered command, produces the same id, which
JetStream's duplicate window and every consumer's inbox drop.
"""

from __future__ import annotations

import uuid

from nats.js import JetStreamContext
from pydantic import BaseModel

from gpusched.contracts.envelope import Envelope, make_envelope
from gpusched.infra import tracing

_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "gpusched/agent")


def event_id(*parts: str) -> str:
    """A stable envelope id for one fact, e.g. event_id(allocation_id, "started")."""
    return str(uuid.uuid5(_NAMESPACE, "/".join(parts)))


class Publisher:
    def __init__(self, js: JetStreamContext, source: str) -> None:
        self._js = js
        self.source = source

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
    ) -> Envelope:
        envelope = self.envelope(
            message_type,
            payload,
            correlation_id=correlation_id,
            causation_id=causation_id,
            envelope_id=envelope_id,
        )
        await self.send(subject, envelope)
        return envelope

    async def send(self, subject: str, envelope: Envelope) -> None:
        headers = {"Nats-Msg-Id": envelope.id, **tracing.inject()}
        await self._js.publish(subject, envelope.to_bytes(), headers=headers)
