from __future__ import annotations

import random
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from gpusched.domain.elastic import (
    ElasticThresholds,
    PoolSignals,
    PriorityClass,
    VictimCandidate,
    choose_victims,
    decide_expand,
    decide_shrink,
    expand_need,
    shrink_release,
)
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import Allocation, JobKind

NOW = datetime(2025, 3, 1, 12, 0, tzinfo=UTC)


# --- sizing formulas ---------------------------------------------------------------------


def test_the_design_example_lends_seven_gpus_at_90_percent_on_24() -> None:
    # ceil(0.9 * 24 / 0.7) - 24 = 31 - 24
    assert expand_need(0.9, 24, 40) == 7


@pytest.mark.parametrize(
    ("util", "inference_gpus", "expected"),
    [
        (0.84, 10, 2),  # 0.84 * 10 / 0.7 = 12.000000000000002 in floats
        (0.98, 5, 2),  # 7.000000000000001
        (0.77, 20, 2),  # 22.000000000000004
        (0.7, 10, 1),  # exactly at target: nothing to add, but at least 1
    ],
)
def test_float_noise_never_adds_a_gpu_to_the_expansion(
    util: float, inference_gpus: int, expected: int
) -> None:
    assert expand_need(util, inference_gpus, 40) == expected


def test_expansion_is_at_least_one_and_at_most_what_the_shared_pool_has() -> None:
    assert expand_need(0.81, 100, 40) == 16
    assert expand_need(0.71, 1, 40) == 1
    assert expand_need(1.0, 24, 5) == 5
    assert expand_need(1.0, 24, 0) == 0


def test_shrink_releases_the_floor_of_the_gap_below_the_threshold() -> None:
    # floor((0.40 - 0.20) * 24) = floor(4.8)
    assert shrink_release(0.2, 24, 10) == 4


def test_float_noise_never_drops_a_gpu_from_the_shrink() -> None:
    # (0.3 - 0.1) * 20 = 3.9999999999999996 in floats
    assert shrink_release(0.1, 20, 10, threshold=0.3) == 4


def test_shrink_is_at_least_one_and_never_more_than_what_is_lent() -> None:
    assert shrink_release(0.39, 24, 10) == 1
    assert shrink_release(0.0, 40, 3) == 3
    assert shrink_release(0.1, 24, 0) == 0


def test_utilization_given_as_a_percentage_is_refused() -> None:
    with pytest.raises(ValueError, match=r"util must be within 0\.\.1"):
        expand_need(85, 24, 40)
    with pytest.raises(ValueError, match=r"inference_util must be within 0\.\.1"):
        signals(85)


def test_thresholds_outside_their_order_are_refused() -> None:
    with pytest.raises(ValueError, match="shrink_below < target < expand_above"):
        ElasticThresholds(expand_above=0.6, target=0.7)


# --- decisions ---------------------------------------------------------------------------


def signals(
    util: float, shared_util: float = 0.9, inference: int = 24, available: int = 40, lent: int = 0
) -> PoolSignals:
    return PoolSignals(
        inference_util=util,
        shared_util=shared_util,
        inference_gpus=inference,
        shared_available=available,
        lent_gpus=lent,
    )


def test_expansion_is_decided_only_above_the_expand_threshold() -> None:
    decision = decide_expand(signals(0.9))

    assert decision is not None
    assert (decision.gpus, decision.shortfall) == (7, 0)
    assert "0.90 > 0.80" in decision.reason
    assert decide_expand(signals(0.80)) is None


def test_an_expansion_larger_than_the_shared_pool_reports_the_shortfall() -> None:
    decision = decide_expand(signals(0.95, available=3))

    assert decision is not None
    assert (decision.gpus, decision.shortfall) == (3, 6)  # ceil(0.95 * 24 / 0.7) - 24 = 9
    assert decision.signals == signals(0.95, available=3)
    assert "short by 6" in decision.reason


def test_an_exhausted_shared_pool_still_yields_a_decision_carrying_the_shortfall() -> None:
    decision = decide_expand(signals(0.9, available=0))

    assert decision is not None
    assert (decision.gpus, decision.shortfall) == (0, 7)


