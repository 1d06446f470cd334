"""The replay's HTML report opens in a real browser: Debian's chromium, headless, loads it
and every plot decodes; and the `gpusched replay` command end to end on a small CSV."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
INVENTORY = """
nodes:
  - name_prefix: n
    count: 8
    pool: shared
    gpu_model: T4
    gpus: 4
    cpu_milli: 64000
    memory_mib: 262144
"""


def month(tmp_path: Path) -> tuple[Path, Path]:
    """A small workload of one's own: a service mix and 80 training jobs over 10 hours."""
    rows = ["name,arrival_s,gpus,gpu_milli,run_s,class,team", "chat,0,2,,0,inference,web"]
    for i in range(80):
        rows.append(f"job{i},{i * 450},{1 + i % 4},,{3600 + 97 * i},"
                    f"{('p2-offline', 'p1-normal')[i % 2]},lab")  # fmt: skip
    csv = tmp_path / "month.csv"
    csv.write_text("\n".join(rows) + "\n")
    inventory = tmp_path / "cluster.yaml"
    inventory.write_text(INVENTORY)
    return csv, inventory


def gpusched(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpusched.cli.main", *args],
        cwd=cwd, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


@pytest.mark.timeout(300)
def test_replay_on_a_csv_of_ones_own_prints_json_and_writes_a_report(tmp_path: Path) -> None:
    csv, inventory = month(tmp_path)
    html = tmp_path / "report.html"

    done = gpusched(
        "replay", "--csv", str(csv), "--inventory", str(inventory), "--html", str(html),
        "--policy", "gpusched", "--policy", "static split", "--policy",
        "kubernetes preemption", "-o", "json", cwd=REPO,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert [p["name"] for p in data["policies"]] == [
        "gpusched", "static split", "kubernetes preemption"
    ]  # fmt: skip
    assert data["workload"]["training_jobs"] == 80
    assert data["policies"][0]["results"]["training"]["arrived"] == 80
    # The goodput goal says what bounds it: the jobs' own work by the horizon, the ceiling.
    sizing, goodput = data["sizing"], data["goals"]["goodput"]
    bound = min(sizing["training_work_bound_gpu_h"], sizing["training_ceiling_gpu_h"])
    assert goodput["at_most_any_policy"] == pytest.approx(bound / goodput["baseline"], rel=1e-3)
    assert goodput["reachable"] is (goodput["at_most_any_policy"] >= 1.3)
    assert html.stat().st_size > 10_000
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    dom = subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'chromium'}", "--virtual-time-budget=10000",
         "--dump-dom", html.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    ).stdout  # fmt: skip
    assert 'id="comparison-table"' in dom
    loaded = re.search(r'data-images-loaded="(\d+)"', dom)
    assert loaded is not None, dom[:500]
    assert int(loaded.group(1)) == dom.count("<img") >= 7


@pytest.mark.timeout(300)
def test_replay_with_ones_own_demand_pools_and_checkpoints(tmp_path: Path) -> None:
    csv, inventory = month(tmp_path)
    demand = tmp_path / "demand.csv"
    # Ten hours and a half of a measured demand, a step a minute: 2 GPUs of work, then
    # a surge to 9 for the third hour.
    demand.write_text(
        "t_s,gpus\n" + "".join(f"{k * 60},{9 if 120 <= k < 180 else 2}\n" for k in range(630))
    )

    done = gpusched(
        "replay", "--csv", str(csv), "--inventory", str(inventory), "--demand", str(demand),
        "--dedicated-gpus", "4", "--static-share", "0.25", "--checkpoint-every", "600",
        "--persist-s", "30", "--policy", "gpusched", "--policy", "static split",
        "-o", "json", cwd=REPO,
    )  # fmt: skip

    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    sizing, experiment = data["sizing"], data["experiment"]
    assert sizing["gpusched_inference_gpus"] == 4
    assert sizing["gpusched_inference_gpus_rule"].startswith("given (4 GPUs")
    assert sizing["static_inference_gpus"] == 8  # a quarter of 32, whole nodes
    assert sizing["demand"] == {
        "measured": "demand.csv",
        "peak_gpus": 9,
        "step_s": 60,
        "hours": 10.5,
    }
    assert experiment["checkpoints"]["periodic_s"] == 600
    assert experiment["checkpoints"]["persist_base_s"] == 30
    ours, static = (p["results"]["inference"] for p in data["policies"])
    # The surge needs more than gpusched's 4 dedicated GPUs: it expands into the shared
    # pool; the static split's 8 GPUs (6.8 GPUs of work at 0.85) miss the SLO in it.
    assert ours["expansions"] >= 1 and ours["lent_gpu_h_mean"] > 0
    assert static["slo_time_share"] < 0.99 and ours["slo_time_share"] > static["slo_time_share"]


def test_a_demand_with_the_drawn_curves_shape_is_refused_in_one_line(tmp_path: Path) -> None:
    demand = tmp_path / "demand.csv"
    demand.write_text("t_s,gpus\n0,1\n60,1\n")

    done = gpusched("replay", "--demand", str(demand), "--trough", "0.2", cwd=REPO)

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpusched: --trough and --surges-per-day shape the drawn demand: leave them out "
        "with --demand"
    ]


def test_a_missing_traces_folder_is_one_line_that_says_how_to_get_them(tmp_path: Path) -> None:
    done = gpusched("replay", "--traces", str(tmp_path / "none"), cwd=REPO)

    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    assert lines[0].startswith("gpusched: no traces folder at")
    assert "README.md 'Cluster traces'" in lines[0]


def test_a_bad_csv_is_one_line_naming_the_row(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("name,arrival_s,gpus,run_s,class\nx,Infinity,1,10,p1-normal\n")

    done = gpusched("replay", "--csv", str(bad), cwd=REPO)

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpusched: bad.csv line 2: arrival_s must be a finite number >= 0, got 'Infinity'"
    ]


@pytest.mark.parametrize("option", ["--html", "--json"])
def test_an_output_that_cannot_be_written_is_refused_before_the_replay(
    tmp_path: Path, option: str
) -> None:
    csv, inventory = month(tmp_path)
    target = tmp_path / "no-such-dir" / "out"

    done = gpusched(
        "replay", "--csv", str(csv), "--inventory", str(inventory), option, str(target),
        cwd=REPO,
    )  # fmt: skip

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"gpusched: cannot write {target}: No such file or directory"
    ]
    # Refused up front: no policy was replayed (the progress bar never started).
    assert "static split" not in done.stderr + done.stdout
    assert not target.parent.exists()


def test_a_device_given_as_the_csv_is_refused_not_read_forever(tmp_path: Path) -> None:
    done = gpusched("replay", "--csv", "/dev/zero", cwd=REPO)

    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpusched: /dev/zero is not a regular file (a device?): give a file"
    ]
