"""The client SDK a training job uses to talk to gpusched (DESIGN §1, §4).

Async code uses `AsyncJobClient`; a plain synchronous loop uses `JobClient`. Both
publish the job's events and hand it the control plane's requests; `save_file_checkpoint`
writes a checkpoint file atomically and describes it (size, sha256, file:// URI).
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
    PreemptionCancelled,
    ResumeRequest,
)
from gpusched.sdk.delivery import DeliveryState
from gpusched.sdk.environment import EnvVar, JobEnvironment
from gpusched.sdk.errors import CheckpointError, JobClientError
from gpusched.sdk.sync import JobClient

__all__ = [
    "AsyncJobClient",
    "CheckpointError",
    "CheckpointRequest",
    "ControlMessage",
    "DeliveryState",
    "EnvVar",
    "JobClient",
    "JobClientError",
    "JobEnvironment",
    "PreemptionCancelled",
    "ResumeRequest",
    "SavedCheckpoint",
    "checkpoint_path",
    "file_digest",
    "save_file_checkpoint",
]