def test_shrink_needs_idle_inference_an_unbusy_shared_pool_and_lent_gpus() -> None:
    decision = decide_shrink(signals(0.2, shared_util=0.5, inference=32, lent=8))

    assert decision is not None
    assert decision.gpus == 6  # floor(0.2 * 32)
    assert "returning 6 of 8 lent GPUs" in decision.reason
    assert decide_shrink(signals(0.2, shared_util=0.6, inference=32, lent=8)) is None
    assert decide_shrink(signals(0.2, shared_util=0.5, inference=32, lent=0)) is None
    assert decide_shrink(signals(0.4, shared_util=0.5, inference=32, lent=8)) is None


def test_readings_inside_the_hysteresis_band_never_shrink() -> None:
    readings = [0.80, 0.85, 0.79, 0.82, 0.41, 0.79]

    expansions = [u for u in readings if decide_expand(signals(u, shared_util=0.1, lent=8))]
    shrinks = [u for u in readings if decide_shrink(signals(u, shared_util=0.1, lent=8))]

    assert expansions == [0.85, 0.82]
    assert shrinks == []


def test_custom_thresholds_move_the_trigger() -> None:
    strict = ElasticThresholds(expand_above=0.75, target=0.6)

    decision = decide_expand(signals(0.78), strict)

    assert decision is not None and decision.gpus == 8  # ceil(0.78 * 24 / 0.6) - 24


# --- victims -----------------------------------------------------------------------------


def candidate(
    allocation_id: str,
    priority_class: PriorityClass = PriorityClass.P1_NORMAL,
    gpus: int = 2,
    *,
    checkpoint_minutes_ago: float | None = 10,
    started_minutes_ago: float = 120,
    checkpointable: bool = True,
    pool: Pool = Pool.SHARED,
) -> VictimCandidate:
    return VictimCandidate(
        allocation_id=allocation_id,
        job_id=f"job-{allocation_id}",
        team="team-a",
        priority_class=priority_class,
        gpus=gpus,
        gpu_refs=tuple(GpuRef(f"node-{allocation_id}", i) for i in range(gpus)),
        started_at=NOW - timedelta(minutes=started_minutes_ago),
        last_checkpoint_at=(
            None
            if checkpoint_minutes_ago is None
            else NOW - timedelta(minutes=checkpoint_minutes_ago)
        ),
        checkpointable=checkpointable,
        pool=pool,
    )


def tenant(
    allocation_id: str,
    gpu: GpuRef,
    tenants: int,
    priority_class: PriorityClass = PriorityClass.P2_OFFLINE,
    *,
    share: float = 0.25,
    started_minutes_ago: float = 120,
    checkpoint_minutes_ago: float = 10,
) -> VictimCandidate:
    """A fraction of ``gpu``, one of its ``tenants``."""
    return replace(
        candidate(
            allocation_id,
            priority_class,
            1,
            started_minutes_ago=started_minutes_ago,
            checkpoint_minutes_ago=checkpoint_minutes_ago,
        ),
        gpu_refs=(gpu,),
        share=share,
        tenants=tenants,
    )


SHARED_GPU = GpuRef("node-shared", 0)


def test_offline_fractions_sharing_a_gpu_go_together_before_a_normal_whole_gpu_job() -> None:
    candidates = [
        candidate("normal", PriorityClass.P1_NORMAL, gpus=8, checkpoint_minutes_ago=1),
        tenant("f1", SHARED_GPU, 3),
        tenant("f2", SHARED_GPU, 3),
        tenant("f3", SHARED_GPU, 3, checkpoint_minutes_ago=60),
    ]

    choice = choose_victims(candidates, need=1, now=NOW)

    assert choice.allocation_ids == ("f1", "f2", "f3")
    assert (choice.freed, choice.shortfall) == (1, 0)
    reasons = dict(choice.reasons)
    assert "one of 3 tenants of GPU node-shared/0 evicted together" in reasons["f2"]
    assert reasons["normal"].startswith("skipped: need of 1 GPUs already met")


