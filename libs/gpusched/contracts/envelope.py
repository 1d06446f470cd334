"""The message envelope every message on the bus travels in (DESIGN §4)."""

from __future__ import annotations

import builtins
import uuid
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.validation import Id, MessageId, Source, first_error

M = TypeVar("M", bound=BaseModel)


def new_id() -> str:
    return str(uuid.uuid4())


def utcnow() -> datetime:
    return datetime.now(UTC)


class Envelope(BaseModel):
    """One message. `id` doubles as the JetStream Nats-Msg-Id, so a retried
    publish of the same envelope is de-duplicated by the server."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: MessageId
    type: MessageId
    version: int = Field(default=1, ge=1, le=1_000_000, strict=True)
    source: Source
    time: datetime
    correlation_id: Id | None = None
    causation_id: Id | None = None
    data: dict[str, Any]
    # The payload as validated at the edge (validation.read_message), handed to the
    # handler by `payload()` without a second validation.
    _payload: BaseModel | None = PrivateAttr(default=None)

    def to_bytes(self) -> bytes:
        return self.model_dump_json().encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Envelope:
        try:
            return cls.model_validate_json(raw)
        except ValidationError as exc:
            raise MalformedMessage(f"not a valid envelope: {_first_error(exc)}") from exc

    def keep_payload(self, payload: BaseModel) -> None:
        """Remember the payload validated at the edge."""
        self._payload = payload

    def payload(self, model: builtins.type[M]) -> M:
        """The typed payload; a payload that does not match its schema is malformed."""
        if isinstance(self._payload, model):
            return self._payload
        try:
            return model.model_validate(self.data)
        except ValidationError as exc:
            raise MalformedMessage(
                f"{self.type} v{self.version}: invalid payload: {_first_error(exc)}"
            ) from exc


def make_envelope(
    message_type: str,
    data: BaseModel,
    *,
    source: str,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    envelope_id: str | None = None,
    time: datetime | None = None,
) -> Envelope:
    return Envelope(
        id=envelope_id or new_id(),
        type=message_type,
        source=source,
        time=time or utcnow(),
        correlation_id=correlation_id,
        causation_id=causation_id,
        data=data.model_dump(mode="json"),
    )


def _first_error(exc: ValidationError) -> str:
    where, message = first_error(exc)
    return f"{where}: {message}"
