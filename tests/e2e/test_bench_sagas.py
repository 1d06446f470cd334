"""The saga bench still runs against the service as shipped, at a tiny size.

The bench is not a test (its figures are measured, not asserted); this only checks it
completes and prints its figures, so a change to the service's settings or contracts
that breaks it shows up in `make test` rather than at the next measurement. It once
hung because the service, told to read file:// claims only under the simulated
cluster's directory, refused the bench's checkpoint file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.support.gang import finished, launched, tail

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
async def test_the_saga_bench_completes_and_prints_its_figures(tmp_path: Path) -> None:
    log = tmp_path / "bench.log"
    env = {
        # Its own embedded servers, as `make bench` runs it, and its own results folder.
        "GPUSCHED_NATS_URL": "",
        "GPUSCHED_DATABASE_URL": "",
        "BENCH_RESULTS_DIR": str(tmp_path / "results"),
        "BENCH_SAGAS": "40",
        "BENCH_SAGAS_CONCURRENCY": "10",
        "BENCH_SAGAS_UNLOADED": "5",
        "BENCH_SAGAS_PACED": "10",
        "BENCH_SAGAS_RATE": "50",
    }
    out = tmp_path / "figures.jsonl"
    argv = ["sh", "-c", f'cd "{ROOT}" && exec "{sys.executable}" -m bench sagas > "{out}"']
    async with launched(argv, env, log) as process:
        code = await finished(process, log, within=200)
    assert code == 0, tail(log)
    figures = {f["metric"]: f for f in map(json.loads, out.read_text().splitlines())}
    assert figures["sagas_per_s"]["value"] > 0
    service = figures["cpu_per_saga.checkpoint_service"]
    assert service["value"] > 0 and service["baseline"] > 0
    assert figures["request_to_evict_p99"]["value"] > 0
    history = (tmp_path / "results" / "sagas.jsonl").read_text().splitlines()
    assert len(history) == len(figures)
