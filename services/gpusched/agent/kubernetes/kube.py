"""The Kubernetes API through kubernetes_asyncio, as plain JSON objects.

The agent reads and writes the API's own JSON (dicts), which the pure modules take;
the client library does the HTTP, TLS, authentication (kubeconfig or in-cluster
service account) and URL building. Every call is bounded in time. The library's
errors become ours at this boundary:

- `KubeError` with the API's Status (`NotFound`, `Conflict`, `TooManyRequests`, `Gone`)
  for an answer of the server;
- `Unavailable` (an outage, waited out by the caller) when the server cannot be
  reached, times out, or answers 5xx.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes_asyncio import client, config
from kubernetes_asyncio.client.exceptions import ApiException

from gpusched.infra.errors import Unavailable

log = logging.getLogger(__name__)

Obj = dict[str, Any]
# How long one request may take; a watch is bounded by its own timeoutSeconds.
REQUEST_TIMEOUT_S = 10.0


# Every API call the agent makes, as (API group, resource) -> verbs. Its RBAC
# (deploy/k8s/agent-kubernetes/rbac.yaml) grants exactly these; a test holds them equal.
API_CALLS: dict[tuple[str, str], frozenset[str]] = {
    ("", "nodes"): frozenset({"list", "watch", "patch"}),
    # A namespace's gpusched.io/team label (set by an operator) is its pods' team.
    ("", "namespaces"): frozenset({"list", "watch"}),
    ("", "pods"): frozenset({"get", "list", "watch", "create", "patch", "delete"}),
    ("", "pods/binding"): frozenset({"create"}),
    ("", "pods/eviction"): frozenset({"create"}),
    ("", "secrets"): frozenset({"get", "create", "update"}),
    ("", "events"): frozenset({"create"}),
    ("", "configmaps"): frozenset({"get", "create", "update"}),
    ("resource.k8s.io", "resourceclaims"): frozenset({"get", "create", "delete"}),
    ("resource.k8s.io", "resourceclaims/status"): frozenset({"update"}),
    ("coordination.k8s.io", "leases"): frozenset({"get", "create", "update"}),
}


class KubeError(Exception):
    def __init__(self, code: int, reason: str, message: str, body: Obj | None = None) -> None:
        super().__init__(f"{code} {reason}: {message}")
        self.code = code
        self.reason = reason
        self.message = message
        self.body = body or {}


class NotFound(KubeError):
    pass


class Conflict(KubeError):
    """409: a stale resourceVersion, an existing name, a pod already bound."""


class TooManyRequests(KubeError, Unavailable):
    """429: a PodDisruptionBudget refused an eviction, or the API's rate limit. Outside an
    eviction (which retries it and reports it to the saga) it is an outage to wait out."""

    retry_after_s: float = 1.0


class Gone(KubeError):
    """410: the watch's resourceVersion is older than the history the server keeps."""


_BY_CODE: dict[int, type[KubeError]] = {
    404: NotFound,
    409: Conflict,
    410: Gone,
    429: TooManyRequests,
}


def _error(code: int, body: Any, retry_after: str | None = None) -> Exception:
    status = body if isinstance(body, dict) else {}
    reason = str(status.get("reason") or "")
    message = str(status.get("message") or body)[:500]
    if code >= 500 or code == 0:
        return Unavailable(f"Kubernetes API answered {code} {reason}: {message}")
    error = _BY_CODE.get(code, KubeError)(code, reason, message, status)
    if isinstance(error, TooManyRequests) and retry_after:
        with contextlib.suppress(ValueError):
            error.retry_after_s = min(float(retry_after), 30.0)
    return error


async def connect(kubeconfig: Path | None) -> client.ApiClient:
    """A client from a kubeconfig file, else from the pod's service account."""
    configuration = client.Configuration()
    if kubeconfig is not None:
        await config.load_kube_config(
            config_file=str(kubeconfig), client_configuration=configuration
        )
    else:
        config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    return client.ApiClient(configuration)


