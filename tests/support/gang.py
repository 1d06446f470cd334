"""Running a real torchrun gang (2 ranks, gloo on CPU) as a job of the test's control plane."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun_train.py"
FAULTY = Path(__file__).resolve().with_name("gang_faults.py")


def torchrun(script: Path, *args: str, ranks: int = 2) -> list[str]:
    # --standalone: a rendezvous of its own on a free local port.
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={ranks}", "--max-restarts=0", str(script), *args,
    ]  # fmt: skip


@asynccontextmanager
async def launched(
    argv: list[str], env: Mapping[str, str], log: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """The gang as a process group of its own, killed whole if the test leaves early."""
    with log.open("ab") as out:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        yield process
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()


async def finished(process: asyncio.subprocess.Process, log: Path, within: float) -> int:
    try:
        return await asyncio.wait_for(process.wait(), within)
    except TimeoutError:
        raise AssertionError(f"the gang did not finish in {within}s:\n{tail(log)}") from None


def tail(log: Path, lines: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
