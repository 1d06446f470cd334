"""`gpusched replay` on the openb default pod list (8,152 pods): every policy on the same
inputs in one run, so each figure has its baseline beside it.

The experiment is the one docs/replay.md declares (compression 5, the openb cluster
scaled so training asks 90% of the static split's shared pool, the diurnal demand with
surges, seed 2023). The baselines are policies of the same run: the static 3:5 split
(no lending) and Kubernetes-native preemption; each ablation is compared with gpusched.

Figures (value, baseline, ratio):
- seconds to replay the 8,152 pods under gpusched (wall clock, and the CPU seconds of
  this process: on a shared machine the wall clock counts others' work too), beside
  the static split's replay (the same pods and passes, no controller, no sagas); goal
  < 30 s;
- inference SLO attainment (share of time), gpusched vs the static split;
- training goodput (GPU-hours), queuing time (mean), gpusched vs the static split;
  beside the static split's goodput, what bounds the goodput goal: the ceiling (GPUs
  inference does not need), the ceiling on gpusched's pools, and the work bound (what
  the jobs can get done by the horizon at all);
- GPU-hours lost to preemption and SLO attainment, gpusched vs Kubernetes preemption;
- for every other policy: its SLO, goodput, lost GPU-hours and evictions beside gpusched's;
- the same experiment under other seeds (the workload's draws and the demand curve), with
  the three policies the goals compare and the base-load pool: each goal's figures per
  seed, so one seed's verdicts can be told from the experiment's (docs/replay.md,
  "Across seeds").

Knobs: BENCH_REPLAY_SEED (2023), BENCH_REPLAY_SEEDS (the other seeds, comma-separated;
"2024,2025,2026,2027", empty for none), BENCH_REPLAY_HTML (a path: also write the report).
"""

from __future__ import annotations

import os
from pathlib import Path

from bench.harness import Context, Figure
from gpusched.infra.settings import Settings
from gpusched.replay import experiment, report
from gpusched.replay.metrics import RunResult

NAME = "replay"
SEED = int(os.environ.get("BENCH_REPLAY_SEED", "2023"))
SEEDS = tuple(
    int(seed)
    for seed in os.environ.get("BENCH_REPLAY_SEEDS", "2024,2025,2026,2027").split(",")
    if seed.strip()
)
# What each other seed replays: the policies the goals compare.
COMPARED = (report.PRIMARY, report.STATIC, report.KUBERNETES, report.BASE_LOAD)
HTML = os.environ.get("BENCH_REPLAY_HTML")


def _get(result: RunResult, *path: str) -> float:
    return report.figure(result, *path)


