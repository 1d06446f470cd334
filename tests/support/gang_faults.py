"""examples/torchrun_train.py with a fault: rank GPUSCHED_TEST_KILL_RANK kills itself
(SIGKILL, as the kernel's OOM killer or a failed node would) in the middle of the gang's
first checkpoint, after the others have started saving."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import torchrun_train

from gpusched.sdk.distributed import ShardedState

_victim = int(os.environ.get("GPUSCHED_TEST_KILL_RANK", "1"))
_save = ShardedState.to_save


def _to_save_or_die(self: ShardedState, rank: int, step: int) -> dict[str, Any]:
    if rank == _victim:
        os.kill(os.getpid(), signal.SIGKILL)
    return _save(self, rank, step)


ShardedState.to_save = _to_save_or_die  # type: ignore[method-assign]

if __name__ == "__main__":
    sys.exit(torchrun_train.main())
