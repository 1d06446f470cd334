"""The controller's pure decisions around the elastic rules."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from gpusched.domain.elastic import (
    ElasticThresholds,
    PriorityClass,
    VictimCandidate,
    choose_victims,
)
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.preemption import handlers, policy, signals
from gpusched.preemption.signals import HeldSignals, SignalLimits

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LIMITS = policy.ControllerLimits(
    ElasticThresholds(),
    cooldown_s=60.0,
    max_reading_age_s=30.0,
    signals=SignalLimits(expand_hold_s=0.0, shrink_hold_s=0.0),
)
# Both conditions true since long ago: these tests are about what follows the windows.
HELD = HeldSignals(NOW, NOW - timedelta(hours=1), NOW - timedelta(hours=1))
LONG_AGO = NOW - timedelta(days=1)


def reading(inference_util: float, shared_util: float = 0.95) -> policy.PoolReading:
    return policy.PoolReading(
        time=NOW,
        inference=policy.PoolFigures(gpus=24, util=inference_util, reporting_gpus=24),
        shared=policy.PoolFigures(gpus=40, util=shared_util, reporting_gpus=40),
    )


def view(
    *, in_flight: bool, withdrawable: tuple[str, ...] = (), lent: int = 0
) -> policy.ControllerView:
    return policy.ControllerView(
        in_flight=in_flight,
        last_change_at=None,
        last_shortfall_at=None,
        reservations=(policy.LentReservation("r", lent, LONG_AGO),) if lent else (),
        shared_allocated_gpus=40,
        candidates=(),
        withdrawable=withdrawable,
    )


def test_evictions_in_flight_are_withdrawn_when_inference_falls_below_the_target() -> None:
    outcome = policy.decide(
        reading(0.5), HELD, view(in_flight=True, withdrawable=("r1", "r2")), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Withdraw)
    assert outcome.request_ids == ("r1", "r2")


def test_evictions_in_flight_are_kept_while_inference_is_still_above_the_target() -> None:
    outcome = policy.decide(
        reading(0.75), HELD, view(in_flight=True, withdrawable=("r1",)), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Hold)


def test_evictions_already_withdrawn_are_not_withdrawn_twice() -> None:
    outcome = policy.decide(reading(0.2), HELD, view(in_flight=True), LIMITS, NOW)
    assert isinstance(outcome, policy.Hold)


def test_a_stale_reading_never_withdraws() -> None:
    old = policy.PoolReading(
        time=NOW - timedelta(minutes=5),
        inference=policy.PoolFigures(gpus=24, util=0.1, reporting_gpus=24),
        shared=policy.PoolFigures(gpus=40, util=0.9, reporting_gpus=40),
    )
    outcome = policy.decide(old, HELD, view(in_flight=True, withdrawable=("r1",)), LIMITS, NOW)
    assert isinstance(outcome, policy.Hold)


def test_a_busy_shared_pool_blocks_a_shrink_under_the_default_gate() -> None:
    outcome = policy.decide(
        reading(0.1, shared_util=0.95), HELD, view(in_flight=False, lent=8), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Hold)
    assert "hysteresis" in outcome.reason


def test_a_quiet_shared_pool_lets_lent_gpus_go_back() -> None:
    outcome = policy.decide(
        reading(0.1, shared_util=0.3), HELD, view(in_flight=False, lent=8), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Shrink)
    assert outcome.gpus >= 1


# --- windows, min lend, rate limit, min runtime ------------------------------------------
WINDOWED = replace(
    LIMITS,
    signals=SignalLimits(expand_hold_s=30.0, shrink_hold_s=600.0, slo_ms={"chat": 100.0}),
    min_lend_s=900.0,
    min_runtime_s=1800.0,
    max_evictions_per_min=1,
)


def candidate(allocation_id: str, *, started: datetime, gpus: int = 8) -> VictimCandidate:
    return VictimCandidate(
        allocation_id, f"job-{allocation_id}", "research", PriorityClass.P2_OFFLINE, gpus,
        tuple(GpuRef(f"node-{allocation_id}", i) for i in range(gpus)), started, None, True,
        pool=Pool.SHARED,
    )  # fmt: skip


def busy_view(*candidates: VictimCandidate, recent: int = 0) -> policy.ControllerView:
    return replace(view(in_flight=False), candidates=candidates, recent_evictions=recent)


def held_since(*, expand: float | None = None, shrink: float | None = None) -> HeldSignals:
    def ago(s: float | None) -> datetime | None:
        return None if s is None else NOW - timedelta(seconds=s)

    return HeldSignals(NOW, ago(expand), ago(shrink))


def test_an_expansion_waits_until_its_condition_has_held_for_the_whole_window() -> None:
    v = busy_view(candidate("a", started=LONG_AGO))
    early = policy.decide(reading(0.95), held_since(expand=29), v, WINDOWED, NOW)
    assert isinstance(early, policy.Hold) and "held 29s of 30s" in early.reason
    ready = policy.decide(reading(0.95), held_since(expand=30), v, WINDOWED, NOW)
    assert isinstance(ready, policy.Expand) and "held 30s >= 30s" in ready.reason


def test_a_shrink_waits_for_its_ten_minute_window_and_then_for_the_min_lend() -> None:
    lent_recently = policy.LentReservation("r-new", 4, NOW - timedelta(minutes=5))
    lent_long_ago = policy.LentReservation("r-old", 4, LONG_AGO)
    v = replace(view(in_flight=False), reservations=(lent_recently, lent_long_ago))
    quiet = reading(0.05, shared_util=0.3)
    assert isinstance(policy.decide(quiet, held_since(shrink=599), v, WINDOWED, NOW), policy.Hold)
    outcome = policy.decide(quiet, held_since(shrink=600), v, WINDOWED, NOW)
    # floor((0.40 - 0.05) * 24) = 8 wanted; only the reservation lent > 15 min ago goes.
    assert isinstance(outcome, policy.Shrink)
    assert outcome.returns == (("r-old", 4),) and outcome.gpus == 4
    only_new = replace(v, reservations=(lent_recently,))
    held = policy.decide(quiet, held_since(shrink=600), only_new, WINDOWED, NOW)
    assert isinstance(held, policy.Hold) and "min lend" in held.reason


def test_a_job_inside_its_min_runtime_is_never_chosen_and_the_gap_is_a_shortfall() -> None:
    young = candidate("young", started=NOW - timedelta(minutes=29))
    outcome = policy.decide(reading(0.95), held_since(expand=60), busy_view(young), WINDOWED, NOW)
    assert isinstance(outcome, policy.Expand)
    assert outcome.choice.victims == () and outcome.shortfall > 0
    assert "min runtime" in dict(outcome.choice.reasons)["young"]


def test_the_eviction_rate_limit_defers_victims_without_raising_a_shortfall() -> None:
    old = [candidate(f"a{i}", started=LONG_AGO, gpus=2) for i in range(4)]
    # 0.95 on 24: ceil(0.95 * 24 / 0.7) - 24 = 9 GPUs; five 2-GPU victims, one allowed.
    outcome = policy.decide(reading(0.95), held_since(expand=60), busy_view(*old), WINDOWED, NOW)
    assert isinstance(outcome, policy.Expand)
    assert len(outcome.choice.victims) == 1 and outcome.shortfall == 1
    assert outcome.choice.deferred == 6
    spent = policy.decide(
        reading(0.95), held_since(expand=60), busy_view(*old, recent=1), WINDOWED, NOW
    )
    assert isinstance(spent, policy.Expand) and spent.choice.victims == ()


def test_a_p99_near_its_slo_expands_even_with_utilization_inside_the_band() -> None:
    slow = replace(reading(0.6), services=(policy.ServiceReading("chat", 85.0, 0),))
    outcome = policy.decide(
        slow, held_since(expand=60), busy_view(candidate("a", started=LONG_AGO)), WINDOWED, NOW
    )
    assert isinstance(outcome, policy.Expand)
    assert "chat P99 85 ms > 80% of its 100 ms SLO" in outcome.reason
    assert outcome.gpus >= 1


# --- signals held over windows --------------------------------------------------------------
def at(seconds: float, util: float, shared_util: float = 0.95) -> policy.PoolReading:
    return replace(reading(util, shared_util), time=NOW + timedelta(seconds=seconds))


def test_a_window_keeps_its_start_while_the_condition_holds_and_ends_on_one_lapse() -> None:
    th, lim = WINDOWED.thresholds, WINDOWED.signals
    held = signals.fold(HeldSignals(), at(0, 0.9), th, lim)
    held = signals.fold(held, at(5, 0.95), th, lim)
    assert held.expand_since == NOW
    held = signals.fold(held, at(10, 0.79), th, lim)
    assert held.expand_since is None and held.shrink_since is None


def test_a_reading_older_than_the_newest_changes_nothing() -> None:
    th, lim = WINDOWED.thresholds, WINDOWED.signals
    held = signals.fold(HeldSignals(), at(10, 0.9), th, lim)
    assert signals.fold(held, at(5, 0.1, shared_util=0.1), th, lim) == held


def test_a_reading_that_averages_the_pool_before_its_last_change_holds_nothing() -> None:
    # Lent GPUs just joined the pool: a reading whose window began before that still
    # averages the smaller pool, and would ask for the same GPUs a second time.
    th, lim = WINDOWED.thresholds, WINDOWED.signals
    changed = NOW + timedelta(seconds=20)
    straddling = replace(at(21, 0.95), window_s=1.5)
    held = signals.fold(HeldSignals(), straddling, th, lim, last_change_at=changed)
    assert held.expand_since is None and held.shrink_since is None
    assert held.reading_at == straddling.time
    after = replace(at(22, 0.95), window_s=1.5)
    held = signals.fold(held, after, th, lim, last_change_at=changed)
    assert held.expand_since == after.time
    # A window that was open when the pool changed does not carry over.
    held = signals.fold(HeldSignals(NOW, NOW, None), straddling, th, lim, changed)
    assert held.expand_since is None


def test_a_queue_deeper_than_its_limit_is_a_reason_to_expand() -> None:
    lim = SignalLimits(queue_above=100)
    deep = replace(reading(0.5), services=(policy.ServiceReading("chat", 10.0, 101),))
    assert signals.expand_causes(deep, WINDOWED.thresholds, lim) == ("chat queue 101 > 100",)
    assert signals.expand_causes(deep, WINDOWED.thresholds, SignalLimits()) == ()


def test_an_unknown_shared_pool_never_reads_as_idle_for_a_shrink() -> None:
    silent = replace(reading(0.1), shared=policy.PoolFigures(gpus=40, util=0.0, reporting_gpus=0))
    assert signals.shrink_cause(silent, WINDOWED.thresholds) is None


def test_the_audit_lists_every_ranked_candidate_and_counts_thousands_of_ineligible() -> None:
    young = [candidate(f"y{i:04d}", started=NOW - timedelta(minutes=1)) for i in range(1000)]
    old = [candidate(f"o{i}", started=LONG_AGO) for i in range(3)]
    choice = choose_victims([*young, *old], 8, NOW, min_runtime_s=1800.0)

    record = handlers.candidates_record(choice)

    assert [c["allocation_id"] for c in record["ranked"]] == ["o0"]
    assert record["not_needed"]["allocation_ids"] == ["o1", "o2"]
    assert len(record["ineligible"]) == handlers.AUDIT_INELIGIBLE_LISTED
    assert record["ineligible_count"] == 1000
    assert record["ineligible_by_reason"] == {"skipped: inside its min runtime": 1000}
