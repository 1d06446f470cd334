"""The labels, annotations and names the Kubernetes agent reads and writes.

Users write the `gpusched.io/*` labels and annotations on a pod or a batch Job's pod
template (docs/kubernetes.md lists them); the agent and its webhook write the rest.
"""

from __future__ import annotations

from typing import Final

DOMAIN: Final = "gpusched.io"

# --- written by users ---------------------------------------------------------------
TEAM: Final = f"{DOMAIN}/team"  # label, required
PRIORITY_CLASS: Final = f"{DOMAIN}/priority-class"  # label, default p1-normal
KIND: Final = f"{DOMAIN}/kind"  # label: training (default) or inference
GANG: Final = f"{DOMAIN}/gang"  # label: pods of one gang share it
GANG_SIZE: Final = f"{DOMAIN}/gang-size"  # label: how many pods the gang has
# label: an inference service's replicas, "N" or "MIN:MAX"; admission scales them and
# each replica is a pod made from this one (which is the first).
REPLICAS: Final = f"{DOMAIN}/replicas"
CHECKPOINTABLE: Final = f"{DOMAIN}/checkpointable"  # annotation: "true" (default) / "false"
CHECKPOINT_SECONDS: Final = f"{DOMAIN}/estimated-checkpoint-seconds"  # annotation
GPU_MODEL: Final = f"{DOMAIN}/gpu-model"  # annotation: e.g. A100-80GB
GPU_MEMORY_GIB: Final = f"{DOMAIN}/gpu-memory-gib"  # annotation: per GPU, for sharing
GPU_MILLI: Final = f"{DOMAIN}/gpu-milli"  # annotation: a fraction of one GPU, 1..999
CHECKPOINT_DIR: Final = f"{DOMAIN}/checkpoint-dir"  # annotation: where the job saves

# --- written by the webhook ---------------------------------------------------------
# The name of the pod's Secret and ResourceClaim (made by the agent at placement).
HANDLE: Final = f"{DOMAIN}/handle"
# The GPUs the pod asked for (its nvidia.com/gpu limits, moved to the claim).
GPUS: Final = f"{DOMAIN}/gpus"
# label "true": the pod is a NATS client (the install's NetworkPolicy admits such pods
# to NATS; from another namespace only if that namespace carries it too).
NATS_CLIENT: Final = f"{DOMAIN}/nats-client"

# --- written by the agent -----------------------------------------------------------
JOB_ID: Final = f"{DOMAIN}/job-id"
ALLOCATION_ID: Final = f"{DOMAIN}/allocation-id"
ATTEMPT: Final = f"{DOMAIN}/attempt"
# The eviction saga that ends this pod (set just before the Eviction API call, so a
# restarted agent still reports the pod's end as that saga's eviction).
SAGA: Final = f"{DOMAIN}/eviction-saga"
# Why the agent did not submit the pod (a label or annotation it cannot read).
REFUSED: Final = f"{DOMAIN}/refused"
# Set on pods the agent created from a job's template (a later attempt).
CREATED_BY: Final = f"{DOMAIN}/created-by"

# --- Kubernetes and the NVIDIA GPU operator -----------------------------------------
GPU_RESOURCE: Final = "nvidia.com/gpu"
MIG_RESOURCE_PREFIX: Final = "nvidia.com/mig-"
GFD_PRODUCT: Final = "nvidia.com/gpu.product"
GFD_COUNT: Final = "nvidia.com/gpu.count"
GFD_MEMORY: Final = "nvidia.com/gpu.memory"  # MiB per GPU
GFD_MIG_CAPABLE: Final = "nvidia.com/mig.capable"
MIG_CONFIG: Final = "nvidia.com/mig.config"
MIG_CONFIG_STATE: Final = "nvidia.com/mig.config.state"
POD_GPU_CLAIM: Final = "gpusched-gpus"  # the pod's resourceClaims entry
SECRET_MOUNT: Final = "/var/run/gpusched"
CREDENTIALS_KEY: Final = "nats.creds"
# The CA of the NATS server, in the Secret and the pod's volume (when NATS has TLS).
NATS_CA_KEY: Final = "nats-ca.crt"
