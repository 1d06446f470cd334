"""MIG layouts through the GPU operator's MIG manager.

The MIG manager applies a named configuration of its mig-parted ConfigMap to a whole
node when the node's `nvidia.com/mig.config` label names it, and reports progress in
`nvidia.com/mig.config.state` (pending, rebooting, success, failed). Admission lays out
one GPU at a time, so the agent keeps one configuration per node layout in its own
ConfigMap (`gpusched-<hash>`: the per-GPU profiles), labels the node with it, and
reports `mig.configured` when the state says success.

Pure: `config_name(layouts)` and `mig_parted(layouts)`.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

SUCCESS = "success"
FAILED = "failed"


def config_name(layouts: Mapping[int, Sequence[str]]) -> str:
    """A stable name for one node layout (index -> MIG profiles; empty: MIG off)."""
    canonical = json.dumps({str(k): list(v) for k, v in sorted(layouts.items())})
    return "gpusched-" + hashlib.sha256(canonical.encode()).hexdigest()[:12]


def mig_parted(layouts: Mapping[int, Sequence[str]]) -> list[dict[str, Any]]:
    """The mig-parted entry of one layout: per GPU, MIG on with its slices, or off."""
    entry: list[dict[str, Any]] = []
    for index, profiles in sorted(layouts.items()):
        if profiles:
            entry.append(
                {
                    "devices": [index],
                    "mig-enabled": True,
                    "mig-devices": dict(sorted(Counter(profiles).items())),
                }
            )
        else:
            entry.append({"devices": [index], "mig-enabled": False})
    return entry
