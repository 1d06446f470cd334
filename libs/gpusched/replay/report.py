"""The replay's outputs: a JSON summary, and an HTML report with plots (the only module
of the replay that writes files). The report is one self-contained file: the plots are
PNGs inlined as data URIs, so it opens in any browser without a server.

matplotlib is an optional dependency (the ``replay`` extra); the JSON summary needs none.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .experiment import Comparison
from .metrics import RunResult

__all__ = [
    "GOALS",
    "TABLE",
    "figure",
    "goals",
    "markdown_table",
    "summary",
    "to_json",
    "write_html",
    "write_json",
]

PRIMARY = "gpusched"
STATIC = "static split"
KUBERNETES = "kubernetes preemption"
BASE_LOAD = "gpusched, base-load pool"
# The goals, against the baselines of the same run.
GOALS = {
    "slo": "inference SLO attainment >= 99.9% and >= the static split's",
    "goodput": "training goodput >= 1.3x the static split's",
    "queuing": "training queuing time (mean) <= 1/1.5 of the static split's",
    "lost_work": "GPU-hours lost >= 90% lower than Kubernetes preemption, at equal or better SLO",
}


def figure(result: RunResult, *path: str) -> float:
    """One number of a run's summary, by its path (``"training", "lost_gpu_h"``)."""
    value: Any = result.summary
    for key in path:
        value = value[key]
    return float(value)


def _by_name(results: Sequence[RunResult]) -> dict[str, RunResult]:
    return {result.policy: result for result in results}


def goals(
    results: Sequence[RunResult],
    primary: str = PRIMARY,
    sizing: Mapping[str, object] | None = None,
) -> dict[str, dict[str, object]]:
    """Each goal: the figures it compares and whether it is met (None: a policy missing).
    With the experiment's ``sizing``, the goodput goal also says how much more than the
    static split any policy could give training at most, and whether 1.3x is within it."""
    runs = _by_name(results)
    out: dict[str, dict[str, object]] = {}
    ours, static, k8s = runs.get(primary), runs.get(STATIC), runs.get(KUBERNETES)
    if ours is None:
        return out
    slo = figure(ours, "inference", "slo_time_share")
    if static is not None:
        static_slo = figure(static, "inference", "slo_time_share")
        out["slo"] = {
            "value": slo,
            "baseline": static_slo,
            "met": slo >= 0.999 and slo >= static_slo,
        }
        good, base = (
            figure(ours, "training", "goodput_gpu_h"),
            figure(static, "training", "goodput_gpu_h"),
        )
        ratio = good / base if base else math.nan
        out["goodput"] = {
            "value": good,
            "baseline": base,
            "ratio": ratio,
            **_goodput_bounds(sizing, base, primary),
            "met": ratio >= 1.3,
        }
        wait = figure(ours, "training", "queuing", "mean_h")
        base_wait = figure(static, "training", "queuing", "mean_h")
        better = base_wait / wait if wait else math.inf
        out["queuing"] = {
            "value": wait,
            "baseline": base_wait,
            "ratio": better,
            # The same with the jobs never started at their wait so far (the goal is
            # judged on the declared figure; this one shows what it leaves out).
            "value_with_unstarted": figure(ours, "training", "queuing_with_unstarted", "mean_h"),
            "baseline_with_unstarted": figure(
                static, "training", "queuing_with_unstarted", "mean_h"
            ),
            "met": better >= 1.5,
        }
    if k8s is not None:
        lost, base_lost = (
            figure(ours, "training", "lost_gpu_h"),
            figure(k8s, "training", "lost_gpu_h"),
        )
        lower = 1 - lost / base_lost if base_lost else math.nan
        k8s_slo = figure(k8s, "inference", "slo_time_share")
        out["lost_work"] = {
            "value": lost,
            "baseline": base_lost,
            "lower_share": lower,
            "slo": slo,
            "baseline_slo": k8s_slo,
            "met": lower >= 0.9 and slo >= k8s_slo,
        }
    return out


def _goodput_bounds(
    sizing: Mapping[str, object] | None, base: float, primary: str
) -> dict[str, object]:
    """The most goodput, over the static split's, that any policy (and the primary
    policy, on its dedicated pool) could reach: the lesser of the training ceiling (the
    GPUs inference does not need) and the work the jobs can do by the horizon at all."""
    if sizing is None or not base:
        return {}
    work = sizing.get("training_work_bound_gpu_h")
    ceiling = sizing.get("training_ceiling_gpu_h")
    if not isinstance(work, int | float) or not isinstance(ceiling, int | float):
        return {}
    out: dict[str, object] = {"at_most_any_policy": min(work, ceiling) / base}
    own = sizing.get("gpusched_training_ceiling_gpu_h")
    if primary == PRIMARY and isinstance(own, int | float):
        out["at_most_gpusched_pools"] = min(work, own) / base
    out["reachable"] = min(work, ceiling) / base >= 1.3
    return out


