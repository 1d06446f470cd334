"""What every benchmark module gets (a Context) and gives back (Figures)."""

from __future__ import annotations

import math
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg

from gpusched.infra.db import asyncpg_dsn


@dataclass(frozen=True)
class Figure:
    """One measured number. `baseline` is what the same run measured for the reference
    (e.g. raw JetStream), and `ratio` = value / baseline."""

    bench: str
    metric: str
    value: float
    unit: str
    baseline: float | None = None

    @property
    def ratio(self) -> float | None:
        if self.baseline is None or self.baseline == 0:
            return None
        return round(self.value / self.baseline, 4)

    def record(self) -> dict[str, object]:
        return {
            "bench": self.bench,
            "metric": self.metric,
            "value": round(self.value, 3),
            "unit": self.unit,
            "baseline": None if self.baseline is None else round(self.baseline, 3),
            "ratio": self.ratio,
        }


@dataclass
class Context:
    """The servers of this run and a scratch directory; progress goes to stderr."""

    nats_url: str
    admin_database_url: str  # a database we may CREATE DATABASE from
    scratch: Path
    _databases: list[str] = field(default_factory=list)

    def progress(self, message: str) -> None:
        print(f"[bench] {message}", file=sys.stderr, flush=True)

    async def create_database(self, prefix: str) -> str:
        """A fresh database, dropped at the end of the run; its SQLAlchemy URL."""
        name = f"{prefix}_{uuid.uuid4().hex[:10]}"
        admin = await asyncpg.connect(asyncpg_dsn(self.admin_database_url))
        try:
            await admin.execute(f'CREATE DATABASE "{name}"')
        finally:
            await admin.close()
        self._databases.append(name)
        base, _, _ = self.admin_database_url.rpartition("/")
        return f"{base}/{name}"

    async def drop_databases(self) -> None:
        if not self._databases:
            return
        admin = await asyncpg.connect(asyncpg_dsn(self.admin_database_url))
        try:
            for name in self._databases:
                await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()
        self._databases.clear()


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of unsorted values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[rank - 1]