def test_a_gpu_whose_tenants_cannot_all_be_evicted_frees_nothing() -> None:
    other = GpuRef("node-shared", 1)
    candidates = [
        candidate("normal", PriorityClass.P1_NORMAL, gpus=2),
        # Two listed of three (the third is being evicted, or is never a victim).
        tenant("f1", SHARED_GPU, 3),
        tenant("f2", SHARED_GPU, 3),
        # One tenant inside its minimum runtime holds the GPU for both.
        tenant("g1", other, 2),
        tenant("g2", other, 2, started_minutes_ago=5),
    ]

    choice = choose_victims(candidates, need=1, now=NOW, min_runtime_s=1800)

    assert choice.allocation_ids == ("normal",)
    reasons = dict(choice.reasons)
    assert "1 tenant(s) that are not candidates" in reasons["f1"]
    assert reasons["g2"].startswith("skipped: inside its min runtime")
    assert reasons["g1"].startswith("skipped: shares GPU node-shared/1 with g2 (inside its min")


def test_a_unit_ranks_by_its_tenants_lost_work_summed_and_its_least_preemptible_class() -> None:
    cheap, costly, mixed = (GpuRef("node-shared", i) for i in range(3))
    candidates = [
        # Two quarter-GPU tenants, 60 minutes since their checkpoints: 30 GPU-minutes.
        tenant("a1", costly, 2, checkpoint_minutes_ago=60),
        tenant("a2", costly, 2, checkpoint_minutes_ago=60),
        # Two quarter-GPU tenants, 10 minutes each: 5 GPU-minutes.
        tenant("b1", cheap, 2),
        tenant("b2", cheap, 2),
        # Cheaper still, but one p1 tenant makes the unit p1.
        tenant("c1", mixed, 2, checkpoint_minutes_ago=1),
        tenant("c2", mixed, 2, PriorityClass.P1_NORMAL, checkpoint_minutes_ago=1),
    ]

    choice = choose_victims(candidates, need=3, now=NOW)

    assert choice.allocation_ids == ("b1", "b2", "a1", "a2", "c1", "c2")
    assert choice.victims[0].lost_work_gpu_seconds(NOW) == pytest.approx(0.25 * 600)


def test_the_rate_limit_counts_every_tenant_of_a_unit() -> None:
    candidates = [tenant("f1", SHARED_GPU, 2), tenant("f2", SHARED_GPU, 2)]

    choice = choose_victims(candidates, need=1, now=NOW, max_victims=1)

    assert choice.victims == ()
    assert (choice.deferred, choice.shortfall) == (1, 0)


def test_offline_jobs_are_evicted_before_normal_ones_whatever_their_lost_work() -> None:
    candidates = [
        candidate("normal", PriorityClass.P1_NORMAL, checkpoint_minutes_ago=1),
        candidate("offline", PriorityClass.P2_OFFLINE, checkpoint_minutes_ago=60),
    ]

    choice = choose_victims(candidates, need=4, now=NOW)

    assert choice.allocation_ids == ("offline", "normal")
    assert (choice.freed, choice.shortfall) == (4, 0)


def test_urgent_training_inference_and_other_pools_are_never_chosen() -> None:
    candidates = [
        candidate("urgent", PriorityClass.P0_URGENT),
        candidate("serving", PriorityClass.INFERENCE, pool=Pool.INFERENCE),
        candidate("dedicated", PriorityClass.P2_OFFLINE, pool=Pool.TRAINING),
        candidate("ok", PriorityClass.P2_OFFLINE),
    ]

    choice = choose_victims(candidates, need=8, now=NOW)

    assert choice.allocation_ids == ("ok",)
    assert (choice.freed, choice.shortfall) == (2, 6)
    reasons = dict(choice.reasons)
    assert reasons["urgent"] == "skipped: p0-urgent is never preempted for inference"
    assert reasons["serving"] == "skipped: inference is never preempted for inference"
    assert reasons["dedicated"] == "skipped: runs in the training pool, not the shared pool"
    assert reasons["ok"].startswith("chosen: p2-offline")


def test_within_a_tier_the_least_lost_work_goes_first() -> None:
    candidates = [
        candidate("fresh-big", gpus=8, checkpoint_minutes_ago=2),  # 8 * 120 s
        candidate("stale-small", gpus=1, checkpoint_minutes_ago=30),  # 1 * 1800 s
        candidate("fresh-small", gpus=1, checkpoint_minutes_ago=5),  # 1 * 300 s
    ]

    choice = choose_victims(candidates, need=20, now=NOW)

    assert choice.allocation_ids == ("fresh-small", "fresh-big", "stale-small")