async def run(ctx: Context) -> list[Figure]:
    prepared = experiment.prepare(
        experiment.Experiment(traces_dir=Settings().traces_dir, seed=SEED)
    )
    ctx.progress(
        f"replay: {len(prepared.workload.jobs)} training jobs, "
        f"{prepared.sizing['cluster_gpus']} GPUs, {len(prepared.policies)} policies"
    )
    comparison = experiment.run(prepared)
    if HTML:
        report.write_html(comparison, Path(HTML))
        ctx.progress(f"replay: report written to {HTML}")
    runs = {r.policy: r for r in comparison.results}
    ours, static, k8s = runs["gpusched"], runs["static split"], runs["kubernetes preemption"]
    pods = (
        len(prepared.workload.jobs)
        + len(prepared.workload.services)
        + sum(prepared.workload.left_out.values())
    )
    figures = [
        Figure(NAME, f"seconds_to_replay_{pods}_pods_gpusched", comparison.seconds["gpusched"],
               "s", comparison.seconds["static split"]),
        Figure(NAME, f"cpu_seconds_to_replay_{pods}_pods_gpusched",
               comparison.cpu_seconds["gpusched"], "s", comparison.cpu_seconds["static split"]),
        Figure(NAME, "slo_time_share_vs_static", _get(ours, "inference", "slo_time_share"),
               "share", _get(static, "inference", "slo_time_share")),
        Figure(NAME, "slo_request_share_vs_static",
               _get(ours, "inference", "slo_request_share"), "share",
               _get(static, "inference", "slo_request_share")),
        Figure(NAME, "goodput_gpu_h_vs_static", _get(ours, "training", "goodput_gpu_h"),
               "GPU-h", _get(static, "training", "goodput_gpu_h")),
        # What any policy could give training at most (sizing's training_ceiling_gpu_h)
        # beside the static split's goodput: the ratio bounds the goodput goal.
        Figure(NAME, "goodput_ceiling_gpu_h_vs_static",
               float(str(prepared.sizing["training_ceiling_gpu_h"])), "GPU-h",
               _get(static, "training", "goodput_gpu_h")),
        # The work the jobs can do by the horizon at all (sizing's
        # training_work_bound_gpu_h), and the ceiling on gpusched's own pools (its
        # dedicated pool never trains): goodput is below both.
        Figure(NAME, "goodput_work_bound_gpu_h_vs_static",
               float(str(prepared.sizing["training_work_bound_gpu_h"])), "GPU-h",
               _get(static, "training", "goodput_gpu_h")),
        Figure(NAME, "goodput_gpusched_ceiling_gpu_h_vs_static",
               float(str(prepared.sizing["gpusched_training_ceiling_gpu_h"])), "GPU-h",
               _get(static, "training", "goodput_gpu_h")),
        Figure(NAME, "queuing_mean_h_vs_static", _get(ours, "training", "queuing", "mean_h"),
               "h", _get(static, "training", "queuing", "mean_h")),
        Figure(NAME, "queuing_with_unstarted_mean_h_vs_static",
               _get(ours, "training", "queuing_with_unstarted", "mean_h"), "h",
               _get(static, "training", "queuing_with_unstarted", "mean_h")),
        Figure(NAME, "jct_mean_h_vs_static", _get(ours, "training", "jct", "mean_h"), "h",
               _get(static, "training", "jct", "mean_h")),
        Figure(NAME, "lost_gpu_h_vs_kubernetes", _get(ours, "training", "lost_gpu_h"), "GPU-h",
               _get(k8s, "training", "lost_gpu_h")),
        Figure(NAME, "slo_time_share_vs_kubernetes", _get(ours, "inference", "slo_time_share"),
               "share", _get(k8s, "inference", "slo_time_share")),
    ]  # fmt: skip
    for name, result in runs.items():
        if name == "gpusched":
            continue
        tag = name.replace(",", "").replace(" ", "_")
        for metric, path, unit in (
            ("slo_time_share", ("inference", "slo_time_share"), "share"),
            ("goodput_gpu_h", ("training", "goodput_gpu_h"), "GPU-h"),
            ("lost_gpu_h", ("training", "lost_gpu_h"), "GPU-h"),
            ("evictions", ("training", "evictions"), "evictions"),
        ):
            # The policy's figure beside gpusched's (ratio: the policy over gpusched).
            figures.append(Figure(NAME, f"{tag}_{metric}", _get(result, *path), unit,
                                  _get(ours, *path)))  # fmt: skip
    for goal, verdict in report.goals(comparison.results, sizing=prepared.sizing).items():
        ctx.progress(f"replay: goal {goal}: {'met' if verdict.get('met') else 'NOT met'}")
    ctx.progress("replay: comparison\n" + report.markdown_table(comparison.results))
    rows = [_seed_row(SEED, comparison)]
    for done, seed in enumerate(SEEDS, 1):
        ctx.progress(f"replay: seed {seed} ({done} of {len(SEEDS)}), {', '.join(COMPARED)}")
        other = experiment.run(
            experiment.prepare(
                experiment.Experiment(traces_dir=Settings().traces_dir, seed=seed, only=COMPARED)
            )
        )
        figures.extend(_seed_figures(seed, other))
        rows.append(_seed_row(seed, other))
    if SEEDS:
        ctx.progress("replay: the goals across seeds\n" + "\n".join(_SEED_HEADER + rows))
    return figures