class Kube:
    """The calls the agent makes, each mapped to one API operation (RBAC: docs)."""

    def __init__(self, api: client.ApiClient, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.coordination = client.CoordinationV1Api(api)
        self.resource = client.ResourceV1Api(api)
        self._timeout = timeout_s

    async def close(self) -> None:
        await self.api.close()

    async def _call(self, method: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Obj:
        try:
            response = await asyncio.wait_for(
                method(*args, _preload_content=False, _request_timeout=self._timeout, **kwargs),
                self._timeout + 1,
            )
            try:
                text = await response.text()
            finally:
                response.release()
        except ApiException as exc:  # raised before a request is made (bad arguments)
            raise _error(exc.status or 0, exc.body) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"Kubernetes API unreachable: {exc!r}") from exc
        try:
            body = json.loads(text) if text else {}
        except ValueError:
            body = {"message": text[:200]}
        if response.status >= 300:
            raise _error(response.status, body, response.headers.get("Retry-After"))
        result: Obj = body
        return result

    def _lister(self, kind: str) -> Callable[..., Awaitable[Any]]:
        listers: dict[str, Callable[..., Awaitable[Any]]] = {
            "nodes": self.core.list_node,
            "namespaces": self.core.list_namespace,
            "pods": self.core.list_pod_for_all_namespaces,
        }
        return listers[kind]

    # --- reads ----------------------------------------------------------------------
    async def list(self, kind: str, field_selector: str = "") -> Obj:
        """All objects of `kind` (nodes, namespaces, pods in every namespace)."""
        kwargs = {"field_selector": field_selector} if field_selector else {}
        return await self._call(self._lister(kind), **kwargs)

    async def list_nodes(self) -> Obj:
        return await self.list("nodes")

    async def get_pod(self, namespace: str, name: str) -> Obj:
        return await self._call(self.core.read_namespaced_pod, name, namespace)

    async def get_claim(self, namespace: str, name: str) -> Obj:
        return await self._call(self.resource.read_namespaced_resource_claim, name, namespace)

    # --- writes ---------------------------------------------------------------------
    async def create_pod(self, namespace: str, pod: Obj) -> Obj:
        return await self._call(self.core.create_namespaced_pod, namespace, pod)

    async def patch_pod_annotations(
        self, namespace: str, name: str, notes: dict[str, str | None]
    ) -> Obj:
        """Set annotations (None: remove one) in one call: a merge of the annotations
        only, so nothing else of the pod is written and no resourceVersion is needed."""
        body = {"metadata": {"annotations": notes}}
        return await self._call(self.core.patch_namespaced_pod, name, namespace, body)

    async def delete_pod(self, namespace: str, name: str, grace_s: int | None = None) -> Obj:
        kwargs: dict[str, Any] = {} if grace_s is None else {"grace_period_seconds": grace_s}
        return await self._call(self.core.delete_namespaced_pod, name, namespace, **kwargs)

    async def bind(self, namespace: str, name: str, node: str) -> Obj:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        return await self._call(self.core.create_namespaced_pod_binding, name, namespace, body)

    async def evict(self, namespace: str, name: str, grace_s: int) -> Obj:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"gracePeriodSeconds": grace_s},
        }
        return await self._call(self.core.create_namespaced_pod_eviction, name, namespace, body)

    async def create_secret(self, namespace: str, secret: Obj) -> Obj:
        return await self._call(self.core.create_namespaced_secret, namespace, secret)

    async def get_secret(self, namespace: str, name: str) -> Obj:
        return await self._call(self.core.read_namespaced_secret, name, namespace)

    async def replace_secret(self, secret: Obj) -> Obj:
        meta = secret["metadata"]
        return await self._call(
            self.core.replace_namespaced_secret, meta["name"], meta["namespace"], secret
        )

    async def create_claim(self, namespace: str, claim: Obj) -> Obj:
        return await self._call(self.resource.create_namespaced_resource_claim, namespace, claim)

    async def replace_claim_status(self, claim: Obj) -> Obj:
        meta = claim["metadata"]
        return await self._call(
            self.resource.replace_namespaced_resource_claim_status,
            meta["name"],
            meta["namespace"],
            claim,
        )

    async def delete_claim(self, namespace: str, name: str) -> Obj:
        return await self._call(self.resource.delete_namespaced_resource_claim, name, namespace)

    async def patch_node_labels(self, name: str, node_labels: dict[str, str | None]) -> Obj:
        return await self._call(self.core.patch_node, name, {"metadata": {"labels": node_labels}})

    async def get_configmap(self, namespace: str, name: str) -> Obj:
        return await self._call(self.core.read_namespaced_config_map, name, namespace)

    async def create_configmap(self, namespace: str, configmap: Obj) -> Obj:
        return await self._call(self.core.create_namespaced_config_map, namespace, configmap)

    async def replace_configmap(self, configmap: Obj) -> Obj:
        meta = configmap["metadata"]
        return await self._call(
            self.core.replace_namespaced_config_map, meta["name"], meta["namespace"], configmap
        )

    async def create_event(self, namespace: str, event: Obj) -> Obj:
        return await self._call(self.core.create_namespaced_event, namespace, event)

    async def get_lease(self, namespace: str, name: str) -> Obj:
        return await self._call(self.coordination.read_namespaced_lease, name, namespace)

    async def create_lease(self, namespace: str, lease: Obj) -> Obj:
        return await self._call(self.coordination.create_namespaced_lease, namespace, lease)

    async def replace_lease(self, lease: Obj) -> Obj:
        meta = lease["metadata"]
        return await self._call(
            self.coordination.replace_namespaced_lease, meta["name"], meta["namespace"], lease
        )

    # --- watches --------------------------------------------------------------------
    async def watch(
        self, kind: str, resource_version: str, timeout_s: int, field_selector: str = ""
    ) -> AsyncIterator[Obj]:
        """The events of one watch (`{type, object}`) from `resource_version`, with
        bookmarks, until the server ends it (about `timeout_s`). Gone on a 410."""
        from kubernetes_asyncio import watch

        method = self._lister(kind)
        kwargs: dict[str, Any] = {
            "resource_version": resource_version,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout_s,
            # The connection gives up a little after the server should have ended it.
            "_request_timeout": aiohttp.ClientTimeout(sock_read=timeout_s + 15, sock_connect=5),
        }
        if field_selector:
            kwargs["field_selector"] = field_selector
        stream = watch.Watch(return_type="object")
        try:
            async for event in stream.stream(method, **kwargs):
                yield {"type": event["type"], "object": event["raw_object"]}
        except ApiException as exc:
            raise _error(exc.status or 0, {"reason": exc.reason, "message": exc.reason}) from exc
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise Unavailable(f"Kubernetes watch of {kind} broke: {exc!r}") from exc
        finally:
            await stream.close()