def test_equal_lost_work_prefers_the_larger_allocation_then_the_id() -> None:
    candidates = [
        candidate("b", gpus=1, checkpoint_minutes_ago=20),
        candidate("a", gpus=1, checkpoint_minutes_ago=20),
        candidate("big", gpus=2, checkpoint_minutes_ago=10),
    ]

    choice = choose_victims(candidates, need=10, now=NOW)

    assert choice.allocation_ids == ("big", "a", "b")


def test_choosing_stops_once_the_need_is_met_and_says_why_the_rest_stay() -> None:
    candidates = [candidate(f"j{i}", gpus=4, checkpoint_minutes_ago=i + 1) for i in range(4)]

    choice = choose_victims(candidates, need=6, now=NOW)

    assert choice.allocation_ids == ("j0", "j1")
    assert (choice.freed, choice.shortfall) == (8, 0)
    assert [reason for _, reason in choice.reasons[2:]] == [
        "skipped: need of 6 GPUs already met by higher-ranked victims"
    ] * 2


def test_every_candidate_gets_exactly_one_reason() -> None:
    candidates = [
        candidate("a", PriorityClass.P0_URGENT),
        candidate("b", PriorityClass.P2_OFFLINE),
        candidate("c", PriorityClass.P1_NORMAL),
        candidate("d", PriorityClass.P1_NORMAL, pool=Pool.INFERENCE),
    ]

    choice = choose_victims(candidates, need=2, now=NOW)

    assert sorted(allocation_id for allocation_id, _ in choice.reasons) == ["a", "b", "c", "d"]


def test_a_job_that_cannot_checkpoint_loses_its_whole_run() -> None:
    candidates = [
        candidate("no-ckpt", gpus=1, checkpoint_minutes_ago=1, checkpointable=False),
        candidate("ckpt", gpus=1, checkpoint_minutes_ago=60),
    ]

    choice = choose_victims(candidates, need=2, now=NOW)

    assert choice.allocation_ids == ("ckpt", "no-ckpt")
    assert "since start of run" in dict(choice.reasons)["no-ckpt"]


def test_a_checkpoint_from_before_this_run_counts_from_the_run_start() -> None:
    resumed = candidate("resumed", gpus=2, checkpoint_minutes_ago=600, started_minutes_ago=15)

    assert resumed.lost_work_gpu_seconds(NOW) == 2 * 15 * 60


def test_nothing_needed_means_no_victims() -> None:
    choice = choose_victims([candidate("a")], need=0, now=NOW)

    assert (choice.victims, choice.freed, choice.shortfall) == ((), 0, 0)


def test_the_choice_does_not_depend_on_the_order_of_the_candidates() -> None:
    candidates = [
        candidate(f"j{i}", random.Random(i).choice(list(PriorityClass)), gpus=1 + i % 3)
        for i in range(12)
    ]
    expected = choose_victims(candidates, need=9, now=NOW)

    for seed in range(5):
        shuffled = candidates[:]
        random.Random(seed).shuffle(shuffled)
        assert choose_victims(shuffled, need=9, now=NOW) == expected


def test_victim_choice_refuses_naive_times_and_duplicate_candidates() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        choose_victims([candidate("a")], need=1, now=datetime(2025, 3, 1, 12, 0))
    with pytest.raises(ValueError, match="twice"):
        choose_victims([candidate("a"), candidate("a")], need=1, now=NOW)


def test_a_candidate_built_from_an_allocation_keeps_its_gang_and_pool() -> None:
    granted_at = NOW - timedelta(hours=1)
    allocation = Allocation(
        allocation_id="alloc-1",
        job_id="job-1",
        team="vision",
        kind=JobKind.TRAINING,
        priority_class=PriorityClass.P2_OFFLINE,
        gpus=(GpuRef("n1", 0), GpuRef("n2", 0)),
        granted_at=granted_at,
        model="A100-80GB",
        pool=Pool.SHARED,
    )

    victim = VictimCandidate.from_allocation(allocation, checkpointable=True)

    assert (victim.gpus, victim.gpu_refs, victim.pool) == (2, allocation.gpus, Pool.SHARED)
    assert victim.lost_work_gpu_seconds(NOW) == 2 * 3600


