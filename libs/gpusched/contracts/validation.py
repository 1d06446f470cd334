"""The one place where messages are validated (DESIGN §5, "Nothing stops the cluster").

Pure: no I/O and no clock of its own; the receiver's `now` is passed in.

Two halves:
- Reusable annotated types that every model in `messages.py` is built from: finite
  numbers only, ranges, strict types (a bool or a string never passes as a number),
  string rules (length, no control, NUL or bidi-override characters), argv limits, and
  observation timestamps checked against the receiver's clock.
- The edges: `read_message` for a stream message (envelope, type, version, payload,
  clock skew, subject versus payload) and `parse_request` for a request/reply body. A
  message that fails is `MalformedMessage` (dead-lettered, never retried); a request
  that fails is an `invalid` error naming the field.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Final, Generic, TypeVar

from pydantic import (
    AfterValidator,
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    ValidationInfo,
    create_model,
)

from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.subjects import Subjects, has_node_token, node_token

if TYPE_CHECKING:
    # messages.py builds its models from the types here: imported where used.
    from gpusched.contracts.envelope import Envelope
    from gpusched.contracts.messages import ApiError

__all__ = [
    "ARGV_MAX_BYTES",
    "ARGV_MAX_ITEMS",
    "DEFAULT_MAX_CLOCK_SKEW_S",
    "Argv",
    "Attempt",
    "Bytes",
    "Count",
    "CpuMilli",
    "Document",
    "EdgeClock",
    "Fraction",
    "GpuAsk",
    "GpuCount",
    "GpuIndex",
    "Id",
    "Instant",
    "Invalid",
    "Latency",
    "MessageId",
    "MiB",
    "Milli",
    "Name",
    "ObservedAt",
    "OptionalText",
    "Power",
    "Reason",
    "Seconds",
    "Source",
    "Step",
    "StepSeconds",
    "Steps",
    "StrictFlag",
    "Team",
    "Temperature",
    "Text",
    "Uri",
    "check_subject",
    "check_text",
    "parse_request",
    "printable",
    "read_message",
]

# --- limits -----------------------------------------------------------------------------
MAX_COUNT: Final = 10**12  # requests, queue depth, steps: far above anything real
MAX_BYTES: Final = 2**50  # one checkpoint: a pebibyte
MAX_MIB: Final = 2**30  # one GPU's memory in MiB: a pebibyte
MAX_GPUS: Final = 1024  # GPUs per node, and the index bound
MAX_SECONDS: Final = 10.0**9  # ~31 years
# A simulated training step: at least a millisecond, and a whole workload (steps x
# step_seconds) at most MAX_SECONDS.
MIN_STEP_SECONDS: Final = 0.001
MAX_WORKLOAD_SECONDS: Final = MAX_SECONDS
MAX_MS: Final = 10.0**9
MAX_ATTEMPTS: Final = 10**6
ID_MAX: Final = 200
NAME_MAX: Final = 200
TEXT_MAX: Final = 4000
URI_MAX: Final = 4096
ARGV_MAX_ITEMS: Final = 256
ARGV_MAX_BYTES: Final = 64 * 1024
DOCUMENT_MAX_DEPTH: Final = 16
DOCUMENT_MAX_ITEMS: Final = 10_000
DOCUMENT_STRING_MAX: Final = 64 * 1024
REQUEST_STRING_MAX: Final = 64 * 1024
# How far ahead of the receiver's clock a timestamp may be (the `bus.max_clock_skew_s`
# setting); how far behind is bounded by the max age of the stream it came on.
DEFAULT_MAX_CLOCK_SKEW_S: Final = 300.0

# C0 and C1 controls (and DEL), and the bidi embedding/override/isolate characters that
# make a name read differently from what it is (U+202A-202E, U+2066-2069).
_BIDI: Final = frozenset(chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A)))
_CONTROLS: Final = frozenset(chr(c) for c in (*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0)))
_LINE_BREAKS: Final = frozenset("\t\n\r")


# The characters check_text refuses, as one character class (the C engine scans a string
# in one call; a Python loop over its characters costs ~1 µs per id): every control and
# bidi character, and all of them but the line breaks for free text.
_REFUSED: Final = re.compile("[" + "".join(re.escape(ch) for ch in sorted(_BIDI | _CONTROLS)) + "]")
_REFUSED_MULTILINE: Final = re.compile(
    "[" + "".join(re.escape(ch) for ch in sorted((_BIDI | _CONTROLS) - _LINE_BREAKS)) + "]"
)


def check_text(value: str, *, max_length: int, multiline: bool = False) -> str:
    """A string within its length, without NUL, control or bidi-override characters
    (free text may break lines)."""
    if len(value) > max_length:
        raise ValueError(f"at most {max_length} characters, got {len(value)}")
    found = (_REFUSED_MULTILINE if multiline else _REFUSED).search(value)
    if found is not None:
        ch = found.group()
        kind = "bidi control" if ch in _BIDI else "control"
        raise ValueError(f"{kind} character U+{ord(ch):04X} is not allowed")
    return value


def printable(value: str, limit: int) -> str:
    """`value` made safe to show and store: control and bidi characters escaped, cut
    to `limit` characters. For text that did not pass validation (a hostile subject or
    error message) but must still be reported."""
    safe = "".join(
        ch.encode("unicode_escape").decode() if ch in _BIDI or ch in _CONTROLS else ch
        for ch in value[: limit * 2]
    )
    return safe if len(safe) <= limit else safe[: limit - 3] + "..."


def _text(max_length: int, *, multiline: bool = False) -> AfterValidator:
    return AfterValidator(lambda v: check_text(v, max_length=max_length, multiline=multiline))


# --- strings ----------------------------------------------------------------------------
Id = Annotated[str, Field(min_length=1, max_length=ID_MAX), _text(ID_MAX)]
Name = Annotated[str, Field(max_length=NAME_MAX), _text(NAME_MAX)]
Text = Annotated[str, Field(max_length=TEXT_MAX), _text(TEXT_MAX, multiline=True)]
# A NATS .creds file's text (a user JWT and its seed): a few kB.
CREDENTIALS_MAX = 16 * 1024
Credentials = Annotated[
    str, Field(max_length=CREDENTIALS_MAX), _text(CREDENTIALS_MAX, multiline=True)
]
OptionalText = Text | None
Uri = Annotated[str, Field(min_length=1, max_length=URI_MAX), _text(URI_MAX)]
# Bounds tighter than the general ones are types of their own: an outer Field() cannot
# tighten a bound the annotated type already sets (the type's own bound would win).
Team = Annotated[str, Field(min_length=1, max_length=64), _text(64)]
Reason = Annotated[str, Field(max_length=1000), _text(1000, multiline=True)]
MessageId = Annotated[str, Field(min_length=1, max_length=128), _text(128)]
Source = Annotated[str, Field(min_length=1, max_length=64), _text(64)]


def _argv_size(argv: list[str]) -> list[str]:
    size = sum(len(arg.encode()) for arg in argv)
    if size > ARGV_MAX_BYTES:
        raise ValueError(f"argv is {size} bytes; at most {ARGV_MAX_BYTES} bytes in all")
    return argv


_Arg = Annotated[str, Field(max_length=URI_MAX), _text(URI_MAX)]
Argv = Annotated[list[_Arg], Field(max_length=ARGV_MAX_ITEMS), AfterValidator(_argv_size)]

# --- numbers: strict (no bools, no strings) and finite ----------------------------------
Count = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
Step = Annotated[int, Strict(), Field(ge=0, le=MAX_COUNT)]
Steps = Annotated[int, Strict(), Field(ge=1, le=MAX_COUNT)]  # a workload's length
Bytes = Annotated[int, Strict(), Field(ge=0, le=MAX_BYTES)]
MiB = Annotated[int, Strict(), Field(ge=0, le=MAX_MIB)]
GpuIndex = Annotated[int, Strict(), Field(ge=0, lt=MAX_GPUS)]
GpuCount = Annotated[int, Strict(), Field(ge=1, le=MAX_GPUS)]
# GPUs a job asks: 0 for a job of host CPU and memory alone.
GpuAsk = Annotated[int, Strict(), Field(ge=0, le=MAX_GPUS)]
# Host CPU in 1/1000 of a core, as node specs state it.
CpuMilli = Annotated[int, Strict(), Field(ge=0, le=10**9)]
Milli = Annotated[int, Strict(), Field(ge=1, le=1000)]
Attempt = Annotated[int, Strict(), Field(ge=1, le=MAX_ATTEMPTS)]
StrictFlag = Annotated[bool, Strict()]
Fraction = Annotated[float, Strict(), Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Seconds = Annotated[float, Strict(), Field(ge=0.0, le=MAX_SECONDS, allow_inf_nan=False)]
StepSeconds = Annotated[
    float, Strict(), Field(ge=MIN_STEP_SECONDS, le=MAX_SECONDS, allow_inf_nan=False)
]
Latency = Annotated[float, Strict(), Field(ge=0.0, le=MAX_MS, allow_inf_nan=False)]
Temperature = Annotated[float, Strict(), Field(ge=-273.0, le=1000.0, allow_inf_nan=False)]
Power = Annotated[float, Strict(), Field(ge=0.0, le=10.0**6, allow_inf_nan=False)]


# --- free-form documents (audit details, node specs, progress metrics) ---------------------
def check_document(value: Any, *, depth: int = 0) -> Any:
    """A JSON-like value of bounded depth and size, whose strings follow the text rules
    and whose numbers are finite."""
    # Every audit record's details pass here: a walk that only answers "fine" first,
    # and the walk that names the problem only when there is one (the same verdicts).
    if _document_fine(value, depth):
        return value
    return _check_document(value, depth=depth)


def _document_fine(value: Any, depth: int) -> bool:
    """True only if `_check_document` accepts `value`; False means: ask it."""
    if depth > DOCUMENT_MAX_DEPTH:
        return False
    kind = type(value)
    if kind is str:
        return len(value) <= DOCUMENT_STRING_MAX and _REFUSED_MULTILINE.search(value) is None
    if kind is dict:
        if len(value) > DOCUMENT_MAX_ITEMS:
            return False
        for key, item in value.items():
            if type(key) is not str or len(key) > NAME_MAX or _REFUSED.search(key) is not None:
                return False
            if not _document_fine(item, depth + 1):
                return False
        return True
    if kind is list or kind is tuple:
        return len(value) <= DOCUMENT_MAX_ITEMS and all(
            _document_fine(item, depth + 1) for item in value
        )
    if kind is float:
        return math.isfinite(value)
    return kind is int or kind is bool or value is None


def _check_document(value: Any, *, depth: int = 0) -> Any:
    if depth > DOCUMENT_MAX_DEPTH:
        raise ValueError(f"nested deeper than {DOCUMENT_MAX_DEPTH} levels")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("numbers must be finite (no NaN or Infinity)")
    elif isinstance(value, str):
        check_text(value, max_length=DOCUMENT_STRING_MAX, multiline=True)
    elif isinstance(value, Mapping):
        if len(value) > DOCUMENT_MAX_ITEMS:
            raise ValueError(f"more than {DOCUMENT_MAX_ITEMS} entries")
        for key, item in value.items():
            check_text(str(key), max_length=NAME_MAX)
            _check_document(item, depth=depth + 1)
    elif isinstance(value, list | tuple):
        if len(value) > DOCUMENT_MAX_ITEMS:
            raise ValueError(f"more than {DOCUMENT_MAX_ITEMS} items")
        for item in value:
            _check_document(item, depth=depth + 1)
    return value


Document = Annotated[dict[str, Any], AfterValidator(check_document)]


# --- time -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class EdgeClock:
    """The receiver's clock at the edge: a timestamp may be at most `max_skew_s` ahead
    of `now`, and at most `max_age_s` behind it (None: no bound)."""

    now: datetime
    max_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S
    max_age_s: float | None = None

    def check(self, value: datetime) -> datetime:
        if value.tzinfo is None:
            raise ValueError("a timestamp needs a time zone (e.g. a trailing Z)")
        ahead = (value - self.now).total_seconds()
        if ahead > self.max_skew_s:
            raise ValueError(
                f"{ahead:.0f} s ahead of the receiver's clock; at most {self.max_skew_s:.0f} s"
            )
        if self.max_age_s is not None and -ahead > self.max_age_s:
            raise ValueError(f"{-ahead:.0f} s old; at most {self.max_age_s:.0f} s")
        return value


def _observed(value: datetime, info: ValidationInfo) -> datetime:
    clock = info.context.get("clock") if isinstance(info.context, dict) else None
    if isinstance(clock, EdgeClock):
        return clock.check(value)
    if value.tzinfo is None:
        raise ValueError("a timestamp needs a time zone (e.g. a trailing Z)")
    return value


# When something was observed (a sample, a stat): within the receiver's skew window when
# read at the edge; any aware time when a service builds the message itself.
ObservedAt = Annotated[datetime, AfterValidator(_observed)]


# A point in time a caller asks about (a statement's period): an RFC 3339 string with a
# time zone, never a number (lax parsing would read -1 as 1969).
Moment = Annotated[AwareDatetime, Strict()]


def _expressible_in_utc(value: datetime) -> datetime:
    try:
        value.astimezone(UTC)
    except OverflowError:
        raise ValueError(f"{value.isoformat()} is out of range in UTC") from None
    return value


# A point in time a message states (a deadline, when something happened): with a time
# zone, since every receiver compares it with its own aware clock (a naive one would
# raise TypeError there, e.g. in a training loop), and within years 1-9999 in UTC.
Instant = Annotated[AwareDatetime, AfterValidator(_expressible_in_utc)]


# --- the stream edge ----------------------------------------------------------------------
# The newest version of each message type this build reads; a type not listed: 1.
# checkpoint.confirmed v2: `kind` (a directory checkpoint described by its manifest).
SUPPORTED_VERSIONS: Final[Mapping[str, int]] = {"checkpoint.confirmed": 2}


def read_message(
    raw: bytes,
    subject: str,
    now: datetime,
    *,
    max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    also_known: Collection[str] = (),
) -> Envelope:
    """Parse and validate one stream message, once, at the edge.

    The typed payload is cached on the envelope, so `envelope.payload(Model)` in a
    handler returns the model validated here. `also_known` names types outside the
    public registry that the consumer handles itself (e.g. the simulated cluster's
    commands); their payloads are validated by the handler. Raises MalformedMessage.
    """
    from gpusched.contracts.envelope import Envelope
    from gpusched.contracts.messages import SCHEMAS

    envelope = Envelope.from_bytes(raw)
    max_age = stream_max_age(subject)
    clock = EdgeClock(now, max_clock_skew_s, max_age)
    try:
        clock.check(envelope.time)
    except ValueError as exc:
        raise MalformedMessage(f"{envelope.type}: time: {exc}") from exc
    schema = SCHEMAS.get(envelope.type)
    if schema is None:
        if envelope.type in also_known:
            check_subject(subject, envelope.type, None, envelope.correlation_id)
            return envelope
        raise MalformedMessage(f"unknown message type {envelope.type!r}")
    supported = SUPPORTED_VERSIONS.get(envelope.type, 1)
    if envelope.version > supported:
        raise MalformedMessage(
            f"{envelope.type} v{envelope.version}: this build reads up to v{supported}"
        )
    try:
        payload = schema.model_validate(envelope.data, context={"clock": clock})
    except ValidationError as exc:
        where, message = first_error(exc)
        raise MalformedMessage(
            f"{envelope.type} v{envelope.version}: invalid payload: {where}: {message}"
        ) from exc
    check_subject(subject, envelope.type, payload, envelope.correlation_id)
    envelope.keep_payload(payload)
    return envelope


def check_subject(
    subject: str, message_type: str, payload: object, correlation_id: str | None = None
) -> None:
    """The node, service or job a subject names is the one its payload is about.

    On a job's events subject the envelope's correlation id names the job too (the SDK
    sets it to the job id, and the checkpoint service reads the job from it when the
    payload has no job_id, as checkpoint.confirmed/failed have not): a job whose
    credentials let it publish only on its own events subject must not speak for
    another job by naming it there."""
    tokens = subject.split(".")
    expected: tuple[str, str] | None = None
    if len(tokens) == 4 and tokens[1] == "telemetry" and tokens[2] == "gpu":
        expected = ("node", tokens[3])
    elif len(tokens) == 5 and tokens[1] == "telemetry" and tokens[2] == "gpu":
        # As the TELEMETRY stream stores it: `<p>.telemetry.gpu.<partition>.<node>`.
        expected = ("node", tokens[4])
    elif len(tokens) == 4 and tokens[1] == "telemetry" and tokens[2] == "inference":
        expected = ("service", tokens[3])
    elif len(tokens) == 4 and tokens[1] == "jobs" and tokens[3] == "events":
        expected = ("job_id", tokens[2])
        if correlation_id is not None and correlation_id != tokens[2]:
            raise MalformedMessage(
                f"{message_type}: correlation id {correlation_id!r} does not match the "
                f"subject's job {tokens[2]!r}"
            )
    if expected is None:
        return
    field, value = expected
    said = getattr(payload, field, None)
    on_subject = said
    if field == "node" and isinstance(said, str) and has_node_token(said):
        on_subject = node_token(said)  # a dotted node name is written with `~` there
    if said is not None and on_subject != value:
        raise MalformedMessage(
            f"{message_type}: {field} {said!r} does not match the subject's {value!r}"
        )


# Asked for every message at the edge; a telemetry consumer sees one subject per node.
@functools.lru_cache(maxsize=65536)
def stream_max_age(subject: str) -> float | None:
    """The max age of the stream a subject is stored in (None: unknown or unbounded)."""
    prefix = subject.split(".", 1)[0]
    for pattern, max_age in _stream_ages(prefix):
        if _matches(pattern, subject):
            return max_age
    return None


@functools.lru_cache(maxsize=64)
def _stream_ages(prefix: str) -> tuple[tuple[str, float | None], ...]:
    """(subject pattern, max age) of every stream of a prefix; none for a bad prefix.
    Cached: it is asked for every message a consumer reads."""
    try:
        subjects = Subjects(prefix)
    except ValueError:
        return ()
    return tuple(
        (pattern, spec.max_age_s or None)
        for spec in subjects.streams()
        for pattern in spec.subjects
    )


def _matches(pattern: str, subject: str) -> bool:
    want = pattern.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)


M = TypeVar("M", bound=BaseModel)


class TypedReader(Generic[M]):
    """`read_message` for one high-volume message type, in one validation pass.

    The envelope and its payload are validated together by a model whose `data` is
    the payload's schema (about half the work of two passes, which matters for the
    telemetry of thousands of nodes). Whatever this pass refuses, or does not cover (an
    other type, a newer version), goes through `read_message`, so the errors and the
    verdicts are exactly those of the general edge. Returns None for a valid message
    of another type (the caller ignores it); raises MalformedMessage.
    """

    def __init__(self, message_type: str, schema: type[M]) -> None:
        from gpusched.contracts.envelope import Envelope

        fields: dict[str, Any] = {
            name: (info.annotation, info)
            for name, info in Envelope.model_fields.items()
            if name != "data"
        }
        self._type = message_type
        self._schema = schema
        self._model: type[BaseModel] = create_model(
            f"Typed{schema.__name__}Envelope",
            __config__=ConfigDict(frozen=True, extra="forbid"),
            data=(schema, ...),
            **fields,
        )

    def read(
        self,
        raw: bytes,
        subject: str,
        now: datetime,
        *,
        max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    ) -> M | None:
        clock = EdgeClock(now, max_clock_skew_s, stream_max_age(subject))
        try:
            typed: Any = self._model.model_validate_json(raw, context={"clock": clock})
            if typed.type == self._type and typed.version <= SUPPORTED_VERSIONS.get(self._type, 1):
                clock.check(typed.time)
                payload: M = typed.data
                check_subject(subject, self._type, payload, typed.correlation_id)
                return payload
        except (ValidationError, ValueError, MalformedMessage):
            pass
        envelope = read_message(raw, subject, now, max_clock_skew_s=max_clock_skew_s)
        if envelope.type != self._type:
            return None
        return envelope.payload(self._schema)


# --- the request/reply edge ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Invalid:
    """A request that failed validation: what to tell the caller, and which field."""

    field: str | None
    message: str

    def error(self) -> ApiError:
        from gpusched.contracts.messages import ApiError

        return ApiError(code=INVALID, message=self.message, field=self.field)


INVALID: Final = "invalid"


def parse_request(model: type[M], raw: bytes) -> M | Invalid:
    """A request body as its model, or why it is invalid (naming the field). Never
    raises for bad input: validation never becomes an `internal` error."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        where, message = first_error(exc)
        more = len(exc.errors()) - 1
        suffix = f" (and {more} more)" if more > 0 else ""
        return Invalid(
            field=None if where == "(body)" else where, message=f"{where}: {message}{suffix}"
        )
    except ValueError as exc:
        # Bytes that are not UTF-8 or not JSON at all.
        return Invalid(field=None, message=f"(body): {exc}"[:500])
    # Request models outside contracts (a service's own API) get the string rules too:
    # a NUL or a control character never reaches a store.
    problem = _unsafe_string(request, ())
    if problem is not None:
        path, message = problem
        where = ".".join(str(p) for p in path) or "(body)"
        return Invalid(field=where, message=f"{where}: {message}")
    return request


def _unsafe_string(
    value: Any, path: tuple[str | int, ...]
) -> tuple[tuple[str | int, ...], str] | None:
    if isinstance(value, str):
        try:
            check_text(value, max_length=REQUEST_STRING_MAX, multiline=True)
        except ValueError as exc:
            return path, str(exc)
    elif isinstance(value, BaseModel):
        for name, item in value:
            found = _unsafe_string(item, (*path, name))
            if found is not None:
                return found
    elif isinstance(value, Mapping):
        for key, item in value.items():
            found = _unsafe_string(item, (*path, str(key)))
            if found is not None:
                return found
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = _unsafe_string(item, (*path, i))
            if found is not None:
                return found
    return None


def first_error(exc: ValidationError) -> tuple[str, str]:
    """The dotted path and message of the first error (messages kept short)."""
    err = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "(body)"
    message = str(err.get("msg", "invalid"))
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    return where, message[:300]
