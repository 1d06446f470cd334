"""The replay engine on a small cluster and a day of jobs: what each policy does with the
same inputs, and the accounting every run must keep. No I/O."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from decimal import Decimal

import pytest

from gpusched.domain.inventory import Inventory, parse_inventory
from gpusched.domain.ledger import PriorityClass
from gpusched.domain.pricing import PriceBook
from gpusched.replay import pools, report
from gpusched.replay.demand import DemandCurve, DemandParams
from gpusched.replay.engine import EngineParams, replay
from gpusched.replay.experiment import Comparison, Experiment, Prepared, training_ceiling_gpu_h
from gpusched.replay.metrics import RunResult
from gpusched.replay.policies import Kind, Policy, ablations, default_limits, kubernetes
from gpusched.replay.workload import UserRow, Workload, from_user_rows

CLUSTER: Inventory = parse_inventory(
    {"nodes": [{"name_prefix": "n", "count": 8, "pool": "shared", "gpu_model": "T4",
                "gpus": 4, "cpu_milli": 64000, "memory_mib": 262144}]}
)  # fmt: skip
DEDICATED = 8  # two nodes of the eight
BOOK = PriceBook({"T4": Decimal("0.45")}, cpu_core_hour=Decimal("0.04"))
HORIZON = 86_400.0
PARAMS = EngineParams(horizon_s=HORIZON)
# The inference pool runs at 0.7 at its diurnal peak; two surges a day double it.
DEMAND = DemandCurve(
    DemandParams(peak_gpus=0.7 * DEDICATED, surges_per_day=2.0, surge_amplitude=(0.8, 1.0),
                 surge_minutes=(60.0, 90.0)),
    HORIZON, seed=11,
)  # fmt: skip


def workload(seed: int = 4) -> Workload:
    rng = random.Random(seed)
    classes = [PriorityClass.P2_OFFLINE, PriorityClass.P1_NORMAL, PriorityClass.P0_URGENT]
    rows = [
        UserRow(f"job{i}", rng.uniform(0, 14 * 3600), rng.choice([1, 1, 2, 4]), 1000,
                rng.uniform(3600, 5 * 3600), classes[2 if i % 7 == 0 else i % 2], "lab")
        for i in range(120)
    ]  # fmt: skip
    return from_user_rows(rows, seed=seed)


GPUSCHED = Policy("gpusched", Kind.GPUSCHED, DEDICATED, limits=default_limits(shared_below=1.0))
STATIC = Policy("static split", Kind.STATIC, DEDICATED)
KUBERNETES = kubernetes(DEDICATED)
NO_WAIT, NO_LOST_WORK, NO_HYSTERESIS = ablations(GPUSCHED)


_RUNS: dict[str, RunResult] = {}


def run(policy: Policy) -> RunResult:
    # Each policy replays once per process; the tests read the same run.
    if policy.name not in _RUNS:
        _RUNS[policy.name] = replay(
            policy, pools.split(CLUSTER, policy.inference_gpus), workload(), DEMAND, PARAMS,
            periodic_s=1800.0, book=BOOK,
        )  # fmt: skip
    return _RUNS[policy.name]


def get(result: RunResult, *path: str) -> float:
    return report.figure(result, *path)


def test_the_static_split_never_lends_and_misses_the_slo_in_the_surges() -> None:
    static = run(STATIC)

    assert get(static, "inference", "expansions") == 0
    assert max(static.series["lent"]) == 0
    assert get(static, "inference", "slo_time_share") < 0.97
    assert get(static, "training", "evictions") == 0


def test_gpusched_lends_in_the_surges_and_keeps_the_slo_better_than_the_static_split() -> None:
    ours, static = run(GPUSCHED), run(STATIC)

    assert get(ours, "inference", "expansions") >= 1
    assert max(ours.series["lent"]) > 0
    assert get(ours, "inference", "slo_time_share") > get(static, "inference", "slo_time_share")


def test_gpusched_evicts_after_a_checkpoint_and_loses_far_less_than_kubernetes() -> None:
    ours, k8s = run(GPUSCHED), run(KUBERNETES)

    assert get(ours, "training", "evictions") >= 1
    assert get(k8s, "training", "evictions") >= 1
    assert get(ours, "training", "forced_evictions") < get(ours, "training", "evictions")
    assert get(ours, "training", "lost_gpu_h") < 0.5 * get(k8s, "training", "lost_gpu_h")


def test_without_the_checkpoint_wait_every_eviction_is_forced() -> None:
    forced = run(NO_WAIT)

    evictions = get(forced, "training", "evictions")
    assert evictions >= 1
    assert get(forced, "training", "forced_evictions") == evictions
    assert get(forced, "training", "lost_gpu_h") > get(run(GPUSCHED), "training", "lost_gpu_h")
    assert forced.summary["cost"]["credits"] != "0.00"  # type: ignore[index]


@pytest.mark.parametrize("policy", [GPUSCHED, STATIC, KUBERNETES, NO_LOST_WORK, NO_HYSTERESIS])
def test_every_job_is_accounted_for_and_goodput_is_what_ran_less_what_was_lost(
    policy: Policy,
) -> None:
    result = run(policy)
    training = result.summary["training"]
    assert isinstance(training, dict)

    assert training["arrived"] == len(workload().jobs)
    assert training["started"] + training["never_started"] == training["arrived"]
    assert training["completed"] <= training["started"]
    assert training["goodput_gpu_h"] == pytest.approx(
        training["ran_gpu_h"] - training["lost_gpu_h"]
    )
    # No policy gets more done than the jobs can do by the horizon at all.
    assert training["goodput_gpu_h"] <= workload().completable_gpu_seconds(HORIZON) / 3600
    assert 0 <= get(result, "cluster", "allocated_share_mean") <= 1
    assert Decimal(result.summary["cost"]["total"]) > 0  # type: ignore[index]


def test_the_work_bound_is_every_job_run_from_its_arrival_and_cut_at_the_horizon() -> None:
    jobs = from_user_rows(
        [
            UserRow("whole", 0.0, 2, 1000, 3600.0, PriorityClass.P2_OFFLINE, "lab"),
            UserRow("cut", 3 * 3600.0, 1, 500, 7200.0, PriorityClass.P1_NORMAL, "lab"),
            UserRow("late", 5 * 3600.0, 4, 1000, 60.0, PriorityClass.P2_OFFLINE, "lab"),
        ],
        seed=1,
    )

    # 2 GPUs x 1 h, half a GPU x the 1 h left of its 2 h, nothing from a job after it.
    assert jobs.completable_gpu_seconds(4 * 3600.0) / 3600 == pytest.approx(2.5)
    assert jobs.completable_gpu_seconds(0.0) == 0.0


def test_a_cluster_too_large_to_queue_on_reaches_the_work_bound_and_no_more() -> None:
    # Four times the GPUs and no inference: nothing waits, so the static split's goodput
    # is the bound itself (the bound is reachable, not only an upper limit).
    big = parse_inventory(
        {"nodes": [{"name_prefix": "n", "count": 32, "pool": "shared", "gpu_model": "T4",
                    "gpus": 4, "cpu_milli": 64000, "memory_mib": 262144}]}
    )  # fmt: skip
    idle = DemandCurve.of([0.0], step_s=HORIZON)
    alone = replace(STATIC, inference_gpus=0)
    result = replay(alone, pools.split(big, 0), workload(), idle, PARAMS, periodic_s=1800.0,
                    book=BOOK)  # fmt: skip

    bound = workload().completable_gpu_seconds(HORIZON) / 3600
    assert get(result, "training", "goodput_gpu_h") == pytest.approx(bound, rel=0.01)
    assert get(result, "training", "queuing", "mean_h") < 0.05


def test_urgent_jobs_are_never_evicted_for_inference() -> None:
    urgent = {j.job_id for j in workload().jobs if j.priority is PriorityClass.P0_URGENT}
    assert urgent
    for policy in (GPUSCHED, KUBERNETES, NO_WAIT):
        result = run(policy)
        assert get(result, "training", "evictions") >= 1
        # Every eviction's usage line ends before its job's last one: p0 has one line each.
        lines: dict[str, int] = {}
        for usage in result.usages:
            lines[usage.job_id] = lines.get(usage.job_id, 0) + 1
        assert all(lines.get(job_id, 0) <= 1 for job_id in urgent)


def test_the_same_inputs_replay_to_the_same_figures() -> None:
    again = replay(
        GPUSCHED, pools.split(CLUSTER, DEDICATED), workload(), DEMAND, PARAMS,
        periodic_s=1800.0, book=BOOK,
    )  # fmt: skip

    assert again.summary == run(GPUSCHED).summary
    assert again.series == run(GPUSCHED).series


def test_the_summary_is_json_without_nan_and_the_goals_compare_with_the_baselines() -> None:
    results = [run(GPUSCHED), run(STATIC), run(KUBERNETES)]
    prepared = Prepared(
        Experiment(traces_dir=__import__("pathlib").Path(".")), CLUSTER, workload(), DEMAND,
        PARAMS, (GPUSCHED, STATIC, KUBERNETES), BOOK,
        {"cluster_gpus": 32, "training_work_bound_gpu_h": 50.0, "training_ceiling_gpu_h": 40.0,
         "gpusched_training_ceiling_gpu_h": 30.0},
    )  # fmt: skip
    comparison = Comparison(prepared, results, {p.name: 1.0 for p in prepared.policies})

    text = report.to_json(report.summary(comparison))

    data = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))
    assert [p["name"] for p in data["policies"]] == ["gpusched", "static split",
                                                     "kubernetes preemption"]  # fmt: skip
    assert set(data["goals"]) == {"slo", "goodput", "queuing", "lost_work"}
    assert data["goals"]["lost_work"]["baseline"] == get(run(KUBERNETES), "training", "lost_gpu_h")
    # The goodput goal is bounded by the lesser of the ceiling and the work bound.
    static_goodput = get(run(STATIC), "training", "goodput_gpu_h")
    goodput = data["goals"]["goodput"]
    assert goodput["at_most_any_policy"] == pytest.approx(40.0 / static_goodput)
    assert goodput["at_most_gpusched_pools"] == pytest.approx(30.0 / static_goodput)
    assert goodput["reachable"] is (40.0 / static_goodput >= 1.3)
    assert "| gpusched |" in report.markdown_table(results)


def test_an_engine_refuses_a_horizon_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match="horizon_s"):
        replace(PARAMS, horizon_s=float("nan"))


def test_the_training_ceiling_is_every_gpu_inference_does_not_need_for_its_slo() -> None:
    params = EngineParams(horizon_s=3 * 3600.0)
    rho = params.latency.highest_rho(params.slo_ms)
    assert params.latency.p99_ms(rho) == pytest.approx(params.slo_ms)
    # An hour idle, an hour needing 10 GPUs at that utilization, an hour needing all 20
    # (whole GPUs: 9.9 GPUs of work at it need 10).
    demand = DemandCurve.of([0.0, 9.9 * rho, 19.9 * rho], step_s=3600.0)

    assert training_ceiling_gpu_h(20, demand, params.horizon_s, params) == pytest.approx(30.0)
    assert params.latency.highest_rho(0.0) == 0.0
    unreachable = replace(params, slo_ms=1.0)  # below the service time itself
    assert training_ceiling_gpu_h(20, demand, params.horizon_s, unreachable) == 0.0
    # A dedicated pool of 15 never trains: 5 + 5 + 0 GPU-hours are left.
    assert training_ceiling_gpu_h(
        20, demand, params.horizon_s, params, dedicated=15
    ) == pytest.approx(10.0)


def test_jobs_never_started_count_in_the_queuing_that_includes_them_at_their_wait() -> None:
    jobs = from_user_rows(
        [
            UserRow("fits", 0.0, 1, 1000, 600.0, PriorityClass.P2_OFFLINE, "lab"),
            # Asks for more GPUs than the cluster has: it waits until the horizon.
            UserRow("huge", 0.0, 64, 1000, 600.0, PriorityClass.P2_OFFLINE, "lab"),
        ],
        seed=1,
    )
    idle = DemandCurve.of([0.0], step_s=HORIZON)
    alone = replace(STATIC, inference_gpus=0)
    result = replay(alone, pools.split(CLUSTER, 0), jobs, idle, PARAMS, periodic_s=1800.0,
                    book=BOOK)  # fmt: skip

    training = result.summary["training"]
    assert isinstance(training, dict)
    assert training["never_started"] == 1
    assert get(result, "training", "queuing", "mean_h") < 0.05
    # The one that started waited ~0, the other the whole day: the mean is half a day.
    assert get(result, "training", "queuing_with_unstarted", "mean_h") == pytest.approx(
        HORIZON / 3600 / 2, abs=0.05
    )
