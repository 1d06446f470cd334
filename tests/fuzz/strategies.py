"""Hypothesis strategies for the public schemas, and the hostile values thrown at them.

Every strategy here draws an input that the edge must refuse: a valid message or
request with one field replaced by a value that is wrong for that field (NaN,
Infinity, huge, negative, a bool or a string for a number, control, bidi and NUL
characters, a 1 MB string, a far-future or far-past time, ...), or an envelope-level
fault (unknown type, future version, a subject naming another node or job).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

MEGABYTE = "x" * 1_000_000
# Examples per schema: a few dozen locally; CI may raise it (GPUSCHED_FUZZ_EXAMPLES=200).
EXAMPLES = int(os.environ.get("GPUSCHED_FUZZ_EXAMPLES", "30"))

# Wrong for any number field of the public schemas (all are bounded and most are >= 0
# or >= 1; a bool or a string never counts as a number).
HOSTILE_NUMBERS: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    10**18,
    -1,
    -(10**18),
    True,
    False,
    "8",
    "1e3",
    MEGABYTE,
    [1],
    {"n": 1},
]
# Wrong for any string field: characters no name may hold, sizes no field allows,
# and values of another type.
HOSTILE_STRINGS: list[Any] = [
    "\x00",
    "job\x00id",
    "\u202eevil",
    "a\u2066b",
    "\x07bell",
    "\x1b[31mred",
    "line\x85break",
    MEGABYTE,
    12345,
    1.5,
    True,
    [],
    {"s": "x"},
]
HOSTILE_FLAGS: list[Any] = ["yes", "true", 1, 0, "", None, [True]]
HOSTILE_ENUMS: list[Any] = ["quantum", "", 7, None, "\x00", MEGABYTE]


def hostile_times(now: datetime) -> list[Any]:
    return [
        "9999-12-31T23:59:59Z",
        (now + timedelta(days=1)).isoformat(),
        "1970-01-01T00:00:00Z",
        (now - timedelta(days=2)).isoformat(),
        (now.replace(tzinfo=None)).isoformat(),  # no time zone
        "not a time",
        "",
        1e300,
        math.nan,
        True,
        MEGABYTE,
    ]


@dataclass(frozen=True)
class Mutation:
    """A valid document with the value at `path` replaced by `value`."""

    path: str
    value: Any

    def apply(self, document: dict[str, Any]) -> dict[str, Any]:
        out = copy.deepcopy(document)
        *parents, last = self.path.split(".")
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if isinstance(node, list):
            node[int(last)] = self.value
        else:
            node[last] = self.value
        return out

    def __repr__(self) -> str:
        shown = repr(self.value)
        return f"{self.path}={shown[:40]}{'...' if len(shown) > 40 else ''}"


def mutations(fields: dict[str, list[Any]]) -> st.SearchStrategy[Mutation]:
    """One field of `fields` (path -> the hostile values for it) with one hostile value."""
    return st.sampled_from(sorted(fields)).flatmap(
        lambda path: st.sampled_from(fields[path]).map(lambda value: Mutation(path, value))
    )


def to_json(document: Any) -> bytes:
    # NaN and Infinity leave as the bare literals a careless producer writes.
    return json.dumps(document, allow_nan=True).encode()


def draw(strategy: st.SearchStrategy[Any], examples: int) -> list[Any]:
    """`examples` values of `strategy`, the same on every run: hypothesis generates them
    (derandomized, no example database) and the async test plays them against the
    running service."""
    drawn: list[Any] = []

    @settings(
        max_examples=examples,
        derandomize=True,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
        deadline=None,
    )
    @given(strategy)
    def collect(value: Any) -> None:
        drawn.append(value)

    collect()
    return drawn


# --- the schemas ------------------------------------------------------------------------
SUBMIT: dict[str, Any] = {
    "name": "fuzz",
    "team": "vision",
    "gpus": {"count": 1},
    "workload": {"steps": 10, "step_seconds": 0.1, "argv": ["python", "train.py"]},
}
SUBMIT_FIELDS: dict[str, list[Any]] = {
    "name": [*HOSTILE_STRINGS, ""],
    "team": [*HOSTILE_STRINGS, "", "two words"],
    "idempotency_key": HOSTILE_STRINGS,
    "kind": HOSTILE_ENUMS,
    "priority_class": HOSTILE_ENUMS,
    "gang": HOSTILE_FLAGS,
    "checkpointable": HOSTILE_FLAGS,
    "estimated_checkpoint_s": HOSTILE_NUMBERS,
    "gpus": [None, 5, "two", [], MEGABYTE],
    # 0 is a job without GPUs: valid with host CPU or memory (see "host" below).
    "gpus.count": [*HOSTILE_NUMBERS, 1025, None],
    "gpus.model": HOSTILE_STRINGS,
    "gpus.models": [[], "T4", [None], ["x"] * 33, MEGABYTE, ["\x00"], ["\u202eevil"], [12345]],
    "gpus.memory_gib": [*HOSTILE_NUMBERS, 0],
    "gpus.milli": [*HOSTILE_NUMBERS, 0, 1001],
    "gpus.min_count": [*HOSTILE_NUMBERS, 0],
    "workload.steps": [*HOSTILE_NUMBERS, 0],
    "workload.step_seconds": [*HOSTILE_NUMBERS, 0],
    "workload.checkpoint_seconds": HOSTILE_NUMBERS,
    "workload.argv": [["x"] * 257, ["x" * 4000] * 17, [MEGABYTE], "python train.py", [1, 2]],
    "workload.argv.1": HOSTILE_STRINGS,
    "replicas": [{"min": 3, "max": 2}, {"min": 0}, {"max": 10**18}, {"min": math.nan}],
    "host": [5, "all", []],
    "host.cpu_milli": [*HOSTILE_NUMBERS, 10**9 + 1],
    "host.memory_mib": [*HOSTILE_NUMBERS, 2**30 + 1],
}


def gpu_sample(node: str, now: datetime) -> dict[str, Any]:
    return {
        "node": node,
        "time": now.isoformat(),
        "gpus": [
            {"index": 0, "util": 0.5, "mem_used_mib": 1000, "mem_total_mib": 81920},
            {"index": 1, "util": 0.25, "mem_used_mib": 10, "mem_total_mib": 81920,
             "temp_c": 50.0, "power_w": 300.0},
        ],
    }  # fmt: skip


def gpu_sample_fields(now: datetime, other_node: str) -> dict[str, list[Any]]:
    return {
        "node": [*HOSTILE_STRINGS, other_node, ""],
        "time": hostile_times(now),
        "gpus": [None, "all", [{"index": 0}], [None]],
        "gpus.0.index": [*HOSTILE_NUMBERS, 1, 1024, 10**9],  # 1: a duplicate index
        "gpus.0.util": [*HOSTILE_NUMBERS, 1.5],
        "gpus.0.mem_used_mib": [*HOSTILE_NUMBERS, 81921],  # 81921: above the total
        "gpus.0.mem_total_mib": [*HOSTILE_NUMBERS, 0, 999],  # 999: below used
        "gpus.1.temp_c": [math.nan, math.inf, -math.inf, 10**18, True, "hot"],
        "gpus.1.power_w": [math.nan, math.inf, -1, 10**18, True, "300"],
    }


def inference_stats(service: str, now: datetime) -> dict[str, Any]:
    return {
        "service": service,
        "time": now.isoformat(),
        "window_s": 10.0,
        "requests": 500,
        "queue_depth": 3,
        "p50_ms": 20.0,
        "p99_ms": 150.0,
    }


def inference_stats_fields(now: datetime, other_service: str) -> dict[str, list[Any]]:
    return {
        "service": [*HOSTILE_STRINGS, other_service],
        "time": hostile_times(now),
        "window_s": [*HOSTILE_NUMBERS, 0],
        "requests": HOSTILE_NUMBERS,
        "queue_depth": HOSTILE_NUMBERS,
        "p50_ms": HOSTILE_NUMBERS,
        "p99_ms": HOSTILE_NUMBERS,
    }


def job_events(
    job_id: str, other_job: str
) -> dict[str, tuple[dict[str, Any], dict[str, list[Any]]]]:
    """Per job event type: a valid payload and the hostile values of its fields."""
    return {
        "job.started": (
            {"job_id": job_id, "attempt": 1, "resumed_from": None},
            {
                "job_id": [*HOSTILE_STRINGS, other_job],
                "attempt": [*HOSTILE_NUMBERS, 0],
                "resumed_from": HOSTILE_STRINGS,
            },
        ),
        "job.progress": (
            {"step": 10, "loss": 0.5},
            {"step": HOSTILE_NUMBERS, "loss": [math.nan, math.inf, -math.inf, "\x00", MEGABYTE]},
        ),
        "checkpoint.confirmed": (
            {
                "request_id": None,
                "checkpoint_id": "c1",
                "step": 10,
                "uri": "file:///ckpt/c1",
                "bytes": 1024,
                "sha256": "0" * 64,
                "stage": "persisted",
            },
            {
                "checkpoint_id": [*HOSTILE_STRINGS, ""],
                "step": HOSTILE_NUMBERS,
                "uri": [*HOSTILE_STRINGS, ""],
                "bytes": HOSTILE_NUMBERS,
                "sha256": [*HOSTILE_STRINGS, "0" * 63, "Z" * 64],
                "stage": HOSTILE_ENUMS,
            },
        ),
        "checkpoint.failed": (
            {"request_id": "r1", "error": "disk full"},
            {"request_id": HOSTILE_STRINGS, "error": [*HOSTILE_STRINGS[:5], MEGABYTE, 5]},
        ),
        "job.completed": (
            {"job_id": job_id, "step": 10},
            {"job_id": [*HOSTILE_STRINGS, other_job], "step": HOSTILE_NUMBERS},
        ),
        "job.failed": (
            {"job_id": job_id, "error": "boom"},
            {"job_id": [*HOSTILE_STRINGS, other_job], "error": [MEGABYTE, 5, None, "\x00"]},
        ),
    }
