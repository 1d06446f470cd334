"""GPU sharing rules without I/O: MIG profiles and layouts, overcommit, the hourly
limit on layout changes, and the time-of-day modes."""

from __future__ import annotations

from datetime import UTC, datetime, time, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.domain.sharing import (
    COMPUTE_SLICES,
    MEMORY_SLICES,
    MIG_PROFILES,
    GpuShare,
    MigMode,
    ModeSchedule,
    Overcommit,
    ShareAsk,
    SharedGpu,
    SharingError,
    Tenant,
    best_fraction,
    can_change_layout,
    fill_layout,
    layout_valid,
    profile,
    smallest_profile,
    target_layout,
)

GIB = 1024
A100 = "A100-80GB"
T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)


def test_a_15_gib_replica_gets_the_smallest_profile_that_holds_it_2g_20gb() -> None:
    chosen = smallest_profile(A100, 15)
    assert chosen is not None
    assert chosen.name == "2g.20gb"
    assert (chosen.compute, chosen.memory_slices) == (2, 2)


def test_profiles_follow_each_models_memory_unit() -> None:
    assert [p.name for p in MIG_PROFILES["A100-80GB"]] == [
        "1g.10gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb",
    ]  # fmt: skip
    assert [p.name for p in MIG_PROFILES["A100-40GB"]] == [
        "1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb",
    ]  # fmt: skip
    assert smallest_profile("A100-40GB", 15) == profile("A100-40GB", "3g.20gb")
    assert smallest_profile("H100-80GB", 10) == profile("H100-80GB", "1g.10gb")


def test_no_profile_fits_more_memory_than_the_gpu_or_a_model_without_mig() -> None:
    assert smallest_profile(A100, 81) is None
    assert smallest_profile("T4", 4) is None
    with pytest.raises(SharingError, match="no MIG profile"):
        profile(A100, "1g.5gb")


def test_a_layout_is_valid_within_7_compute_and_8_memory_slices() -> None:
    assert layout_valid(A100, ["1g.10gb"] * 7)
    assert layout_valid(A100, ["3g.40gb", "4g.40gb"])
    assert layout_valid(A100, ["7g.80gb"])
    assert not layout_valid(A100, ["1g.10gb"] * 8)  # 8 compute slices
    assert not layout_valid(A100, ["4g.40gb", "4g.40gb"])  # 8 compute slices
    assert not layout_valid(A100, ["3g.40gb", "3g.40gb", "1g.10gb"])  # 9 memory slices
    assert not layout_valid(A100, ["9g.90gb"])


@given(
    model=st.sampled_from(sorted(MIG_PROFILES)),
    position=st.integers(min_value=0, max_value=4),
)
def test_a_filled_layout_is_valid_and_holds_the_wanted_profile(model: str, position: int) -> None:
    wanted = MIG_PROFILES[model][position]
    layout = fill_layout(model, wanted)
    assert wanted.name in layout
    assert layout_valid(model, layout)
    chosen = [profile(model, name) for name in layout]
    # Nothing more fits: the change serves as many replicas as it can.
    smallest = MIG_PROFILES[model][0]
    assert (
        sum(p.compute for p in chosen) + smallest.compute > COMPUTE_SLICES
        or sum(p.memory_slices for p in chosen) + smallest.memory_slices > MEMORY_SLICES
    )


def test_a_2g_slice_layout_is_three_of_them_and_a_1g() -> None:
    assert fill_layout(A100, profile(A100, "2g.20gb")) == (
        "2g.20gb", "2g.20gb", "2g.20gb", "1g.10gb",
    )  # fmt: skip


def _tenant(name: str, milli: int, memory_gib: int, training: bool = False) -> Tenant:
    return Tenant(name, training, GpuShare(milli, memory_gib * GIB))


