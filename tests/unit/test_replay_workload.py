"""The replay's inputs without I/O beyond tmp files: the rule that turns openb pods into
jobs and services, the user's CSV, the demand curve, and the pools of each policy."""

from __future__ import annotations

import math
import re
import typing
from dataclasses import replace
from pathlib import Path

import pytest

from gpusched.cli.replay import replay
from gpusched.domain.inventory import Pool, parse_inventory
from gpusched.domain.ledger import PriorityClass
from gpusched.replay import pools, traces
from gpusched.replay.demand import DemandCurve, DemandParams, daily_peaks, diurnal
from gpusched.replay.experiment import Experiment, prepare
from gpusched.replay.workload import (
    CheckpointParams,
    TracePod,
    UserRow,
    WorkloadError,
    from_openb,
    from_user_rows,
)


def pod(name: str, qos: str, gpus: int = 1, milli: int = 1000, created: float = 0.0,
        ran: float | None = 600.0) -> TracePod:  # fmt: skip
    scheduled = None if ran is None else created
    deletion = created + (ran if ran is not None else 125.0)
    return TracePod(name, gpus, milli, qos, created, deletion, scheduled)


def test_openb_pods_become_services_and_training_by_their_qos() -> None:
    pods = [
        pod("a", "LS", milli=460),
        pod("b", "BE", milli=300, created=100),
        pod("c", "Burstable", gpus=8, created=200),
        pod("d", "Guaranteed", created=300),
        pod("e", "BE", gpus=0, created=400),
        pod("f", "Weird", created=500),
    ]

    workload = from_openb(pods, [1000.0], compression=1.0, seed=1, window_quantile=0.0)

    assert [(s.name, s.weight) for s in workload.services] == [("a", 0.46)]
    assert [(j.name, j.priority, j.gpus, j.milli) for j in workload.jobs] == [
        ("b", PriorityClass.P2_OFFLINE, 1, 300),
        ("c", PriorityClass.P1_NORMAL, 8, 1000),
        ("d", PriorityClass.P0_URGENT, 1, 1000),
    ]
    assert workload.left_out == {"no GPU (host CPU and memory only)": 1, "unknown qos 'Weird'": 1}


def test_arrivals_are_compressed_and_run_times_kept() -> None:
    pods = [pod("a", "BE", created=1000, ran=50), pod("b", "BE", created=11_000, ran=70)]

    workload = from_openb(pods, [1.0], compression=10.0, seed=1, window_quantile=0.0)

    assert [(j.arrival_s, j.work_s) for j in workload.jobs] == [(0.0, 50.0), (1000.0, 70.0)]


def test_a_pod_never_scheduled_runs_for_a_philly_run_time_drawn_by_the_seed() -> None:
    pods = [pod(f"p{i}", "BE", created=i, ran=None) for i in range(20)]
    philly = [0.0, 111.0, 222.0, 333.0, math.nan]

    first = from_openb(pods, philly, compression=1.0, seed=7)
    second = from_openb(pods, philly, compression=1.0, seed=7)

    assert {j.work_s for j in first.jobs} <= {111.0, 222.0, 333.0}
    assert [j.work_s for j in first.jobs] == [j.work_s for j in second.jobs]
    assert all(j.source == "philly" for j in first.jobs)


def test_a_pod_list_without_training_is_refused_in_words() -> None:
    with pytest.raises(WorkloadError, match="no training pod"):
        from_openb([pod("a", "LS")], [1.0], compression=1.0, seed=1)
    with pytest.raises(WorkloadError, match="compression"):
        from_openb([pod("a", "BE")], [1.0], compression=math.nan, seed=1)


def test_checkpoint_times_grow_with_the_job_and_a_share_is_slow() -> None:
    params = CheckpointParams(slow_share=0.5)
    rows = [UserRow(f"r{i}", i, 1 + i % 8, 1000, 100, PriorityClass.P1_NORMAL, "t")
            for i in range(200)]  # fmt: skip

    jobs = from_user_rows(rows, seed=3, checkpoints=params).jobs

    slow = [j for j in jobs if j.persist_s == params.slow_persist_s]
    assert 60 < len(slow) < 140
    for job in jobs:
        if job not in slow:
            assert job.persist_s == 60 + 20 * job.gpus and job.snapshot_s == 15


