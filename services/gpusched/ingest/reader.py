"""The `gpu.sample` edge in one fast pass, with the verdicts of contracts.validation.

The telemetry of thousands of nodes is ingest's whole load, and pydantic's validation of
an 8-GPU sample (ten model instances, a dozen Python validators) costs several times
what decoding it does. Here msgspec decodes the envelope straight into bounded structs
and a few lines of Python check the rest of the edge rules (docs/developing.md,
"Validation at the edge"). This pass only ever *accepts*: whatever it does not accept
for certain (a refusal, or a form it does not cover: a non-ASCII string, a time
written in another format, another type or version) goes through the general
`TypedReader`, so every refusal and its error are exactly the general edge's, and every
sample accepted here is one the general edge accepts with the same values
(tests/unit/test_ingest_reader.py checks that against hostile input).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Final

import msgspec
from msgspec import Meta, Struct

from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.messages import GpuSample, T
from gpusched.contracts.subjects import node_token
from gpusched.contracts.validation import (
    DEFAULT_MAX_CLOCK_SKEW_S,
    ID_MAX,
    MAX_GPUS,
    MAX_MIB,
    EdgeClock,
    TypedReader,
    check_subject,
    check_text,
    stream_max_age,
)

__all__ = ["SampleReader", "SampleView"]


@dataclass(frozen=True, slots=True)
class SampleView:
    """What the fold uses of a valid sample: the node, its time, (GPU index, util), and
    (GPU index, memory used, memory total) for the memory gauges."""

    node: str
    time: datetime
    readings: tuple[tuple[int, float], ...]
    memory: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def of(cls, sample: GpuSample) -> SampleView:
        return cls(
            sample.node,
            sample.time,
            tuple((g.index, g.util) for g in sample.gpus),
            tuple((g.index, g.mem_used_mib, g.mem_total_mib) for g in sample.gpus),
        )


# The bounds of messages.GpuReading / GpuSample / Envelope; the rest is checked below.
# Times are read as text: only one strict form is taken here (see _TIME).
class _Reading(Struct):
    index: Annotated[int, Meta(ge=0, lt=MAX_GPUS)]
    util: Annotated[float, Meta(ge=0.0, le=1.0)]
    mem_used_mib: Annotated[int, Meta(ge=0, le=MAX_MIB)]
    mem_total_mib: Annotated[int, Meta(gt=0, le=MAX_MIB)]
    temp_c: Annotated[float, Meta(ge=-273.0, le=1000.0)] | None = None
    power_w: Annotated[float, Meta(ge=0.0, le=10.0**6)] | None = None


class _Data(Struct):
    node: Annotated[str, Meta(min_length=1, max_length=ID_MAX)]
    time: str
    gpus: Annotated[list[_Reading], Meta(max_length=MAX_GPUS)]


class _Envelope(Struct, forbid_unknown_fields=True):
    id: Annotated[str, Meta(min_length=1, max_length=128)]
    type: str
    source: Annotated[str, Meta(min_length=1, max_length=64)]
    time: str
    data: _Data
    version: int = 1
    correlation_id: Annotated[str, Meta(min_length=1, max_length=ID_MAX)] | None = None
    causation_id: Annotated[str, Meta(min_length=1, max_length=ID_MAX)] | None = None


# RFC 3339 with a T, at most microseconds and an explicit zone: read alike by pydantic
# and datetime.fromisoformat. Any other form is left to the general edge.
_TIME: Final = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d{1,6})?(?:Z|[+-]\d{2}:\d{2})")
_DECODER: Final = msgspec.json.Decoder(_Envelope)


class SampleReader:
    """`TypedReader(T.GPU_SAMPLE, GpuSample)` that answers `SampleView`s, mostly
    without pydantic. Returns None for a valid message of another type; raises
    MalformedMessage for an invalid one (the general edge's error)."""

    def __init__(self) -> None:
        self._general = TypedReader(T.GPU_SAMPLE, GpuSample)

    def read(
        self,
        raw: bytes,
        subject: str,
        now: datetime,
        *,
        max_clock_skew_s: float = DEFAULT_MAX_CLOCK_SKEW_S,
    ) -> SampleView | None:
        clock = EdgeClock(now, max_clock_skew_s, stream_max_age(subject))
        try:
            view = _fast(raw, subject, clock)
        except (msgspec.ValidationError, msgspec.DecodeError, ValueError, MalformedMessage):
            view = None
        if view is not None:
            return view
        sample = self._general.read(raw, subject, now, max_clock_skew_s=max_clock_skew_s)
        return None if sample is None else SampleView.of(sample)


def _fast(raw: bytes, subject: str, clock: EdgeClock) -> SampleView | None:
    """The view if every edge rule holds for certain; None (or ValueError) otherwise."""
    envelope = _DECODER.decode(raw)
    data = envelope.data
    if envelope.type != T.GPU_SAMPLE or envelope.version != 1:
        return None
    texts = [envelope.id, envelope.source, data.node]
    if envelope.correlation_id is not None:
        texts.append(envelope.correlation_id)
    if envelope.causation_id is not None:
        texts.append(envelope.causation_id)
    for text in texts:
        if not text.isascii():
            return None
        check_text(text, max_length=ID_MAX)
    node_token(data.node)
    clock.check(_time(envelope.time))
    at = clock.check(_time(data.time))
    readings = []
    memory = []
    seen = set()
    for gpu in data.gpus:
        if gpu.mem_used_mib > gpu.mem_total_mib or gpu.index in seen:
            return None
        seen.add(gpu.index)
        readings.append((gpu.index, gpu.util))
        memory.append((gpu.index, gpu.mem_used_mib, gpu.mem_total_mib))
    view = SampleView(data.node, at, tuple(readings), tuple(memory))
    check_subject(subject, T.GPU_SAMPLE, view)
    return view


def _time(text: str) -> datetime:
    if _TIME.fullmatch(text) is None:
        raise ValueError("a time in a form left to the general edge")
    return datetime.fromisoformat(text)