def test_inference_tenants_may_overcommit_memory_by_1_2_and_training_not_at_all() -> None:
    gpu = SharedGpu(80 * GIB, tenants=(_tenant("a", 300, 50),))
    factors = Overcommit()
    inference = GpuShare(300, 40 * GIB)  # 90 GiB of 80: within 96
    assert gpu.fits_fraction(inference, training=False, overcommit=factors)
    assert not gpu.fits_fraction(inference, training=True, overcommit=factors)
    with_training = SharedGpu(80 * GIB, tenants=(_tenant("t", 300, 50, training=True),))
    assert not with_training.fits_fraction(inference, training=False, overcommit=factors)
    assert not gpu.fits_fraction(GpuShare(300, 47 * GIB), training=False, overcommit=factors)


def test_the_overcommit_factors_are_settings() -> None:
    gpu = SharedGpu(80 * GIB, tenants=(_tenant("a", 300, 50),))
    strict = Overcommit(inference=1.0, training=1.0)
    assert not gpu.fits_fraction(GpuShare(300, 40 * GIB), False, strict)
    with pytest.raises(SharingError):
        Overcommit(inference=0.9)


def test_compute_never_passes_1000_milli() -> None:
    gpu = SharedGpu(80 * GIB, tenants=(_tenant("a", 600, 1),))
    assert gpu.fits_fraction(GpuShare(400, GIB), False, Overcommit())
    assert not gpu.fits_fraction(GpuShare(401, GIB), False, Overcommit())


def test_best_fit_picks_the_shared_gpu_left_with_least_compute() -> None:
    roomy = SharedGpu(80 * GIB, tenants=(_tenant("a", 200, 10),))
    tight = SharedGpu(80 * GIB, tenants=(_tenant("b", 600, 10),))
    full = SharedGpu(80 * GIB, tenants=(_tenant("c", 900, 10),))
    chosen = best_fraction(
        [("roomy", roomy), ("tight", tight), ("full", full)],
        GpuShare(300, 10 * GIB),
        False,
        Overcommit(),
    )
    assert chosen == "tight"


def test_a_fractions_memory_defaults_to_its_share_of_the_gpu() -> None:
    assert ShareAsk(250).fraction_for(80 * GIB) == GpuShare(250, 20 * GIB)
    assert ShareAsk(250, 30 * GIB).fraction_for(80 * GIB) == GpuShare(250, 30 * GIB)
    with pytest.raises(SharingError):
        ShareAsk(1000)
    with pytest.raises(SharingError):
        ShareAsk(None)  # a MIG slice is chosen by memory


def test_a_layout_changes_at_most_once_per_interval() -> None:
    hour = timedelta(hours=1)
    assert can_change_layout(None, T0, hour)
    assert not can_change_layout(T0, T0 + timedelta(minutes=59), hour)
    assert can_change_layout(T0, T0 + hour, hour)


@pytest.mark.parametrize(
    ("clock", "mode"),
    [
        (time(7, 59), MigMode.NIGHT),
        (time(8, 0), MigMode.DAY),
        (time(19, 59), MigMode.DAY),
        (time(20, 0), MigMode.NIGHT),
        (time(3, 0), MigMode.NIGHT),
    ],
)
def test_the_day_mode_runs_from_its_start_to_its_end(clock: time, mode: MigMode) -> None:
    schedule = ModeSchedule(time(8, 0), time(20, 0))
    assert schedule.mode_at(datetime.combine(T0.date(), clock, tzinfo=UTC)) is mode


def test_a_day_window_may_wrap_past_midnight() -> None:
    schedule = ModeSchedule(time(22, 0), time(6, 0))
    assert schedule.mode_at(datetime(2026, 3, 2, 23, 0, tzinfo=UTC)) is MigMode.DAY
    assert schedule.mode_at(datetime(2026, 3, 2, 5, 0, tzinfo=UTC)) is MigMode.DAY
    assert schedule.mode_at(datetime(2026, 3, 2, 12, 0, tzinfo=UTC)) is MigMode.NIGHT


def test_day_mode_wants_all_smallest_slices_and_night_mode_whole_gpus() -> None:
    assert target_layout(A100, MigMode.DAY) == ("1g.10gb",) * 7
    assert target_layout(A100, MigMode.NIGHT) == ()
    assert target_layout("T4", MigMode.DAY) == ()