def test_a_user_csv_is_read_and_bad_values_are_named(tmp_path: Path) -> None:
    good = tmp_path / "month.csv"
    good.write_text(
        "name,arrival_s,gpus,gpu_milli,run_s,class,team\n"
        "chat,0,2,,0,inference,web\n"
        "train,10,4,,3600,p1-normal,vision\n"
        "notebook,20,1,250,600,p2-offline,\n"
    )
    workload = from_user_rows(traces.read_user_csv(good), seed=1)
    assert [(j.name, j.team, j.gpus, j.milli) for j in workload.jobs] == [
        ("train", "vision", 4, 1000),
        ("notebook", "default", 1, 250),
    ]
    assert [(s.name, s.weight) for s in workload.services] == [("chat", 2.0)]

    for body, words in (
        ("name,arrival_s,gpus,run_s\nx,0,1,1\n", "missing column"),
        ("name,arrival_s,gpus,run_s,class\nx,NaN,1,1,p1-normal\n", "arrival_s must be"),
        ("name,arrival_s,gpus,run_s,class\nx,-5,1,1,p1-normal\n", "arrival_s must be"),
        ("name,arrival_s,gpus,run_s,class\nx,0,1,1e400,p1-normal\n", "run_s must be"),
        ("name,arrival_s,gpus,run_s,class\nx,0,one,1,p1-normal\n", "gpus is not a whole"),
        ("name,arrival_s,gpus,run_s,class\nx,0,1,1,p9\n", "class 'p9' is not one of"),
        ("name,arrival_s,gpus,gpu_milli,run_s,class\nx,0,2,500,1,p1-normal\n", "a fraction"),
        ("name,arrival_s,gpus,run_s,class\n", "no rows"),
        ("name,arrival_s,gpus,run_s,class\nx,1e12,1,1,p1-normal\n", "over ten years"),
        ("name,arrival_s,gpus,run_s,class\nx,0,5000,1,p1-normal\n", "within 1..1024"),
    ):
        bad = tmp_path / "bad.csv"
        bad.write_text(body)
        with pytest.raises(traces.TraceError, match=words):
            traces.read_user_csv(bad)

    binary = tmp_path / "binary.csv"
    binary.write_bytes(b"name,arrival_s,gpus,run_s,class\nx,0,1,1,p1-normal\n\xff\xfe\n")
    with pytest.raises(traces.TraceError, match=r"binary.csv: not UTF-8 text \(byte 0xff"):
        traces.read_user_csv(binary)
    huge = tmp_path / "huge.csv"
    huge.write_text("name,arrival_s,gpus,run_s,class\n" + "x" * 200_000 + ",0,1,1,p1-normal\n")
    with pytest.raises(traces.TraceError, match=r"huge.csv: not a CSV file \(field larger"):
        traces.read_user_csv(huge)
    for reader in (traces.read_inventory, traces.read_price_book):
        with pytest.raises(traces.TraceError, match=r"binary.csv: not UTF-8 text"):
            reader(binary)


def test_a_missing_traces_folder_says_how_to_get_the_traces(tmp_path: Path) -> None:
    with pytest.raises(traces.TraceError, match=r"README\.md 'Cluster traces'"):
        traces.TraceFiles(tmp_path / "nowhere").check()


def test_the_demand_peaks_at_its_hour_and_falls_to_its_trough() -> None:
    params = DemandParams(peak_gpus=100.0, trough=0.4, surges_per_day=0, noise=0)

    assert diurnal(params, 14 * 3600) == pytest.approx(100.0)
    assert diurnal(params, 2 * 3600) == pytest.approx(40.0)
    assert diurnal(params, 38 * 3600) == pytest.approx(100.0)


def test_surges_raise_the_demand_and_the_same_seed_gives_the_same_curve() -> None:
    calm = DemandCurve(DemandParams(100.0, surges_per_day=0, noise=0), 7 * 86_400, seed=5)
    stormy = DemandCurve(DemandParams(100.0, surges_per_day=3, noise=0), 7 * 86_400, seed=5)
    again = DemandCurve(DemandParams(100.0, surges_per_day=3, noise=0), 7 * 86_400, seed=5)

    assert stormy.values == again.values
    assert stormy.surges and max(daily_peaks(stormy)) > max(daily_peaks(calm)) * 1.15
    assert all(s >= c for s, c in zip(stormy.values, calm.values, strict=True))
    assert min(stormy.values) >= 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_a_demand_curve_refuses_a_peak_that_is_not_a_number(bad: float) -> None:
    with pytest.raises(ValueError, match="peak_gpus"):
        DemandParams(peak_gpus=bad)


