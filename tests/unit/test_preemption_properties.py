"""Properties of victim choice and of the controller's decisions, for any cluster and
any signal history hypothesis can think of."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.domain.elastic import (
    ElasticThresholds,
    PriorityClass,
    VictimCandidate,
    choose_victims,
)
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.preemption import policy, signals
from gpusched.preemption.signals import HeldSignals, SignalLimits

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
MIN_RUNTIME_S = 1800.0


@st.composite
def clusters(draw: st.DrawFn) -> list[VictimCandidate]:
    count = draw(st.integers(0, 25))
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 8)))]
    used: set[GpuRef] = set()
    out: list[VictimCandidate] = []
    for i in range(count):
        gpus = draw(st.integers(1, 8))
        # Spread over one or two nodes so some nodes hold several allocations.
        homes = draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=2, unique=True))
        refs: list[GpuRef] = []
        slot = 0
        while len(refs) < gpus:
            ref = GpuRef(homes[slot % len(homes)], slot + 100 * i)
            if ref not in used:
                used.add(ref)
                refs.append(ref)
            slot += 1
        started = NOW - timedelta(seconds=draw(st.integers(0, 4 * 3600)))
        checkpoint = draw(st.none() | st.integers(0, 4 * 3600))
        out.append(
            VictimCandidate(
                f"a{i}", f"job-{i}", draw(st.sampled_from(["t1", "t2"])),
                draw(st.sampled_from(list(PriorityClass))), gpus, tuple(refs), started,
                None if checkpoint is None else NOW - timedelta(seconds=checkpoint),
                draw(st.booleans()),
                pool=draw(st.sampled_from([Pool.SHARED, Pool.SHARED, Pool.INFERENCE])),
                borrowed=draw(st.booleans()),
            )
        )  # fmt: skip
    return out


def eligible(c: VictimCandidate, min_runtime_s: float) -> bool:
    return (
        c.priority_class.preemptible
        and c.pool is Pool.SHARED
        and (NOW - c.started_at).total_seconds() >= min_runtime_s
    )


@settings(max_examples=300, deadline=None)
@given(
    clusters(),
    st.integers(0, 60),
    st.sampled_from([0.0, MIN_RUNTIME_S]),
    st.none() | st.integers(0, 6),
)
def test_victim_choice_keeps_every_rule_for_any_cluster(
    cluster: list[VictimCandidate], need: int, min_runtime_s: float, max_victims: int | None
) -> None:
    choice = choose_victims(
        cluster, need, NOW, min_runtime_s=min_runtime_s, max_victims=max_victims
    )
    chosen = {v.allocation_id for v in choice.victims}
    # Never p0-urgent, inference, or a run inside its min runtime.
    assert all(eligible(v, min_runtime_s) for v in choice.victims)
    # Whole allocations (a gang is one allocation): every GPU of a victim is freed.
    assert choice.freed == sum(len(v.gpu_refs) for v in choice.victims)
    # No tier inversion, and borrowed before guaranteed within a tier: a chosen victim
    # never ranks below an eligible candidate left running, unless the need was met or
    # the rate limit stopped the choice.
    limited = max_victims is not None and len(choice.victims) == max_victims
    if choice.freed < need and not limited:
        assert all(c.allocation_id in chosen for c in cluster if eligible(c, min_runtime_s))
    for v in choice.victims:
        for c in cluster:
            if c.allocation_id in chosen or not eligible(c, min_runtime_s):
                continue
            assert (c.priority_class.preemption_rank, not c.borrowed) >= (
                v.priority_class.preemption_rank,
                not v.borrowed,
            )
    # Never more than the need plus one victim's worth.
    if choice.victims:
        assert choice.freed < need + max(v.gpus for v in choice.victims)
    # Every GPU of the need is accounted for: freed, deferred by the limit, or short.
    assert min(choice.freed, need) + choice.deferred + choice.shortfall == need
    if max_victims is None:
        assert choice.deferred == 0


@st.composite
def shared_gpus(draw: st.DrawFn) -> list[VictimCandidate]:
    """Whole-GPU candidates and GPUs shared by fractions, some of whose tenants are not
    listed (being evicted, or never victims): every tenant says how many the GPU has."""
    out = draw(clusters())
    for g in range(draw(st.integers(0, 6))):
        gpu = GpuRef(f"s{g % 3}", 1000 + g)
        tenants = draw(st.integers(1, 4))
        listed = draw(st.integers(1, tenants))
        for t in range(listed):
            started = NOW - timedelta(seconds=draw(st.integers(0, 4 * 3600)))
            out.append(
                VictimCandidate(
                    f"f{g}-{t}", f"job-f{g}-{t}", "t1",
                    draw(st.sampled_from(list(PriorityClass))), 1, (gpu,), started,
                    NOW - timedelta(seconds=draw(st.integers(0, 4 * 3600))), True,
                    pool=draw(st.sampled_from([Pool.SHARED, Pool.SHARED, Pool.INFERENCE])),
                    borrowed=draw(st.booleans()),
                    share=draw(st.sampled_from([0.1, 0.25, 0.5])), tenants=tenants,
                )
            )  # fmt: skip
    return out


@settings(max_examples=300, deadline=None)
@given(
    shared_gpus(),
    st.integers(0, 30),
    st.sampled_from([0.0, MIN_RUNTIME_S]),
    st.none() | st.integers(0, 6),
)
def test_the_fractions_of_a_gpu_are_victims_all_together_or_not_at_all(
    cluster: list[VictimCandidate], need: int, min_runtime_s: float, max_victims: int | None
) -> None:
    choice = choose_victims(
        cluster, need, NOW, min_runtime_s=min_runtime_s, max_victims=max_victims
    )
    chosen = {v.allocation_id for v in choice.victims}
    units: dict[GpuRef, list[VictimCandidate]] = {}
    for c in cluster:
        if c.fraction:
            units.setdefault(c.gpu_refs[0], []).append(c)
    freed_units = 0
    for gpu, members in units.items():
        taken = [m for m in members if m.allocation_id in chosen]
        if not taken:
            continue
        # All of its tenants, every one listed and allowed to be evicted.
        assert len(taken) == len(members) == members[0].tenants, gpu
        assert all(eligible(m, min_runtime_s) for m in members)
        freed_units += 1
    whole = [v for v in choice.victims if not v.fraction]
    assert all(eligible(v, min_runtime_s) for v in whole)
    assert choice.freed == sum(v.gpus for v in whole) + freed_units
    if max_victims is not None:
        assert len(choice.victims) <= max_victims
    assert min(choice.freed, need) + choice.deferred + choice.shortfall == need
    # Short of the need and not held back by the limit: every unit that could go went.
    if choice.freed < need and choice.deferred == 0:
        for members in units.values():
            if len(members) == members[0].tenants and all(
                eligible(m, min_runtime_s) for m in members
            ):
                assert all(m.allocation_id in chosen for m in members)


LIMITS = policy.ControllerLimits(
    ElasticThresholds(),
    cooldown_s=120.0,
    max_reading_age_s=30.0,
    signals=SignalLimits(expand_hold_s=30.0, shrink_hold_s=600.0, slo_ms={"chat": 100.0}),
    min_lend_s=900.0,
    min_runtime_s=MIN_RUNTIME_S,
    max_evictions_per_min=4,
)


def reading_at(at: datetime, util: float, shared_util: float, p99: float) -> policy.PoolReading:
    return policy.PoolReading(
        time=at,
        inference=policy.PoolFigures(gpus=24, util=util, reporting_gpus=24),
        shared=policy.PoolFigures(gpus=40, util=shared_util, reporting_gpus=40),
        services=(policy.ServiceReading("chat", p99, 0),),
    )


@settings(max_examples=150, deadline=None)
@given(
    clusters(),
    st.lists(
        st.tuples(
            st.integers(1, 20),  # seconds to the next reading
            st.floats(0.0, 1.0),  # inference utilization
            st.floats(0.0, 1.0),  # shared utilization
            st.floats(0.0, 150.0),  # chat P99 in ms
        ),
        min_size=1,
        max_size=60,
    ),
    st.integers(0, 16),
)
def test_the_controller_never_acts_on_a_condition_younger_than_its_window(
    cluster: list[VictimCandidate],
    history: list[tuple[int, float, float, float]],
    lent: int,
) -> None:
    held = HeldSignals()
    at = NOW - timedelta(hours=1)
    reservations = (policy.LentReservation("r", lent, at - timedelta(hours=1)),) if lent else ()
    view = policy.ControllerView(
        in_flight=False,
        last_change_at=None,
        last_shortfall_at=None,
        reservations=reservations,
        shared_allocated_gpus=40,
        candidates=tuple(replace(c, started_at=c.started_at - timedelta(hours=1)) for c in cluster),
    )
    for step, util, shared_util, p99 in history:
        at += timedelta(seconds=step)
        reading = reading_at(at, util, shared_util, p99)
        held = signals.fold(held, reading, LIMITS.thresholds, LIMITS.signals)
        outcome = policy.decide(reading, held, view, LIMITS, at)
        if isinstance(outcome, policy.Expand):
            # The service loads candidates only when expand_due says so.
            assert policy.expand_due(reading, held, LIMITS, at)
            assert held.expand_since is not None
            assert at - held.expand_since >= timedelta(seconds=LIMITS.signals.expand_hold_s)
            assert all((at - v.started_at).total_seconds() >= MIN_RUNTIME_S
                       for v in outcome.choice.victims)  # fmt: skip
            assert len(outcome.choice.victims) <= 4
        if isinstance(outcome, policy.Shrink):
            assert held.shrink_since is not None
            assert at - held.shrink_since >= timedelta(seconds=LIMITS.signals.shrink_hold_s)
            assert 1 <= outcome.gpus <= lent
