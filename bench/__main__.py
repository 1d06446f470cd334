"""`python -m bench [name ...]`: run every bench/bench_*.py (or the named ones).

NATS and PostgreSQL come from GPUSCHED_NATS_URL / GPUSCHED_DATABASE_URL when set,
else the embedded servers start once, in a temporary directory, for the whole run.
Each figure is printed to stdout as one JSON line and appended to
bench/results/<bench>.jsonl; bench/results/latest.json holds the latest figures of
every bench (BENCH_RESULTS_DIR names another folder). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import inspect
import json
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType

from bench.harness import Context, Figure
from gpusched.infra.embedded import EmbeddedNats, EmbeddedPostgres

HERE = Path(__file__).resolve().parent
RESULTS = Path(os.environ.get("BENCH_RESULTS_DIR") or HERE / "results")
PREFIX = "bench_"


def discover(names: list[str]) -> list[str]:
    found = sorted(p.stem[len(PREFIX) :] for p in HERE.glob(f"{PREFIX}*.py"))
    unknown = sorted(set(names) - set(found))
    if unknown:
        raise SystemExit(f"no such bench: {', '.join(unknown)} (have: {', '.join(found)})")
    return [n for n in found if not names or n in names]


@contextlib.contextmanager
def servers(scratch: Path) -> Iterator[tuple[str, str]]:
    nats_url = os.environ.get("GPUSCHED_NATS_URL")
    db_url = os.environ.get("GPUSCHED_DATABASE_URL")
    started: list[EmbeddedNats | EmbeddedPostgres] = []
    try:
        if not nats_url:
            nats = EmbeddedNats(scratch / "nats")
            nats_url = nats.start()
            started.append(nats)
        if not db_url:
            pg = EmbeddedPostgres(scratch / "pg")
            db_url = pg.start()
            started.append(pg)
        yield nats_url, db_url
    finally:
        for server in reversed(started):
            server.stop()


async def run_module(module: ModuleType, ctx: Context) -> list[Figure]:
    entry = getattr(module, "run", None)
    if entry is not None:
        figures = await entry(ctx)
    else:
        result = module.main()
        figures = await result if inspect.isawaitable(result) else result
    return list(figures or [])


def save(name: str, figures: list[Figure], stamp: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / f"{name}.jsonl").open("a", encoding="utf-8") as history:
        for figure in figures:
            history.write(json.dumps({**figure.record(), "time": stamp}) + "\n")
    latest_path = RESULTS / "latest.json"
    latest: dict[str, object] = {}
    with contextlib.suppress(OSError, ValueError):
        latest = json.loads(latest_path.read_text())
    latest[name] = {"time": stamp, "figures": [f.record() for f in figures]}
    latest_path.write_text(json.dumps(latest, indent=2, sort_keys=True) + "\n")


async def run_all(names: list[str], ctx: Context) -> int:
    failed = 0
    stamp = datetime.now(UTC).isoformat(timespec="seconds")
    try:
        for name in names:
            ctx.progress(f"{name}: start")
            try:
                module = importlib.import_module(f"bench.{PREFIX}{name}")
                figures = await run_module(module, ctx)
            except Exception:
                failed += 1
                traceback.print_exc()
                ctx.progress(f"{name}: FAILED")
                continue
            for figure in figures:
                print(json.dumps(figure.record()), flush=True)
            save(name, figures, stamp)
            ctx.progress(f"{name}: done ({len(figures)} figures)")
    finally:
        await ctx.drop_databases()
    return failed


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="benches to run (default: all)")
    args = parser.parse_args()
    names = discover(args.names)
    scratch = Path(tempfile.mkdtemp(prefix="gpusched-bench-"))
    try:
        with servers(scratch) as (nats_url, db_url):
            ctx = Context(nats_url=nats_url, admin_database_url=db_url, scratch=scratch)
            failed = asyncio.run(run_all(names, ctx))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
