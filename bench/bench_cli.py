"""`gpusched --help` wall time, beside a bare `python -c pass` in the same run.

The CLI imports its heavy modules (NATS, SQLAlchemy, the contracts) inside commands, so
help and shell completion pay only for typer; the baseline is the interpreter's own
start. Median of ROUNDS alternating runs each.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from bench.harness import Figure

ROUNDS = 15


def _wall(argv: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, timeout=60)
    return time.perf_counter() - started


def main() -> list[Figure]:
    help_s: list[float] = []
    bare_s: list[float] = []
    for _ in range(ROUNDS):
        help_s.append(_wall([sys.executable, "-m", "gpusched.cli.main", "--help"]))
        bare_s.append(_wall([sys.executable, "-c", "pass"]))
    figures = [
        Figure("cli", "help_wall_s", statistics.median(help_s), "s", statistics.median(bare_s))
    ]
    for figure in figures:
        print(figure.record(), file=sys.stderr)
    return figures