def summary(comparison: Comparison) -> dict[str, Any]:
    prepared = comparison.prepared
    return {
        "experiment": prepared.experiment.describe(),
        "workload": prepared.workload.describe(),
        "sizing": prepared.sizing,
        "policies": [
            {
                **policy.describe(),
                "seconds": round(comparison.seconds[policy.name], 2),
                "cpu_seconds": round(comparison.cpu_seconds.get(policy.name, math.nan), 2),
                "results": result.summary,
            }
            for policy, result in zip(prepared.policies, comparison.results, strict=True)
        ],
        "goals": {
            name: {"goal": GOALS[name], **figures}
            for name, figures in goals(comparison.results, sizing=prepared.sizing).items()
        },
    }


def _clean(value: object) -> object:
    """JSON has no NaN: a figure that could not be measured is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def to_json(data: dict[str, Any]) -> str:
    return json.dumps(_clean(data), indent=2, sort_keys=False)


def write_json(comparison: Comparison, path: Path) -> dict[str, Any]:
    data = summary(comparison)
    path.write_text(to_json(data) + "\n", encoding="utf-8")
    return data


# --- the HTML report ------------------------------------------------------------------

TABLE = (
    ("policy", None, ""),
    ("SLO (time)", ("inference", "slo_time_share"), "pct"),
    ("SLO (requests)", ("inference", "slo_request_share"), "pct"),
    ("queuing mean h", ("training", "queuing", "mean_h"), "f2"),
    ("queuing p99 h", ("training", "queuing", "p99_h"), "f2"),
    ("queuing mean h, unstarted too", ("training", "queuing_with_unstarted", "mean_h"), "f2"),
    ("JCT mean h", ("training", "jct", "mean_h"), "f2"),
    ("JCT p50 h", ("training", "jct", "p50_h"), "f2"),
    ("JCT p99 h", ("training", "jct", "p99_h"), "f2"),
    ("goodput GPU-h", ("training", "goodput_gpu_h"), "f1"),
    ("lost GPU-h", ("training", "lost_gpu_h"), "f2"),
    ("evictions", ("training", "evictions"), "int"),
    ("forced", ("training", "forced_evictions"), "int"),
    ("completed", ("training", "completed"), "int"),
    ("never started", ("training", "never_started"), "int"),
    ("allocated", ("cluster", "allocated_share_mean"), "pct"),
    ("fragmented GPUs", ("cluster", "fragmented_gpus_mean"), "f1"),
    ("cost", ("cost", "total"), "str"),
    ("credits", ("cost", "credits"), "str"),
)


def _cell(value: object, how: str) -> str:
    if how == "str":
        return str(value)
    number = float(value)  # type: ignore[arg-type]
    if not math.isfinite(number):
        return "-"
    if how == "pct":
        return f"{100 * number:.3f}%"
    if how == "int":
        return f"{int(number)}"
    return f"{number:.{how[1:]}f}"


def table_rows(results: Sequence[RunResult]) -> list[list[str]]:
    rows = []
    for result in results:
        row = [result.policy]
        for _, path, how in TABLE[1:]:
            value: Any = result.summary
            for key in path or ():
                value = value[key]
            row.append(_cell(value, how))
        rows.append(row)
    return rows


def markdown_table(results: Sequence[RunResult]) -> str:
    """The comparison as a Markdown table (README, docs)."""
    header = [name for name, _, _ in TABLE]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    return "\n".join(lines)


def _png(fig: Any) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def plots(results: Sequence[RunResult]) -> list[tuple[str, str]]:
    """(title, PNG base64) of each plot; needs matplotlib (the ``replay`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    shown = [r for r in results if r.policy in (PRIMARY, STATIC, KUBERNETES)] or list(results)
    out: list[tuple[str, str]] = []

    def each(title: str, series: str, ylabel: str, among: Sequence[RunResult]) -> None:
        fig, axes = plt.subplots(figsize=(11, 3.2))
        for result in among:
            axes.plot(result.series["t_h"], result.series[series], label=result.policy, lw=1)
        axes.set_xlabel("hours")
        axes.set_ylabel(ylabel)
        axes.set_title(title)
        axes.legend(loc="upper left", fontsize="small")
        out.append((title, _png(fig)))
        plt.close(fig)

    fig, axes = plt.subplots(figsize=(11, 3.6))
    first = shown[0]
    axes.plot(first.series["t_h"], first.series["demand"], color="black", lw=1, label="demand")
    axes.plot(
        first.series["t_h"],
        [d / 0.85 for d in first.series["demand"]],
        color="gray",
        lw=0.8,
        ls="--",
        label="GPUs for P99 at the SLO (demand / 0.85)",
    )
    for result in shown:
        axes.plot(
            result.series["t_h"],
            result.series["serving"],
            lw=1,
            label=f"serving GPUs: {result.policy}",
        )
    axes.set_xlabel("hours")
    axes.set_ylabel("GPUs")
    axes.set_title("Inference: demand and serving GPUs (pool sizes and lending)")
    axes.legend(loc="upper left", fontsize="small")
    out.append(("Inference: demand and serving GPUs", _png(fig)))
    plt.close(fig)
    each("GPUs lent to inference", "lent", "GPUs", shown)
    each("Training queue length", "queued", "jobs", results)
    each("Training GPU-hours lost to preemption (cumulative)", "lost_gpu_h", "GPU-hours", results)
    each("Shared pool allocated", "allocated_share", "share", shown)
    each(
        "Fragmented GPUs (free on partly used nodes, below an 8-GPU gang)",
        "fragmented",
        "GPUs",
        shown,
    )

    names = [r.policy for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (label, path) in zip(
        axes,
        (
            ("SLO attainment (time)", ("inference", "slo_time_share")),
            ("goodput GPU-h", ("training", "goodput_gpu_h")),
            ("lost GPU-h", ("training", "lost_gpu_h")),
        ),
        strict=True,
    ):
        ax.barh(names, [figure(r, *path) for r in results])
        ax.set_title(label)
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    out.append(("Policy comparison", _png(fig)))
    plt.close(fig)
    return out


def write_html(comparison: Comparison, path: Path, data: dict[str, Any] | None = None) -> None:
    data = data if data is not None else summary(comparison)
    results = comparison.results
    esc = html.escape
    header = "".join(f"<th>{esc(name)}</th>" for name, _, _ in TABLE)
    rows = "".join(
        "<tr>" + "".join(f"<td>{esc(cell)}</td>" for cell in row) + "</tr>"
        for row in table_rows(results)
    )
    goal_rows = "".join(
        f"<tr><td>{esc(str(g['goal']))}</td><td>{_verdict(g.get('met'))}</td>"
        f"<td><code>{esc(json.dumps(_clean(_figures(g))))}</code></td></tr>"
        for g in data["goals"].values()
    )
    figures = "".join(
        f'<figure><img alt="{esc(title)}" src="data:image/png;base64,{png}">'
        f"<figcaption>{esc(title)}</figcaption></figure>"
        for title, png in plots(results)
    )
    params = esc(to_json({k: data[k] for k in ("experiment", "workload", "sizing")}))
    policies = esc(
        to_json(
            {"policies": [{k: v for k, v in p.items() if k != "results"} for p in data["policies"]]}
        )
    )
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>gpusched replay</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; font-size: 0.85em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
figure {{ margin: 1.5em 0; }} img {{ max-width: 100%; }}
pre {{ background: #f6f6f6; padding: 1em; overflow-x: auto; font-size: 0.8em; }}
</style></head><body>
<h1>gpusched replay</h1>
<p>Every policy replayed the same workload, cluster and inference demand on a virtual
clock, with the decision code the services run. Definitions: SLO attained while the
serving GPUs keep P99 within {esc(str(comparison.prepared.params.slo_ms))} ms (the
simulated cluster's latency model); queuing is submit to first start, JCT submit to
completion; goodput is training GPU-hours that counted toward completion; lost is the
work since the newest checkpoint when a job was evicted.</p>
<h2 id="comparison">Policy comparison</h2>
<table id="comparison-table"><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>
<h2 id="goals">Goals</h2>
<table id="goals-table"><thead><tr><th>goal</th><th>met</th><th>figures</th></tr></thead>
<tbody>{goal_rows}</tbody></table>
<h2 id="plots">Over time</h2>
{figures}
<h2 id="parameters">Parameters</h2>
<pre>{params}</pre>
<pre>{policies}</pre>
<script>
// Lets a headless browser tell that every plot decoded (body data-images-loaded).
window.addEventListener("load", () => {{
  const shown = Array.from(document.images).filter((img) => img.naturalWidth > 0);
  document.body.dataset.imagesLoaded = String(shown.length);
}});
</script>
</body></html>
"""
    path.write_text(page, encoding="utf-8")


def _figures(goal: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in goal.items() if k not in ("goal", "met")}


def _verdict(met: object) -> str:
    if met is None:
        return "-"
    return "met" if met else "<strong>not met</strong>"
