"""The inference demand curve: how many GPUs' worth of serving work arrives, over time.

Demand is in GPUs of work, the unit of the simulated cluster (``simcluster.load``):
spread over the GPUs that serve inference it gives their utilization, and through the
latency model their P99. The curve is a diurnal cycle, surges on top, and a little
noise, all drawn from one seed, piecewise constant per step. Pure: no clock, no I/O.

The shape, at step ``t`` (seconds since the replay's start, which is midnight):
``level(t) = peak x (trough + (1 - trough) x (1 - cos(2 pi (hour - peak_hour + 12) / 24)) / 2)``
so the level is ``peak`` at ``peak_hour`` and ``peak x trough`` twelve hours away; a
surge multiplies it by ``1 + amplitude`` while it lasts (ramping up and down); noise
multiplies the result by ``1 + N(0, noise)``, never below zero.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DemandCurve", "DemandParams", "Surge", "daily_peaks", "percentile"]

DAY_S = 86_400.0


@dataclass(frozen=True, slots=True)
class DemandParams:
    peak_gpus: float
    # Night over day: user-facing services typically serve 2-3x less at night.
    trough: float = 0.4
    peak_hour: float = 14.0
    # Surges: a Poisson number per day; each multiplies the level by 1 + amplitude.
    surges_per_day: float = 1.0
    surge_amplitude: tuple[float, float] = (0.2, 0.6)
    surge_minutes: tuple[float, float] = (15.0, 60.0)
    surge_ramp_minutes: float = 5.0
    noise: float = 0.03
    step_s: float = 60.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.peak_gpus) and self.peak_gpus >= 0):
            raise ValueError(f"peak_gpus must be a finite number >= 0, got {self.peak_gpus}")
        if not 0 <= self.trough <= 1:
            raise ValueError(f"trough must be within 0..1, got {self.trough}")
        if not (math.isfinite(self.step_s) and self.step_s > 0):
            raise ValueError(f"step_s must be > 0, got {self.step_s}")
        if self.surges_per_day < 0 or self.noise < 0:
            raise ValueError("surges_per_day and noise must not be negative")
        low, high = self.surge_amplitude
        if not 0 <= low <= high:
            raise ValueError(f"surge_amplitude must be 0 <= low <= high, got {low}, {high}")
        shortest, longest = self.surge_minutes
        if not 0 < shortest <= longest:
            raise ValueError(f"surge_minutes must be 0 < low <= high, got {shortest}, {longest}")

    def describe(self) -> dict[str, object]:
        return {
            "peak_gpus": round(self.peak_gpus, 3),
            "trough": self.trough,
            "peak_hour": self.peak_hour,
            "surges_per_day": self.surges_per_day,
            "surge_amplitude": list(self.surge_amplitude),
            "surge_minutes": list(self.surge_minutes),
            "surge_ramp_minutes": self.surge_ramp_minutes,
            "noise": self.noise,
            "step_s": self.step_s,
        }


@dataclass(frozen=True, slots=True)
class Surge:
    start_s: float
    minutes: float
    amplitude: float


class DemandCurve:
    """The curve over ``[0, horizon_s)``, one value per step."""

    def __init__(self, params: DemandParams, horizon_s: float, seed: int) -> None:
        if not (math.isfinite(horizon_s) and horizon_s > 0):
            raise ValueError(f"horizon_s must be > 0, got {horizon_s}")
        self.params = params
        rng = random.Random(seed)
        steps = max(1, math.ceil(horizon_s / params.step_s))
        self.surges = _surges(params, horizon_s, rng)
        surge_factor = _surge_factors(params, self.surges, steps)
        values: list[float] = []
        for k in range(steps):
            level = diurnal(params, k * params.step_s) * surge_factor[k]
            if params.noise:
                level *= 1 + rng.gauss(0, params.noise)
            values.append(max(0.0, level))
        self.values: tuple[float, ...] = tuple(values)

    @classmethod
    def of(cls, values: Sequence[float], step_s: float) -> DemandCurve:
        """A curve given step by step (a measured history, a test's phases)."""
        if not values or any(not (math.isfinite(v) and v >= 0) for v in values):
            raise ValueError("a demand curve needs finite values >= 0")
        curve = cls.__new__(cls)
        curve.params = DemandParams(peak_gpus=max(values), surges_per_day=0, noise=0, step_s=step_s)
        curve.surges = ()
        curve.values = tuple(values)
        return curve

    @property
    def step_s(self) -> float:
        return self.params.step_s

    def at(self, t: float) -> float:
        """Demand at ``t`` seconds (the last step's value past the horizon)."""
        k = min(max(int(t // self.params.step_s), 0), len(self.values) - 1)
        return self.values[k]

    def change_times(self) -> list[float]:
        return [k * self.params.step_s for k in range(len(self.values))]


def diurnal(params: DemandParams, t: float) -> float:
    hour = (t % DAY_S) / 3600.0
    phase = 2 * math.pi * (hour - params.peak_hour + 12.0) / 24.0
    shape = (1 - math.cos(phase)) / 2  # 1 at peak_hour, 0 twelve hours away
    return params.peak_gpus * (params.trough + (1 - params.trough) * shape)


def _surges(params: DemandParams, horizon_s: float, rng: random.Random) -> tuple[Surge, ...]:
    if params.surges_per_day <= 0:
        return ()
    rate = params.surges_per_day / DAY_S
    surges: list[Surge] = []
    t = rng.expovariate(rate)
    while t < horizon_s:
        surges.append(
            Surge(t, rng.uniform(*params.surge_minutes), rng.uniform(*params.surge_amplitude))
        )
        t += rng.expovariate(rate)
    return tuple(surges)


def _surge_factors(params: DemandParams, surges: Sequence[Surge], steps: int) -> list[float]:
    factors = [1.0] * steps
    ramp = params.surge_ramp_minutes * 60.0
    for surge in surges:
        end = surge.start_s + surge.minutes * 60.0
        first = int(surge.start_s // params.step_s)
        last = min(steps - 1, int((end + ramp) // params.step_s))
        for k in range(first, last + 1):
            t = k * params.step_s
            if t < surge.start_s + ramp:
                weight = max(0.0, (t - surge.start_s) / ramp) if ramp else 1.0
            elif t <= end:
                weight = 1.0
            else:
                weight = max(0.0, 1 - (t - end) / ramp) if ramp else 0.0
            factors[k] = max(factors[k], 1 + surge.amplitude * weight)
    return factors


def daily_peaks(curve: DemandCurve) -> list[float]:
    """The highest demand of each whole day of the curve."""
    per_day = max(1, int(DAY_S // curve.step_s))
    return [
        max(curve.values[start : start + per_day])
        for start in range(0, len(curve.values) - per_day + 1, per_day)
    ]


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]