_SEED_HEADER = [
    "| seed | SLO (time) vs static | goodput vs static (at most) | queuing vs static "
    "| lost GPU-h vs Kubernetes | SLO (time) vs Kubernetes | goals met "
    "| base-load pool: goodput, queuing vs static |",
    "|---|---|---|---|---|---|---|---|",
]


def _seed_figures(seed: int, comparison: experiment.Comparison) -> list[Figure]:
    runs = {r.policy: r for r in comparison.results}
    ours, static, k8s = runs[report.PRIMARY], runs[report.STATIC], runs[report.KUBERNETES]
    small = runs[report.BASE_LOAD]
    bound = min(
        float(str(comparison.prepared.sizing["training_work_bound_gpu_h"])),
        float(str(comparison.prepared.sizing["training_ceiling_gpu_h"])),
    )
    return [
        Figure(NAME, f"seed_{seed}_{metric}", _get(ours, *path), unit, _get(base, *path))
        for metric, path, unit, base in (
            ("slo_time_share_vs_static", ("inference", "slo_time_share"), "share", static),
            ("goodput_gpu_h_vs_static", ("training", "goodput_gpu_h"), "GPU-h", static),
            ("queuing_mean_h_vs_static", ("training", "queuing", "mean_h"), "h", static),
            ("lost_gpu_h_vs_kubernetes", ("training", "lost_gpu_h"), "GPU-h", k8s),
            ("slo_time_share_vs_kubernetes", ("inference", "slo_time_share"), "share", k8s),
        )
    ] + [
        # The dedicated pool at the base load, beside the static split: what a smaller
        # dedicated pool gives training under this seed.
        Figure(NAME, f"seed_{seed}_base_load_{metric}", _get(small, *path), unit,
               _get(static, *path))
        for metric, path, unit in (
            ("goodput_gpu_h_vs_static", ("training", "goodput_gpu_h"), "GPU-h"),
            ("queuing_mean_h_vs_static", ("training", "queuing", "mean_h"), "h"),
            ("slo_time_share_vs_static", ("inference", "slo_time_share"), "share"),
        )
    ] + [
        Figure(NAME, f"seed_{seed}_goodput_bound_gpu_h_vs_static", bound, "GPU-h",
               _get(static, "training", "goodput_gpu_h")),
    ]  # fmt: skip


def _seed_row(seed: int, comparison: experiment.Comparison) -> str:
    goals = report.goals(comparison.results, sizing=comparison.prepared.sizing)

    def of(goal: str, key: str) -> float:
        value = goals[goal][key]
        assert isinstance(value, int | float), (goal, key, value)
        return float(value)

    met = [name for name, verdict in goals.items() if verdict.get("met")]
    small = report.goals(comparison.results, primary=report.BASE_LOAD)
    return (
        f"| {seed} | {of('slo', 'value'):.3%} vs {of('slo', 'baseline'):.3%} "
        f"| {of('goodput', 'ratio'):.2f}x ({of('goodput', 'at_most_any_policy'):.2f}x) "
        f"| {of('queuing', 'value'):.2f} h vs {of('queuing', 'baseline'):.2f} h "
        f"| {of('lost_work', 'value'):.2f} vs {of('lost_work', 'baseline'):.2f} "
        f"({of('lost_work', 'lower_share'):.1%} lower) "
        f"| {of('lost_work', 'slo'):.3%} vs {of('lost_work', 'baseline_slo'):.3%} "
        f"| {', '.join(met) or 'none'} "
        f"| {small['goodput']['ratio']:.2f}x, {small['queuing']['value']:.2f} h "
        f"({small['queuing']['ratio']:.2f}x shorter) |"
    )
