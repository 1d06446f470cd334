"""The client SDK a training job uses to talk to gpusched (DESIGN §1, §4).

Async code uses `AsyncJobClient`; a plain synchronous loop uses `JobClient`. Both
publish the job's events and hand it the control plane's requests; `save_file_checkpoint`
writes a checkpoint file atomically and describes it (size, sha256, file:// URI);
`write_manifest` describes a directory checkpoint (every file's size and sha256) on any
fsspec store. gpusched.sdk.distributed checkpoints a torchrun gang with
torch.distributed.checkpoint; gpusched.sdk.lightning and gpusched.sdk.huggingface hook
the frameworks.
"""

from gpusched.sdk.checkpoints import (
    SavedCheckpoint,
    checkpoint_path,
    file_digest,
    save_file_checkpoint,
)
from gpusched.sdk.client import AsyncJobClient
from gpusched.sdk.control import (
    CheckpointRequest,
    ControlMessage,
    Freshness,
    PreemptionCancelled,
    RecentCheckpoint,
    ResumeRequest,
)
from gpusched.sdk.delivery import DeliveryState
from gpusched.sdk.environment import EnvVar, JobEnvironment
from gpusched.sdk.errors import CheckpointError, JobClientError
from gpusched.sdk.manifest import describe, read_manifest, write_manifest
from gpusched.sdk.storage import Location
from gpusched.sdk.sync import JobClient

__all__ = [
    "AsyncJobClient",
    "CheckpointError",
    "CheckpointRequest",
    "ControlMessage",
    "DeliveryState",
    "EnvVar",
    "Freshness",
    "JobClient",
    "JobClientError",
    "JobEnvironment",
    "Location",
    "PreemptionCancelled",
    "RecentCheckpoint",
    "ResumeRequest",
    "SavedCheckpoint",
    "checkpoint_path",
    "describe",
    "file_digest",
    "read_manifest",
    "save_file_checkpoint",
    "write_manifest",
]
