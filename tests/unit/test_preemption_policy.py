"""The controller's pure decisions around the elastic rules."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from gpusched.domain.elastic import ElasticThresholds
from gpusched.preemption import policy

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
LIMITS = policy.ControllerLimits(ElasticThresholds(), cooldown_s=60.0, max_reading_age_s=30.0)


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
        lent_gpus=lent,
        shared_allocated_gpus=40,
        candidates=(),
        withdrawable=withdrawable,
    )


def test_evictions_in_flight_are_withdrawn_when_inference_falls_below_the_target() -> None:
    outcome = policy.decide(
        reading(0.5), view(in_flight=True, withdrawable=("r1", "r2")), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Withdraw)
    assert outcome.request_ids == ("r1", "r2")


def test_evictions_in_flight_are_kept_while_inference_is_still_above_the_target() -> None:
    outcome = policy.decide(reading(0.75), view(in_flight=True, withdrawable=("r1",)), LIMITS, NOW)
    assert isinstance(outcome, policy.Hold)


def test_evictions_already_withdrawn_are_not_withdrawn_twice() -> None:
    outcome = policy.decide(reading(0.2), view(in_flight=True), LIMITS, NOW)
    assert isinstance(outcome, policy.Hold)


def test_a_stale_reading_never_withdraws() -> None:
    old = policy.PoolReading(
        time=NOW - timedelta(minutes=5),
        inference=policy.PoolFigures(gpus=24, util=0.1, reporting_gpus=24),
        shared=policy.PoolFigures(gpus=40, util=0.9, reporting_gpus=40),
    )
    outcome = policy.decide(old, view(in_flight=True, withdrawable=("r1",)), LIMITS, NOW)
    assert isinstance(outcome, policy.Hold)


def test_a_busy_shared_pool_blocks_a_shrink_under_the_default_gate() -> None:
    outcome = policy.decide(
        reading(0.1, shared_util=0.95), view(in_flight=False, lent=8), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Hold)
    assert "hysteresis" in outcome.reason


def test_a_quiet_shared_pool_lets_lent_gpus_go_back() -> None:
    outcome = policy.decide(
        reading(0.1, shared_util=0.3), view(in_flight=False, lent=8), LIMITS, NOW
    )
    assert isinstance(outcome, policy.Shrink)
    assert outcome.gpus >= 1