INVENTORY = parse_inventory(
    {
        "nodes": [
            {"name_prefix": "a", "count": 6, "pool": "shared", "gpu_model": "T4", "gpus": 8,
             "cpu_milli": 64000, "memory_mib": 262144},
            {"name_prefix": "b", "count": 4, "pool": "shared", "gpu_model": "P100", "gpus": 2,
             "cpu_milli": 32000, "memory_mib": 131072},
        ]
    }
)  # fmt: skip


def test_a_split_dedicates_whole_nodes_of_every_model_close_to_the_share() -> None:
    split = pools.split(INVENTORY, 21)

    inference = [n for n in split.nodes if n.pool is Pool.INFERENCE]
    assert split.gpus_in(Pool.INFERENCE) in (20, 22)
    assert {n.gpus[0].model for n in inference} == {"T4", "P100"}
    assert split.gpus_in(Pool.INFERENCE) + split.gpus_in(Pool.SHARED) == 56
    assert pools.split(INVENTORY, 0).gpus_in(Pool.INFERENCE) == 0
    with pytest.raises(ValueError, match="cannot dedicate"):
        pools.split(INVENTORY, 57)


def test_a_sample_keeps_the_mix_of_models_and_node_sizes() -> None:
    half = pools.sample(INVENTORY, 0.5)

    assert [n.name for n in half.nodes] == ["a-00", "a-02", "a-04", "b-00", "b-02"]
    assert pools.sample(INVENTORY, 0.01).nodes == ()
    # One node of the most common kind (6 T4 nodes); 1/6 of the 4 P100 nodes rounds to 1.
    assert pools.smallest_share(INVENTORY) == pytest.approx(1 / 6)
    assert [n.name for n in pools.sample(INVENTORY, 1 / 6).nodes] == ["a-00", "b-00"]


def test_a_workload_too_small_for_any_node_says_what_to_give(tmp_path: Path) -> None:
    nodes = tmp_path / "traces" / "alibaba-gpu-v2023" / "openb_node_list_gpu_node.csv"
    nodes.parent.mkdir(parents=True)
    nodes.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\n"
        + "".join(f"n-{i},64000,262144,8,T4\n" for i in range(40))
    )
    tiny = tmp_path / "tiny.csv"
    tiny.write_text("name,arrival_s,gpus,run_s,class\nx,0,1,100,p2-offline\n")

    experiment = Experiment(traces_dir=tmp_path / "traces", csv=tiny)
    with pytest.raises(traces.TraceError, match=r"keeps none.*--node-share 0.025 or more"):
        prepare(experiment)
    assert prepare(replace(experiment, node_share=0.025)).inventory.total_gpus == 8


def test_a_measured_demand_is_read_step_by_step(tmp_path: Path) -> None:
    demand = tmp_path / "demand.csv"
    demand.write_text("t_s,gpus\n0,1.5\n300,2\n600,0\n")

    assert traces.read_demand_csv(demand) == ([1.5, 2.0, 0.0], 300.0)
    # As a spreadsheet exports it: a byte-order mark and CRLF line ends.
    demand.write_bytes(b"\xef\xbb\xbft_s,gpus\r\n0,1.5\r\n300,2\r\n")
    assert traces.read_demand_csv(demand) == ([1.5, 2.0], 300.0)


@pytest.mark.parametrize(
    ("rows", "error"),
    [
        ("0,1\n", r"at least two rows"),
        ("5,1\n65,1\n", r"line 2: the first t_s must be 0, got 5"),
        ("0,1\n60,1\n100,1\n", r"line 4: t_s 100 breaks the step of 60 s"),
        ("0,1\n60,1\n60,1\n", r"line 4: t_s must increase, got 60 after 60"),
        ("0,1\n60,NaN\n", r"line 3: gpus must be a finite number >= 0, got 'NaN'"),
        ("0,1\n60,-2\n", r"line 3: gpus must be a finite number >= 0"),
        ("0,1\n60,1e9\n", r"line 3: gpus 1e\+09 is more than any cluster"),
        ("0,1\n1e12,1\n", r"line 3: t_s 1e\+12 s is over ten years"),
        ("0,1\n60,x\n", r"line 3: gpus is not a number: 'x'"),
    ],
)
def test_a_bad_demand_row_is_named_with_what_to_give(tmp_path: Path, rows: str, error: str) -> None:
    demand = tmp_path / "demand.csv"
    demand.write_text("t_s,gpus\n" + rows)

    with pytest.raises(traces.TraceError, match=error):
        traces.read_demand_csv(demand)


