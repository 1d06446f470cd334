"""Request/reply contracts of `<p>.api.billing.statement` and `<p>.api.billing.job`.

Amounts travel as JSON strings ("12.34"), never floats: pydantic serializes Decimal as
a string, and a client parsing the reply with these models gets Decimal back.
"""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal
from enum import StrEnum

from pydantic import Field, field_validator, model_validator

from gpusched.contracts.messages import ApiError, Wire
from gpusched.contracts.validation import Id, Moment


def statement_subject(prefix: str) -> str:
    return f"{prefix}.api.billing.statement"


def job_bill_subject(prefix: str) -> str:
    return f"{prefix}.api.billing.job"


class ErrorCode(StrEnum):
    BAD_REQUEST = "bad_request"
    UNKNOWN_GPU_MODEL = "unknown_gpu_model"


class StatementRequest(Wire):
    """Statements for one team (or every team) over [period_start, period_end).

    period_start defaults to the first usage or credit on record, period_end to now.
    """

    team: str | None = Field(default=None, min_length=1, max_length=64)
    period_start: Moment | None = None
    period_end: Moment | None = None

    # Runs before the ordering check below, so that check sees the clamped bounds: a
    # bound whose UTC instant falls outside years 1-9999 (0001-01-01T00:00:00+01:00)
    # means "since the beginning" or "until the end", and becomes the first or last
    # representable instant. (Not in the docstring: it is the published schema's text.)
    @field_validator("period_start", "period_end")
    @classmethod
    def _representable_in_utc(cls, value: datetime | None) -> datetime | None:
        return None if value is None else clamp_to_utc_range(value)

    @model_validator(mode="after")
    def _period_is_ordered(self) -> StatementRequest:
        if (
            self.period_start is not None
            and self.period_end is not None
            and self.period_end <= self.period_start
        ):
            raise ValueError("period_end must be after period_start")
        return self


def clamp_to_utc_range(moment: datetime) -> datetime:
    """`moment` as given if it has a UTC value, else the nearest one in years 1-9999.

    An aware time at the very edge of the calendar (year 1 east of UTC, year 9999 west
    of it) has no UTC datetime; the database driver converts to UTC, so such a bound
    would fail the request deep inside instead of meaning "from the start" / "to the end".
    """
    try:
        moment.astimezone(UTC)
    except OverflowError:
        # An offset east of UTC pushes the instant below year 1; west, above year 9999.
        offset = moment.utcoffset()
        east = offset is not None and offset.total_seconds() > 0
        return (datetime.min if east else datetime.max).replace(tzinfo=UTC)
    return moment


class LineView(Wire):
    allocation_id: str
    job_id: str
    kind: str
    gpu_model: str
    start: datetime
    end: datetime
    open: bool  # still allocated: billed up to the end of the period or now
    gpu_seconds: Decimal
    gpu_cost: Decimal
    cpu_cost: Decimal
    memory_cost: Decimal
    disk_cost: Decimal
    requests: Decimal
    request_cost: Decimal
    total: Decimal


class CreditView(Wire):
    allocation_id: str
    job_id: str
    gpu_model: str
    at: datetime
    lost_gpu_seconds: Decimal
    amount: Decimal  # negative


class StatementView(Wire):
    team: str
    currency: str
    period_start: datetime
    period_end: datetime
    lines: list[LineView]
    credits: list[CreditView]
    subtotal: Decimal
    credits_total: Decimal
    total: Decimal  # rounded to cents; negative when credits exceed usage


class StatementReply(Wire):
    ok: bool
    statements: list[StatementView] = Field(default_factory=list)
    text: str = ""
    error: ApiError | None = None


class JobBillRequest(Wire):
    """One job's usage and credits, priced with today's book, over its whole life."""

    job_id: Id


class JobBillReply(Wire):
    ok: bool
    job_id: str | None = None
    # None: nothing on record for the job (never placed, or not yet metered).
    statement: StatementView | None = None
    error: ApiError | None = None
