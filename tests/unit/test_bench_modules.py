"""Every bench module still imports: the benches are not run by `make test` (their
figures are measured, not asserted) and mypy does not read them, so a rename in the
services would otherwise break a bench unseen until its next run (bench_metrics once
imported a class from the module it had moved out of)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("bench_*.py")))
def test_the_bench_module_imports(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    assert callable(getattr(module, "run", None) or getattr(module, "main", None))
