"""dcgm-exporter text -> per-node GPU samples: pure parsing, no I/O, no clock.

Units: DCGM_FI_DEV_GPU_UTIL is 0-100 percent (a reading carries 0..1), framebuffer
in MiB (total = used + free), temperature in C, power in W. The `gpu` label is the
GPU index; the node is the target's node when it names one, else the `Hostname` label.

MIG: an instance carries GPU_I_ID/GPU_I_PROFILE beside its parent's `gpu` label. A
parent GPU's own series win when present. Otherwise its instances roll up onto it:
framebuffer used and free are summed (each instance owns its slice of memory),
utilization is the mean of the instances' weighted by their compute slices (the N of
an `Ng.XXgb` profile; unpartitioned capacity is not counted as idle, as a silent GPU
is not), temperature and power (device-wide) take the highest value.

A series whose value is NaN, infinite or negative is refused (counted), and a GPU
left without utilization or memory is refused too; the node's other GPUs still go.

Parsing: prometheus-client's text parser is the reference, but it reads label values
a character at a time (about 4 ms for one 8-GPU page, 4 s of CPU for 1,000 nodes).
dcgm-exporter prints plain lines (`name{label="value",...} number`, no escapes, no
timestamps), so a page made only of such lines is read with a strict pattern that
gives the same series; any other page goes to the reference parser whole, so its
rules (escapes, timestamps, counters, duplicate labels) apply unchanged.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from gpusched.contracts.messages import GpuReading, GpuSample

__all__ = [
    "METRICS",
    "Parsed",
    "Series",
    "parse_exporter_text",
    "reference_parse",
    "samples_from_series",
]

UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
TEMP = "DCGM_FI_DEV_GPU_TEMP"
POWER = "DCGM_FI_DEV_POWER_USAGE"
METRICS: tuple[str, ...] = (UTIL, FB_USED, FB_FREE, TEMP, POWER)
_PROFILE_SLICES = re.compile(r"^(\d+)g\.")


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    labels: Mapping[str, str]
    value: float


@dataclass
class Parsed:
    samples: list[GpuSample] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=lambda: defaultdict(int))


_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL = r'[a-zA-Z_][a-zA-Z0-9_]*="[^"\\]*"'
_NUMBER = r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|[-+]?Inf|NaN"
_PLAIN_SAMPLE = re.compile(rf"({_NAME})\{{((?:{_LABEL},)*(?:{_LABEL},?)?)\}} ({_NUMBER})")
_PLAIN_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"\\]*)"')
# A counter (or any other type) makes the reference rename or regroup the samples.
_PLAIN_COMMENT = re.compile(rf"# (?:HELP {_NAME} [^\"\\\\]*|TYPE {_NAME} (?:gauge|untyped))")


# Only the five metrics are parsed: a real exporter prints dozens more per GPU.
_WANTED = METRICS + tuple(f"# {kind} {m}" for kind in ("HELP", "TYPE") for m in METRICS)


def _wanted_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(_WANTED)]


def _plain_series(lines: list[str]) -> list[Series] | None:
    """The series of a page of plain lines only, else None (for the reference)."""
    series = []
    for line in lines:
        if line.startswith("#"):
            if _PLAIN_COMMENT.fullmatch(line) is None:
                return None
            continue
        match = _PLAIN_SAMPLE.fullmatch(line)
        if match is None:
            return None
        name, body, value = match.groups()
        pairs = _PLAIN_LABEL.findall(body)
        labels = dict(pairs)
        if len(labels) != len(pairs) or "__name__" in labels:
            return None  # the reference refuses these: let it say why
        if name in METRICS:
            series.append(Series(name, labels, float(value)))
    return series


def reference_parse(text: str) -> list[Series]:
    """The five DCGM series as prometheus-client's parser reads them."""
    return _reference(_wanted_lines(text))


def _reference(lines: list[str]) -> list[Series]:
    return [
        Series(s.name, s.labels, s.value)
        for family in text_string_to_metric_families("\n".join(lines) + "\n")
        for s in family.samples
        if s.name in METRICS
    ]


def parse_exporter_text(text: str) -> list[Series]:
    """The five DCGM series of one exporter page (raises ValueError if unparsable)."""
    lines = _wanted_lines(text)
    plain = _plain_series(lines)
    return plain if plain is not None else _reference(lines)


@dataclass
class _Gpu:
    parent: dict[str, float] = field(default_factory=dict)
    instances: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))
    weights: dict[str, int] = field(default_factory=dict)


def _rollup(gpu: _Gpu) -> dict[str, float]:
    values = dict(gpu.parent)
    if not gpu.instances:
        return values
    inst = gpu.instances
    for metric in (FB_USED, FB_FREE):
        if metric not in values and all(metric in v for v in inst.values()):
            values[metric] = sum(v[metric] for v in inst.values())
    if UTIL not in values:
        weighted = [(gpu.weights[i], v[UTIL]) for i, v in inst.items() if UTIL in v]
        if weighted:
            values[UTIL] = sum(w * u for w, u in weighted) / sum(w for w, _ in weighted)
    for metric in (TEMP, POWER):
        found = [v[metric] for v in inst.values() if metric in v]
        if metric not in values and found:
            values[metric] = max(found)
    return values


def samples_from_series(
    series: Iterable[Series], at: datetime, node: str | None = None, node_label: str = "Hostname"
) -> Parsed:
    """Group series per node and GPU, roll MIG instances up, validate each reading."""
    parsed = Parsed()
    nodes: dict[str, dict[int, _Gpu]] = defaultdict(lambda: defaultdict(_Gpu))
    for s in series:
        if not math.isfinite(s.value) or s.value < 0:
            parsed.refused["bad_value"] += 1
            continue
        owner = node or s.labels.get(node_label)
        gpu_label = s.labels.get("gpu", "")
        if not owner or not gpu_label.isdigit():
            parsed.refused["unlabelled"] += 1
            continue
        gpu = nodes[owner][int(gpu_label)]
        instance = s.labels.get("GPU_I_ID")
        if instance:
            match = _PROFILE_SLICES.match(s.labels.get("GPU_I_PROFILE", ""))
            gpu.weights[instance] = int(match.group(1)) if match else 1
            gpu.instances[instance][s.name] = s.value
        else:
            gpu.parent[s.name] = s.value
    for name, gpus in sorted(nodes.items()):
        readings = []
        for index, gpu in sorted(gpus.items()):
            v = _rollup(gpu)
            try:
                readings.append(
                    GpuReading(
                        index=index,
                        util=v[UTIL] / 100.0,
                        mem_used_mib=round(v[FB_USED]),
                        mem_total_mib=round(v[FB_USED] + v[FB_FREE]),
                        temp_c=v.get(TEMP),
                        power_w=v.get(POWER),
                    )
                )
            except (KeyError, ValidationError):
                parsed.refused["bad_reading"] += 1
        if not readings:
            continue
        try:
            parsed.samples.append(GpuSample(node=name, time=at, gpus=readings))
        except ValidationError:
            parsed.refused["bad_node"] += len(readings)
    return parsed
