"""How busy a GPU looks: training load, inference load and its latency.

Inference is modelled as an M/M/1 queue per GPU-equivalent: `demand` (in GPUs worth
of work) spread over the GPUs serving it gives the utilization rho, and a request's
response time is exponential with mean service_ms / (1 - rho). That makes P99 rise
slowly until ~0.7 and steeply past 0.8, which is the shape the elastic controller's
thresholds (DESIGN §7) are tuned for.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

TRAINING_UTIL = 0.95
TRAINING_JITTER = 0.03

# ln(100) and ln(2): the 99th and 50th percentiles of an exponential distribution.
_P99_FACTOR = math.log(100.0)
_P50_FACTOR = math.log(2.0)


def training_util(node: str, index: int, tick: int) -> float:
    """A busy training GPU: ~0.95 with a small jitter that is the same on every run."""
    phase = (zlib.crc32(f"{node}/{index}".encode()) % 1000) / 1000.0 * 2 * math.pi
    util = TRAINING_UTIL + TRAINING_JITTER * math.sin(0.7 * tick + phase)
    return min(1.0, max(0.0, util))


def offered_load(demand_gpus: float, serving_gpus: int) -> float:
    """rho: demand over capacity, unclamped (above 1 the queue grows without bound)."""
    if serving_gpus <= 0:
        return math.inf if demand_gpus > 0 else 0.0
    return max(0.0, demand_gpus) / serving_gpus


def serving_util(demand_gpus: float, serving_gpus: int) -> float:
    """The utilization each serving GPU reports: busy at most all the time."""
    return min(1.0, offered_load(demand_gpus, serving_gpus))


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """One inference service: its per-request service time and per-GPU throughput."""

    service_ms: float = 6.5  # p99 ~100 ms at rho 0.7, ~150 ms at 0.8, ~300 ms at 0.9
    requests_per_gpu_s: float = 150.0
    max_latency_ms: float = 10_000.0  # what an overloaded (rho >= 1) queue is reported as
    max_rho: float = 0.999

    def _response_ms(self, rho: float, factor: float) -> float:
        if rho >= self.max_rho:
            return self.max_latency_ms
        return min(self.max_latency_ms, self.service_ms * factor / (1.0 - rho))

    def p99_ms(self, rho: float) -> float:
        return self._response_ms(rho, _P99_FACTOR)

    def p50_ms(self, rho: float) -> float:
        return self._response_ms(rho, _P50_FACTOR)

    def highest_rho(self, p99_ms: float) -> float:
        """The highest utilization whose p99 is within ``p99_ms`` (0 if none is)."""
        rho = 1.0 - self.service_ms * _P99_FACTOR / p99_ms if p99_ms > 0 else 0.0
        return min(max(rho, 0.0), self.max_rho)

    def queue_depth(self, rho: float, serving_gpus: int) -> int:
        """Mean requests in the system, rho / (1 - rho) per GPU; capped when overloaded."""
        capped = min(rho, self.max_rho)
        per_gpu = capped / (1.0 - capped)
        return max(0, round(per_gpu * max(serving_gpus, 1)))

    def requests(self, demand_gpus: float, serving_gpus: int, window_s: float) -> int:
        """Requests answered in the window: the offered load, up to the capacity."""
        served = min(max(0.0, demand_gpus), float(serving_gpus))
        return max(0, round(served * self.requests_per_gpu_s * window_s))


@dataclass(frozen=True, slots=True)
class InferenceLoad:
    """The stats one service reports for one window."""

    requests: int
    queue_depth: int
    p50_ms: float
    p99_ms: float
    util: float


def inference_load(
    demand_gpus: float, serving_gpus: int, window_s: float, model: LatencyModel | None = None
) -> InferenceLoad:
    m = model or LatencyModel()
    rho = offered_load(demand_gpus, serving_gpus)
    return InferenceLoad(
        requests=m.requests(demand_gpus, serving_gpus, window_s),
        queue_depth=m.queue_depth(rho, serving_gpus),
        p50_ms=m.p50_ms(rho),
        p99_ms=m.p99_ms(rho),
        util=serving_util(demand_gpus, serving_gpus),
    )
