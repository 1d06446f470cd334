"""The benches of the services still run against the services as shipped, at a tiny
size: the saga, admission, ingest and DCGM benches, whose figures the README's scale
table quotes.

A bench is not a test (its figures are measured, not asserted); this only checks each
completes and prints its figures, so a change to the services' settings or contracts
that breaks one shows up in `make test` rather than at the next measurement. The saga
bench once waited out every saga because the service, told to read file:// claims only
under the simulated cluster's directory, refused the bench's checkpoint file.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from tests.support.gang import finished, launched, tail

ROOT = Path(__file__).resolve().parents[2]
BENCHES = ("sagas", "admission", "ingest", "dcgm")
TINY = {
    "BENCH_SAGAS": "40",
    "BENCH_SAGAS_CONCURRENCY": "10",
    "BENCH_SAGAS_UNLOADED": "5",
    "BENCH_SAGAS_PACED": "10",
    "BENCH_SAGAS_RATE": "50",
    "BENCH_ADMISSION_QUEUED": "300",
    "BENCH_ADMISSION_RATE": "50",
    "BENCH_ADMISSION_SECONDS": "3",
    "BENCH_ADMISSION_BASELINE_SECONDS": "1",
    "BENCH_INGEST_NODES": "40",
    "BENCH_INGEST_RATE": "200",
    "BENCH_INGEST_SECONDS": "3",
    "BENCH_DCGM_ENDPOINTS": "20",
    "BENCH_DCGM_ROUNDS": "2",
    "BENCH_DCGM_INTERVAL": "1",
}


@pytest.mark.timeout(300)
async def test_the_service_benches_complete_and_print_their_figures(tmp_path: Path) -> None:
    log = tmp_path / "bench.log"
    env = {
        # Their own embedded servers, as `make bench` runs them, and a results folder.
        "GPUSCHED_NATS_URL": "",
        "GPUSCHED_DATABASE_URL": "",
        "BENCH_RESULTS_DIR": str(tmp_path / "results"),
        **TINY,
    }
    out = tmp_path / "figures.jsonl"
    run = f'cd "{ROOT}" && exec "{sys.executable}" -m bench {" ".join(BENCHES)} > "{out}"'
    async with launched(["sh", "-c", run], env, log) as process:
        code = await finished(process, log, within=260)
    assert code == 0, tail(log)
    figures: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for record in map(json.loads, out.read_text().splitlines()):
        figures[record["bench"]][record["metric"]] = record
    assert sorted(figures) == sorted(BENCHES)
    sagas, admission = figures["sagas"], figures["admission"]
    assert sagas["sagas_per_s"]["value"] > 0
    assert sagas["cpu_per_saga.checkpoint_service"]["baseline"] > 0
    assert admission["submits_failed"]["value"] == 0 and admission["submit_p99"]["value"] > 0
    assert figures["ingest"]["steady load folded"]["value"] > 0
    assert figures["dcgm"]["scraped_ok_min"]["value"] == 1.0
    for bench, measured in figures.items():
        history = (tmp_path / "results" / f"{bench}.jsonl").read_text().splitlines()
        assert len(history) == len(measured)