def test_borrowed_capacity_goes_before_guaranteed_within_a_class_but_never_across() -> None:
    guaranteed = candidate("guaranteed", PriorityClass.P2_OFFLINE, checkpoint_minutes_ago=1)
    borrowed = replace(
        candidate("borrowed", PriorityClass.P2_OFFLINE, checkpoint_minutes_ago=60), borrowed=True
    )
    normal_borrowed = replace(candidate("normal", PriorityClass.P1_NORMAL), borrowed=True)

    choice = choose_victims([guaranteed, normal_borrowed, borrowed], need=6, now=NOW)

    assert choice.allocation_ids == ("borrowed", "guaranteed", "normal")
    assert "(borrowed)" in dict(choice.reasons)["borrowed"]


def test_on_equal_lost_work_the_victim_that_frees_a_whole_node_goes_first() -> None:
    # "shared" sits on a node with another allocation; "alone" has its node to itself.
    shared = replace(candidate("shared", gpus=2), gpu_refs=(GpuRef("n1", 0), GpuRef("n1", 1)))
    neighbour = replace(
        candidate("neighbour", PriorityClass.P0_URGENT, gpus=1), gpu_refs=(GpuRef("n1", 2),)
    )
    alone = replace(candidate("alone", gpus=2), gpu_refs=(GpuRef("n2", 0), GpuRef("n2", 1)))

    choice = choose_victims([shared, neighbour, alone], need=2, now=NOW)

    assert choice.allocation_ids == ("alone",)
    assert "frees whole nodes" in dict(choice.reasons)["alone"]


def test_on_equal_lost_work_the_victim_that_frees_a_whole_nvlink_island_goes_first() -> None:
    # Two 8-GPU nodes, each with two 4-GPU islands; no candidate has a node to itself.
    # "split" straddles both islands of n1 with a neighbour in each; "z-island" holds all
    # of n2's island 0, sharing the node (not the island) with a neighbour.
    split = replace(
        candidate("split", gpus=4),
        gpu_refs=(GpuRef("n1", 2), GpuRef("n1", 3), GpuRef("n1", 4), GpuRef("n1", 5)),
    )
    island = replace(
        candidate("z-island", gpus=4), gpu_refs=tuple(GpuRef("n2", i) for i in range(4))
    )
    neighbours = [
        replace(candidate(name, PriorityClass.P0_URGENT, gpus=1), gpu_refs=(ref,))
        for name, ref in (("a", GpuRef("n1", 0)), ("b", GpuRef("n1", 7)), ("c", GpuRef("n2", 5)))
    ]
    island_of = {GpuRef(node, i): f"{node}/{i // 4}" for node in ("n1", "n2") for i in range(8)}
    everyone = [split, island, *neighbours]

    # Without the island map the two tie and the allocation id decides.
    assert choose_victims(everyone, need=4, now=NOW).allocation_ids == ("split",)
    choice = choose_victims(everyone, need=4, now=NOW, island_of=island_of)
    assert choice.allocation_ids == ("z-island",)
    assert "frees whole NVLink islands" in dict(choice.reasons)["z-island"]


def test_a_run_inside_its_min_runtime_is_never_chosen() -> None:
    young = candidate("young", PriorityClass.P2_OFFLINE, started_minutes_ago=29)
    old = candidate("old", PriorityClass.P1_NORMAL, started_minutes_ago=31)

    choice = choose_victims([young, old], need=4, now=NOW, min_runtime_s=1800)

    assert choice.allocation_ids == ("old",)
    assert choice.shortfall == 2
    assert dict(choice.reasons)["young"] == ("skipped: inside its min runtime (ran 1740s of 1800s)")


def test_the_rate_limit_defers_what_eligible_victims_could_free() -> None:
    candidates = [candidate(f"j{i}", gpus=2) for i in range(3)]

    choice = choose_victims(candidates, need=8, now=NOW, max_victims=1)

    assert (len(choice.victims), choice.freed, choice.deferred, choice.shortfall) == (1, 2, 4, 2)
    assert sum("rate limit" in reason for _, reason in choice.reasons) == 2