def test_a_demand_of_more_steps_than_a_replay_visits_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(traces, "MAX_DEMAND_STEPS", 3)
    demand = tmp_path / "demand.csv"
    demand.write_text("t_s,gpus\n0,1\n1,1\n2,1\n3,1\n")

    with pytest.raises(traces.TraceError, match=r"line 5: more than 3 steps .* coarser step"):
        traces.read_demand_csv(demand)


def _own_cluster(tmp_path: Path, demand_rows: int) -> Experiment:
    jobs = tmp_path / "jobs.csv"
    jobs.write_text(
        "name,arrival_s,gpus,run_s,class\n"
        + "".join(f"j{i},{i * 600},1,3600,p2-offline\n" for i in range(12))
    )
    inventory = tmp_path / "cluster.yaml"
    inventory.write_text(
        "nodes:\n  - name_prefix: n\n    count: 4\n    pool: shared\n    gpu_model: T4\n"
        "    gpus: 4\n    cpu_milli: 64000\n    memory_mib: 262144\n"
    )
    demand = tmp_path / "demand.csv"
    demand.write_text("t_s,gpus\n" + "".join(f"{k * 60},{1 + k % 4}\n" for k in range(demand_rows)))
    return Experiment(traces_dir=tmp_path, csv=jobs, inventory=inventory, demand=demand)


def test_a_measured_demand_sizes_the_pools_and_a_given_dedicated_pool_overrides_the_rule(
    tmp_path: Path,
) -> None:
    experiment = _own_cluster(tmp_path, demand_rows=200)

    prepared = prepare(experiment)
    assert prepared.demand.values[:5] == (1.0, 2.0, 3.0, 4.0, 1.0)
    # Shorter than a day: its peak is the daily peak DESIGN's rule sizes from.
    assert prepared.sizing["gpusched_inference_gpus"] == 4  # 4 GPUs of work: a node
    assert str(prepared.sizing["gpusched_inference_gpus_rule"]).startswith("DESIGN")
    assert prepared.sizing["demand"] == {
        "measured": "demand.csv",
        "peak_gpus": 4.0,
        "step_s": 60.0,
        "hours": 3.33,
    }
    given = prepare(replace(experiment, dedicated_gpus=8, static_share=0.5))
    assert given.sizing["gpusched_inference_gpus"] == 8
    assert given.sizing["static_inference_gpus"] == 8
    assert [p.inference_gpus for p in given.policies if p.name == "gpusched"] == [8]
    with pytest.raises(ValueError, match=r"dedicated pool of 17 GPUs is not within .* 0\.\.16"):
        prepare(replace(experiment, dedicated_gpus=17))
    with pytest.raises(ValueError, match=r"static share must be within \(0, 1\)"):
        prepare(replace(experiment, static_share=1.0))


def test_a_measured_demand_shorter_than_the_arrivals_is_refused(tmp_path: Path) -> None:
    experiment = _own_cluster(tmp_path, demand_rows=60)  # 1 h, arrivals over 1.8 h

    with pytest.raises(traces.TraceError, match=r"covers 1.0 h of demand, .* arrivals 1.8 h"):
        prepare(experiment)


def test_the_replay_commands_help_states_the_experiments_own_defaults() -> None:
    # The options default to None so that the experiment's defaults apply; their help
    # states those defaults in brackets, which must not drift from the dataclasses.
    hints = typing.get_type_hints(replay, include_extras=True)
    helps = {name: hint.__metadata__[0].help for name, hint in hints.items() if name != "return"}
    checkpoints, experiment = CheckpointParams(), Experiment(traces_dir=Path("."))
    expected = {
        "trough": experiment.trough,
        "surges_per_day": experiment.surges_per_day,
        "static_share": experiment.static_share,
        "checkpoint_every": checkpoints.periodic_s,
        "snapshot_s": checkpoints.snapshot_s,
        "persist_s": checkpoints.persist_base_s,
        "persist_per_gpu_s": checkpoints.persist_per_gpu_s,
        "slow_share": checkpoints.slow_share,
        "slow_persist_s": checkpoints.slow_persist_s,
    }
    for name, default in expected.items():
        found = re.search(r"\(([\d.]+)\)$", helps[name])
        assert found is not None, (name, helps[name])
        assert float(found.group(1)) == pytest.approx(default), name
