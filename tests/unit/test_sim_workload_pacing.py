"""The virtual loop's pacing: how many steps come due at once, however short a step is."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.simcluster.training import VirtualLoop

TRILLION = 10**12


def test_no_step_is_due_before_its_time_and_one_is_due_exactly_at_it() -> None:
    loop = VirtualLoop(steps=100, step_seconds=0.25, checkpoint_seconds=0.0)
    assert loop.steps_due(0, -0.01) == 0
    assert loop.steps_due(0, 0.0) == 1


def test_a_late_clock_makes_every_whole_interval_since_due_at_once() -> None:
    loop = VirtualLoop(steps=100, step_seconds=0.25, checkpoint_seconds=0.0)
    # The step due at the deadline, then one per 0.25 s since.
    assert loop.steps_due(10, 0.2) == 1
    assert loop.steps_due(10, 0.25) == 2
    assert loop.steps_due(10, 1.0) == 5
    # Under time_scale the interval is wall-clock time: 0.5 s steps at 2x take 0.25 s.
    fast = VirtualLoop(steps=100, step_seconds=0.5, checkpoint_seconds=0.0, time_scale=2.0)
    assert fast.steps_due(10, 1.0) == 5


def test_the_steps_due_never_run_past_the_last_step() -> None:
    loop = VirtualLoop(steps=100, step_seconds=0.25, checkpoint_seconds=0.0)
    assert loop.steps_due(98, 60.0) == 2
    assert loop.steps_due(100, 60.0) == 0
    assert loop.steps_due(120, 60.0) == 0  # resumed from a checkpoint past the end


@pytest.mark.parametrize(
    ("step_seconds", "time_scale"),
    [(1e-300, 1.0), (1.0, 1e300), (5e-324, 1.0), (5e-324, 4.0)],
    ids=["tiny-step", "huge-scale", "subnormal-step", "interval-underflows-to-zero"],
)
def test_a_step_too_short_for_the_clock_makes_the_whole_run_due_and_still_has_a_progress_pace(
    step_seconds: float, time_scale: float
) -> None:
    loop = VirtualLoop(TRILLION, step_seconds, 0.5, time_scale)
    assert loop.steps_due(0, 1e-3) == TRILLION
    assert loop.steps_due(TRILLION - 5, 1e-3) == 5
    # Reported at the last step, never before: the run is over within the first report.
    assert loop.progress_every == TRILLION
    assert loop.reports_progress(TRILLION) and not loop.reports_progress(TRILLION - 1)


@given(
    steps=st.integers(min_value=1, max_value=TRILLION),
    step=st.integers(min_value=0, max_value=TRILLION),
    step_seconds=st.floats(min_value=5e-324, max_value=1e6),
    late_s=st.floats(min_value=-1e6, max_value=1e6),
)
def test_the_steps_due_are_a_count_within_what_is_left(
    steps: int, step: int, step_seconds: float, late_s: float
) -> None:
    loop = VirtualLoop(steps, step_seconds, 0.0)
    due = loop.steps_due(step, late_s)
    assert isinstance(due, int)
    assert 0 <= due <= max(0, steps - step)
    assert (due > 0) == (late_s >= 0 and step < steps)
