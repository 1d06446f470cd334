"""`gpusched replay`: what gpusched would have done with a cluster's past, beside a static
split and Kubernetes-native preemption. No stack needed: the replay runs the decision
code in this process on a virtual clock (docs/replay.md).

It reads the traces folder (``GPUSCHED_TRACES_DIR`` or ``--traces``), or a CSV of your
own (``--csv``), prints the comparison (``-o json``: the summary) and, with ``--html``,
writes the report with its plots.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from gpusched.cli.errors import BadInput
from gpusched.cli.numbers import number_option
from gpusched.cli.output import Format

if TYPE_CHECKING:
    from gpusched.replay.experiment import Comparison, Experiment


def register(app: typer.Typer) -> None:
    app.command(
        "replay",
        help="Replay a trace under gpusched and its baselines; print the comparison.",
    )(replay)


def replay(
    traces: Annotated[
        Path | None,
        typer.Option(help="the traces folder (default: GPUSCHED_TRACES_DIR, ../shared/traces)"),
    ] = None,
    pod_list: Annotated[str, typer.Option(help="openb pod list name")] = "openb_pod_list_default",
    csv: Annotated[
        Path | None, typer.Option(help="your own workload as CSV instead (docs/replay.md)")
    ] = None,
    inventory: Annotated[
        Path | None, typer.Option(help="your own inventory (YAML) instead of openb's nodes")
    ] = None,
    compression: Annotated[
        float, number_option(0.001, 1e6, "arrivals this many times sooner (0.001-1e6)")
    ] = 5.0,
    load: Annotated[
        float, number_option(0.01, 2.0, "training demand over the static partition (0.01-2)")
    ] = 0.9,
    node_share: Annotated[
        float | None,
        number_option(1e-4, 1.0, "share of openb nodes, 0.0001-1 (default: by load)"),
    ] = None,
    seed: Annotated[int, typer.Option(min=0, max=2**31, help="seed of every draw")] = 2023,
    demand: Annotated[
        Path | None,
        typer.Option(
            help="your inference demand as CSV (t_s,gpus: GPUs of work per step, "
            "docs/replay.md) instead of the drawn curve",
        ),
    ] = None,
    # The options below default to None: the experiment's own defaults apply
    # (replay.experiment.Experiment, replay.workload.CheckpointParams).
    trough: Annotated[
        float | None, number_option(0.0, 1.0, "drawn demand: night over day, 0-1 (0.4)")
    ] = None,
    surges_per_day: Annotated[
        float | None, number_option(0.0, 100.0, "drawn demand: surges a day, 0-100 (1)")
    ] = None,
    static_share: Annotated[
        float | None,
        number_option(0.01, 0.99, "the static split's inference share of the GPUs (0.375)"),
    ] = None,
    dedicated_gpus: Annotated[
        int | None,
        typer.Option(
            min=0,
            max=10_000_000,
            help="gpusched's dedicated inference pool in GPUs (default: DESIGN's rule, "
            "the P95 of the daily peak load)",
        ),
    ] = None,
    checkpoint_every: Annotated[
        float | None, number_option(1.0, 1e7, "seconds between periodic checkpoints (1800)")
    ] = None,
    snapshot_s: Annotated[
        float | None,
        number_option(0.001, 1e6, "seconds to a snapshot in host memory, on eviction (15)"),
    ] = None,
    persist_s: Annotated[
        float | None,
        number_option(0.001, 1e6, "seconds to a durable checkpoint, + --persist-per-gpu-s (60)"),
    ] = None,
    persist_per_gpu_s: Annotated[
        float | None,
        number_option(0.0, 1e6, "seconds more per GPU of the job to a durable checkpoint (20)"),
    ] = None,
    slow_share: Annotated[
        float | None,
        number_option(0.0, 1.0, "share of jobs whose durable checkpoint is slow (0.05)"),
    ] = None,
    slow_persist_s: Annotated[
        float | None,
        number_option(0.001, 1e6, "seconds to a durable checkpoint for those jobs (600)"),
    ] = None,
    policy: Annotated[
        list[str] | None, typer.Option(help="replay only this policy (repeatable)")
    ] = None,
    html: Annotated[Path | None, typer.Option(help="write the HTML report with plots here")] = None,
    json_out: Annotated[
        Path | None, typer.Option("--json", help="write the JSON summary here")
    ] = None,
    fmt: Annotated[Format, typer.Option("-o", "--output")] = Format.TABLE,
) -> int:
    from gpusched.cli.session import load_settings
    from gpusched.replay.traces import TraceError, TraceFiles

    settings = load_settings()
    root = traces if traces is not None else settings.traces_dir
    for out in (json_out, html):
        if out is not None:
            # Said now, not after minutes of replay.
            _check_writable(out)
    if demand is not None and (trough is not None or surges_per_day is not None):
        raise BadInput(
            "--trough and --surges-per-day shape the drawn demand: leave them out with --demand"
        )
    if demand is not None:
        from gpusched.replay.traces import read_demand_csv

        try:
            read_demand_csv(demand)  # a bad row is said now, not after the traces are read
        except TraceError as exc:
            raise BadInput(str(exc)) from None
    if csv is None:
        # Before the heavy imports: a missing folder is said at once.
        try:
            TraceFiles(root, pod_list).check()
        except TraceError as exc:
            raise BadInput(str(exc)) from None

    from gpusched.replay.experiment import Experiment
    from gpusched.replay.workload import CheckpointParams, WorkloadError

    timings = {
        "periodic_s": checkpoint_every,
        "snapshot_s": snapshot_s,
        "persist_base_s": persist_s,
        "persist_per_gpu_s": persist_per_gpu_s,
        "slow_share": slow_share,
        "slow_persist_s": slow_persist_s,
    }
    try:
        checkpoints = CheckpointParams(**{k: v for k, v in timings.items() if v is not None})
    except WorkloadError as exc:
        raise BadInput(str(exc)) from None
    given = {
        name: value
        for name, value in (
            ("trough", trough),
            ("surges_per_day", surges_per_day),
            ("static_share", static_share),
        )
        if value is not None
    }
    experiment = Experiment(
        traces_dir=root,
        pod_list=pod_list,
        csv=csv,
        inventory=inventory,
        compression=compression,
        load=load,
        node_share=node_share,
        seed=seed,
        dedicated_gpus=dedicated_gpus,
        demand=demand,
        checkpoints=checkpoints,
        only=tuple(policy) if policy else None,
        price_book=settings.billing.price_book_path,
        **given,
    )
    try:
        comparison = _run(experiment, quiet=fmt is not Format.TABLE)
    except (TraceError, WorkloadError) as exc:
        raise BadInput(str(exc)) from None
    except ValueError as exc:
        raise BadInput(str(exc)) from None
    return _show(comparison, fmt, html, json_out)


def _check_writable(path: Path) -> None:
    """Refuse an output file that cannot be written; one that is created to find out
    is removed again (nothing is left behind if the replay then fails)."""
    existed = path.exists()
    try:
        with path.open("a", encoding="utf-8"):
            pass
    except OSError as exc:
        raise BadInput(f"cannot write {path}: {exc.strerror or exc}") from None
    if not existed:
        path.unlink(missing_ok=True)


def _run(experiment: Experiment, *, quiet: bool) -> Comparison:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from gpusched.cli.output import console
    from gpusched.replay.experiment import prepare, run

    prepared = prepare(experiment)
    with Progress(
        TextColumn("{task.description:<42}"),
        BarColumn(),
        TextColumn("{task.percentage:>3.0f}%"),
        TimeElapsedColumn(),
        console=console(stderr=True),
        transient=quiet,
    ) as bar:
        tasks = {p.name: bar.add_task(p.name, total=1.0) for p in prepared.policies}

        def tell(name: str, done: float) -> None:
            bar.update(tasks[name], completed=done)

        return run(prepared, tell)


def _show(comparison: Comparison, fmt: Format, html: Path | None, json_out: Path | None) -> int:
    import json

    from gpusched.cli import output
    from gpusched.replay import report

    data = report.summary(comparison)
    try:
        if json_out is not None:
            json_out.write_text(report.to_json(data) + "\n", encoding="utf-8")
        if html is not None:
            report.write_html(comparison, html, data)
    except ModuleNotFoundError as exc:
        raise BadInput(
            f"the HTML report needs {exc.name}: pip install 'gpusched[replay]'"
        ) from None
    except OSError as exc:
        raise BadInput(f"cannot write {exc.filename}: {exc.strerror or exc}") from None
    if fmt is Format.TABLE:
        out = output.console()
        grid = output.table(*(name for name, _, _ in report.TABLE))
        for row in report.table_rows(comparison.results):
            grid.add_row(*row)
        out.print(grid)
        for name, goal in data["goals"].items():
            met = {True: "met", False: "NOT met", None: "-"}[goal.get("met")]
            reach = goal.get("at_most_any_policy")
            bound = (
                f" (any policy here could reach at most {reach:.2f}x)"
                if isinstance(reach, int | float) and goal.get("reachable") is False
                else ""
            )
            out.print(f"goal {name}: {goal['goal']}: {met}{bound}", markup=False)
        if html is not None:
            out.print(f"report: {html}", markup=False)
    else:
        output.emit(json.loads(report.to_json(data)), fmt, lambda _: None)
    return 0
