"""The mutating admission webhook's decision: what a gpusched pod gets at creation.

A pod's spec cannot change once created, so what the SDK needs is wired in here,
before anything runs, as references to objects the agent creates only at placement:

- a handle (`gpusched.io/handle`, random) naming the pod's Secret and ResourceClaim;
- env variables from that Secret (job id, attempt, NATS URL, resume checkpoint ...),
  `optional` so a missing key is an empty value, never a failed start;
- the Secret's credentials file mounted read-only at /var/run/gpusched/nats.creds
  (never in the pod spec: the credentials are in the Secret only);
- the GPUs as a DRA ResourceClaim (`resourceClaims` + the containers' `claims`) in
  place of the nvidia.com/gpu limits, so the devices the kubelet prepares are the
  ones admission chose (the agent allocates the claim; docs/kubernetes.md).

Pure: `mutate(pod, handle)` returns the JSONPatch operations, or raises PodRefused.
"""

from __future__ import annotations

import copy
import secrets
from collections.abc import Mapping
from typing import Any

from gpusched.sdk.environment import EnvVar

from . import labels as L
from .pods import PodRefused, read_pod, requested_gpus

VOLUME = "gpusched"
# The variables the Secret may hold: the SDK's, and the MPS limits of a GPU fraction.
SECRET_ENV = (
    *(v.value for v in EnvVar),
    "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
    "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
)


def new_handle() -> str:
    return f"gpusched-{secrets.token_hex(6)}"


def wired(pod: Mapping[str, Any], handle: str) -> dict[str, Any]:
    """The pod as it should be created (what `mutate` patches it into)."""
    read_pod(pod)  # refuse what the agent could not run, at kubectl time
    out = copy.deepcopy(dict(pod))
    meta = out.setdefault("metadata", {})
    spec = out.setdefault("spec", {})
    notes = meta.setdefault("annotations", {})
    gpus = requested_gpus(pod) or int(notes.get(L.GPUS, "0") or 0)
    notes[L.HANDLE] = handle
    # The job reports to NATS: the install's NetworkPolicy admits pods with this label.
    meta.setdefault("labels", {})[L.NATS_CLIENT] = "true"
    notes[L.GPUS] = str(gpus)
    spec["resourceClaims"] = [
        c for c in spec.get("resourceClaims") or [] if c.get("name") != L.POD_GPU_CLAIM
    ] + [{"name": L.POD_GPU_CLAIM, "resourceClaimName": handle}]
    spec["volumes"] = [v for v in spec.get("volumes") or [] if v.get("name") != VOLUME] + [
        {
            "name": VOLUME,
            "secret": {
                "secretName": handle,
                # Optional keys: the CA is there only when NATS has TLS.
                "items": [
                    {"key": L.CREDENTIALS_KEY, "path": L.CREDENTIALS_KEY},
                    {"key": L.NATS_CA_KEY, "path": L.NATS_CA_KEY},
                ],
                "defaultMode": 0o444,
                "optional": True,
            },
        }
    ]
    for container in spec.get("containers") or []:
        resources = container.setdefault("resources", {})
        had_gpus = any(
            L.GPU_RESOURCE in (resources.get(part) or {}) for part in ("limits", "requests")
        ) or any(c.get("name") == L.POD_GPU_CLAIM for c in resources.get("claims") or [])
        for part in ("limits", "requests"):
            if part in resources:
                resources[part] = {k: v for k, v in resources[part].items() if k != L.GPU_RESOURCE}
        if had_gpus:
            resources["claims"] = [
                c for c in resources.get("claims") or [] if c.get("name") != L.POD_GPU_CLAIM
            ] + [{"name": L.POD_GPU_CLAIM}]
        container["env"] = [
            e for e in container.get("env") or [] if e.get("name") not in SECRET_ENV
        ] + [
            {
                "name": name,
                "valueFrom": {"secretKeyRef": {"name": handle, "key": name, "optional": True}},
            }
            for name in SECRET_ENV
        ]
        container["volumeMounts"] = [
            m for m in container.get("volumeMounts") or [] if m.get("name") != VOLUME
        ] + [{"name": VOLUME, "mountPath": L.SECRET_MOUNT, "readOnly": True}]
    return out


def mutate(pod: Mapping[str, Any], handle: str) -> list[dict[str, Any]]:
    """JSONPatch operations that turn `pod` into `wired(pod, handle)`."""
    out = wired(pod, handle)
    ops: list[dict[str, Any]] = [{"op": "replace", "path": "/spec", "value": out["spec"]}]
    had = pod.get("metadata") or {}
    for part in ("annotations", "labels"):
        ops.append(
            {
                "op": "replace" if part in had else "add",
                "path": f"/metadata/{part}",
                "value": out["metadata"][part],
            }
        )
    return ops


def review_response(review: Mapping[str, Any], scheduler_name: str) -> dict[str, Any]:
    """The AdmissionReview answer for one request: pods of other schedulers pass
    untouched; a gpusched pod is patched, or refused with the reason kubectl shows."""
    import base64
    import json

    request = review.get("request") or {}
    uid = request.get("uid", "")
    pod = request.get("object") or {}
    answer: dict[str, Any] = {"uid": uid, "allowed": True}
    if (
        request.get("operation") == "CREATE"
        and (pod.get("spec") or {}).get("schedulerName") == scheduler_name
    ):
        try:
            ops = mutate(pod, new_handle())
        except PodRefused as exc:
            answer = {
                "uid": uid,
                "allowed": False,
                "status": {"code": 400, "reason": "BadRequest", "message": str(exc)},
            }
        else:
            answer["patchType"] = "JSONPatch"
            answer["patch"] = base64.b64encode(json.dumps(ops).encode()).decode()
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": answer}
