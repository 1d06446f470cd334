"""A Kubernetes API stand-in: a real HTTPS server speaking the API's JSON wire format.

No kube-apiserver can be installed here, so the Kubernetes agent is tested against
this server, reached only through the client library and a kubeconfig, like a cluster.
It serves exactly the resources the agent uses, following the API reference:

- core/v1 nodes, namespaces, pods (+ binding, eviction, status), secrets, configmaps,
  events; batch/v1 jobs (stored; their controller is played by the test,
  tests/support/kubecontrollers.py); policy/v1 poddisruptionbudgets;
  coordination.k8s.io/v1 leases; resource.k8s.io/v1 resourceclaims (+ status);
- one resourceVersion counter for every object (etcd's revision); list returns the
  collection's resourceVersion; watch (`?watch=true`) streams JSON lines over a chunked
  response from a resourceVersion, with BOOKMARK events when asked
  (allowWatchBookmarks) and an ERROR event carrying a 410 Gone Status when the
  resourceVersion is older than the kept history (`compact()` drops it, as etcd does);
- PUT with a stale metadata.resourceVersion answers 409 Conflict; POST of an existing
  name 409 AlreadyExists; a Binding of a bound pod 409;
- an Eviction is refused with 429 TooManyRequests when a PodDisruptionBudget that
  selects the pod allows no disruption, else the pod is deleted gracefully;
- graceful deletion of a bound pod sets deletionTimestamp (the kubelet finishes it with
  a delete of grace 0); an unbound pod goes at once; dependents named by
  ownerReferences are garbage-collected with their owner;
- a bearer token is required (401 without it); a mutating admission webhook, when
  configured, is called with an AdmissionReview on pod CREATE and its JSONPatch applied.

Test hooks (not API): `fail_next(...)` makes the next matching requests fail with a
status (e.g. 409, 429, 503), `compact()` expires the watch history, `close_watches()`
cuts every open watch.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import ssl
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

Obj = dict[str, Any]


@dataclass(frozen=True)
class Kind:
    group: str  # "" for core
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


KINDS = {
    k.plural: k
    for k in (
        Kind("", "v1", "nodes", "Node", False),
        Kind("", "v1", "namespaces", "Namespace", False),
        Kind("batch", "v1", "jobs", "Job", True),
        Kind("", "v1", "pods", "Pod", True),
        Kind("", "v1", "secrets", "Secret", True),
        Kind("", "v1", "configmaps", "ConfigMap", True),
        Kind("", "v1", "events", "Event", True),
        Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", True),
        Kind("coordination.k8s.io", "v1", "leases", "Lease", True),
        Kind("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True),
    )
}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status(code: int, reason: str, message: str, **details: Any) -> Obj:
    """A metav1.Status, as the API answers every error."""
    out: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure" if code >= 400 else "Success",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details:
        out["details"] = details
    return out


class ApiError(Exception):
    def __init__(self, code: int, reason: str, message: str, **details: Any) -> None:
        super().__init__(message)
        self.body = status(code, reason, message, **details)
        self.code = code


def not_found(kind: Kind, name: str) -> ApiError:
    return ApiError(
        404,
        "NotFound",
        f'{kind.plural} "{name}" not found',
        name=name,
        kind=kind.plural,
        group=kind.group,
    )


def conflict(kind: Kind, name: str, message: str) -> ApiError:
    return ApiError(
        409,
        "Conflict",
        f'Operation cannot be fulfilled on {kind.plural} "{name}": {message}',
        name=name,
        kind=kind.plural,
        group=kind.group,
    )


def _selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality-based label selectors: `a=b`, `a==b`, `a!=b`, `a`, `!a`, comma-joined."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _flag(value: str | None) -> bool:
    """A boolean query parameter as the API server reads it (Go's strconv.ParseBool)."""
    return (value or "").lower() in ("1", "t", "true")


def _field(obj: Obj, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return "" if value is None else str(value)


# Field selectors the API supports for each kind (the ones the agent may send).
_FIELDS = {
    "pods": {
        "metadata.name",
        "metadata.namespace",
        "spec.nodeName",
        "spec.schedulerName",
        "status.phase",
    },
    "nodes": {"metadata.name", "spec.unschedulable"},
}


def _fields_match(kind: Kind, selector: str, obj: Obj) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, value = term.replace("!=", "=").replace("==", "=").split("=", 1)
        if key not in _FIELDS.get(kind.plural, {"metadata.name", "metadata.namespace"}):
            raise ApiError(
                400, "BadRequest", f'field label not supported: "{key}"'
            )  # as the API says
        if (_field(obj, key) == value) == negate:
            return False
    return True


def json_patch(doc: Any, ops: list[Obj]) -> Any:
    """RFC 6902 add / remove / replace (what admission webhooks send)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent[part]
        last = parts[-1]
        if op["op"] == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), op["value"])
            else:
                parent[last] = op["value"]
        elif op["op"] == "replace":
            if isinstance(parent, list):
                parent[int(last)] = op["value"]
            else:
                if last not in parent:
                    raise ApiError(422, "Invalid", f"replace of a missing path {op['path']}")
                parent[last] = op["value"]
        elif op["op"] == "remove":
            del parent[int(last) if isinstance(parent, list) else last]
        else:
            raise ApiError(400, "BadRequest", f"unsupported patch op {op['op']}")
    return doc


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 (also what a strategic merge patch of labels/annotations amounts to)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


@dataclass
class _Watcher:
    kind: Kind
    namespace: str | None
    labels: str
    fields: str
    queue: asyncio.Queue[Obj | None] = field(default_factory=asyncio.Queue)


@dataclass
class FailRule:
    method: str
    path_contains: str
    code: int
    times: int
    reason: str


@dataclass
class KubeApiStandIn:
    """The server; start() it in the test's event loop, stop() it at the end."""

    token: str = field(default_factory=lambda: uuid.uuid4().hex)
    bookmark_interval_s: float = 1.0
    webhook_url: str | None = None
    webhook_ca: Path | None = None
    objects: dict[tuple[str, str, str], Obj] = field(default_factory=dict)
    history: list[tuple[int, str, str, Obj]] = field(default_factory=list)
    # History older than this revision is gone (410 for a watch from before it).
    compacted: int = 0
    revision: int = 100
    requests: list[tuple[str, str]] = field(default_factory=list)
    # Watches answered 410 Gone (their resourceVersion was compacted away).
    expired_watches: int = 0
    _watchers: list[_Watcher] = field(default_factory=list)
    _fail: list[FailRule] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    url: str = ""
    on_change: list[Callable[[str, str, Obj], None]] = field(default_factory=list)

    # --- lifecycle ------------------------------------------------------------------
    async def start(self, ssl_context: ssl.SSLContext | None, host: str = "127.0.0.1") -> str:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0, ssl_context=ssl_context)
        await site.start()
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        self.url = f"{'https' if ssl_context else 'http'}://{host}:{port}"
        return self.url

    async def stop(self) -> None:
        self.close_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- test hooks -----------------------------------------------------------------
    def fail_next(
        self, method: str, path_contains: str, code: int, times: int = 1, reason: str = ""
    ) -> None:
        self._fail.append(FailRule(method, path_contains, code, times, reason))

    def compact(self) -> None:
        """Expire every watch position up to now (etcd compaction after writes no
        watcher of these kinds saw): a watch from any version seen so far gets 410."""
        self._next()
        self.compacted = self.revision
        self.history.clear()

    def close_watches(self) -> None:
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)

    def get(self, plural: str, name: str, namespace: str = "") -> Obj | None:
        obj = self.objects.get((plural, namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def list(self, plural: str, namespace: str | None = None) -> list[Obj]:
        return [
            copy.deepcopy(o)
            for (p, ns, _), o in sorted(self.objects.items())
            if p == plural and (namespace is None or ns == namespace)
        ]

    async def create(self, plural: str, namespace: str, obj: Obj) -> Obj:
        """Create as a client of the API does (a controller making pods): through
        admission, so the mutating webhook is called for a pod."""
        return await self._post(KINDS[plural], namespace, copy.deepcopy(obj))

    def put(self, plural: str, obj: Obj) -> Obj:
        """Create or replace an object as a controller would (no admission, no checks)."""
        kind = KINDS[plural]
        meta = obj.setdefault("metadata", {})
        key = (plural, meta.get("namespace", "") if kind.namespaced else "", meta["name"])
        if key in self.objects:
            return self._store(kind, key, obj, "MODIFIED")
        return self._create(kind, key, obj)

    def mutate(self, plural: str, name: str, namespace: str, change: Callable[[Obj], None]) -> Obj:
        """Change a stored object in place (a kubelet or controller writing status)."""
        kind = KINDS[plural]
        key = (plural, namespace if kind.namespaced else "", name)
        obj = copy.deepcopy(self.objects[key])
        change(obj)
        return self._store(kind, key, obj, "MODIFIED")

    def remove(self, plural: str, name: str, namespace: str = "") -> None:
        """Delete at once (grace 0), as the kubelet's final delete does."""
        kind = KINDS[plural]
        key = (plural, namespace if kind.namespaced else "", name)
        if key in self.objects:
            self._delete_now(kind, key)

    # --- storage --------------------------------------------------------------------
    def _next(self) -> str:
        self.revision += 1
        return str(self.revision)

    def _create(self, kind: Kind, key: tuple[str, str, str], obj: Obj) -> Obj:
        meta = obj.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", _now())
        meta.setdefault("generation", 1)
        obj["kind"], obj["apiVersion"] = kind.kind, kind.api_version
        return self._store(kind, key, obj, "ADDED")

    def _store(self, kind: Kind, key: tuple[str, str, str], obj: Obj, event: str) -> Obj:
        obj["kind"], obj["apiVersion"] = kind.kind, kind.api_version
        obj["metadata"]["resourceVersion"] = self._next()
        self.objects[key] = copy.deepcopy(obj)
        self._emit(kind, event, obj)
        return copy.deepcopy(obj)

    def _delete_now(self, kind: Kind, key: tuple[str, str, str]) -> Obj:
        obj = self.objects.pop(key)
        obj["metadata"]["resourceVersion"] = self._next()
        self._emit(kind, "DELETED", obj)
        uid = obj["metadata"].get("uid")
        # The garbage collector: dependents go with their owner.
        for other_key, other in list(self.objects.items()):
            owners = other.get("metadata", {}).get("ownerReferences") or []
            if other_key in self.objects and any(o.get("uid") == uid for o in owners):
                self._delete_now(KINDS[other_key[0]], other_key)
        return obj

    def _emit(self, kind: Kind, event: str, obj: Obj) -> None:
        rv = int(obj["metadata"]["resourceVersion"])
        self.history.append((rv, kind.plural, event, copy.deepcopy(obj)))
        for watcher in self._watchers:
            if watcher.kind is kind and self._visible(watcher, obj):
                watcher.queue.put_nowait({"type": event, "object": copy.deepcopy(obj)})
        for callback in self.on_change:
            callback(kind.plural, event, copy.deepcopy(obj))

    def _visible(self, w: _Watcher, obj: Obj) -> bool:
        meta = obj.get("metadata", {})
        if w.namespace is not None and meta.get("namespace") != w.namespace:
            return False
        return _selector_matches(w.labels, meta.get("labels") or {}) and _fields_match(
            w.kind, w.fields, obj
        )

    # --- HTTP -----------------------------------------------------------------------
    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Any]
    ) -> web.StreamResponse:
        self.requests.append((request.method, request.path_qs))
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response(status(401, "Unauthorized", "Unauthorized"), status=401)
        for rule in self._fail:
            if (
                rule.times > 0
                and rule.method == request.method
                and rule.path_contains in (request.path_qs)
            ):
                rule.times -= 1
                reason = rule.reason or {409: "Conflict", 429: "TooManyRequests"}.get(
                    rule.code, "ServiceUnavailable"
                )
                headers = {"Retry-After": "1"} if rule.code == 429 else {}
                return web.json_response(
                    status(rule.code, reason, f"injected {rule.code}"),
                    status=rule.code,
                    headers=headers,
                )
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except ApiError as exc:
            return web.json_response(exc.body, status=exc.code)

    def _route(self, path: str) -> tuple[Kind, str | None, str | None, str | None]:
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            rest = parts[3:]
        else:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({path})"
            )
        namespace = None
        if len(rest) > 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or rest[0] not in KINDS:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        kind = KINDS[rest[0]]
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else None
        return kind, namespace, name, sub

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        kind, namespace, name, sub = self._route(request.path)
        ns = namespace or "" if kind.namespaced else ""
        method = request.method
        if name is None:
            if method == "GET":
                if _flag(request.query.get("watch")):
                    return await self._watch(request, kind, namespace)
                return web.json_response(self._list(request, kind, namespace))
            if method == "POST":
                return web.json_response(
                    await self._post(kind, ns, await request.json()), status=201
                )
            raise ApiError(405, "MethodNotAllowed", f"{method} not allowed")
        key = (kind.plural, ns, name)
        if sub == "binding" and method == "POST":
            return web.json_response(self._bind(key, await request.json()), status=201)
        if sub == "eviction" and method == "POST":
            return web.json_response(self._evict(key, await request.json()), status=201)
        if method == "GET" and sub is None:
            if key not in self.objects:
                raise not_found(kind, name)
            return web.json_response(self.objects[key])
        if method == "PUT":
            return web.json_response(self._replace(kind, key, await request.json(), sub))
        if method == "PATCH":
            return web.json_response(
                self._patch(kind, key, await request.json(), request.content_type)
            )
        if method == "DELETE":
            body = await request.json() if request.can_read_body else {}
            grace = request.query.get("gracePeriodSeconds", body.get("gracePeriodSeconds"))
            return web.json_response(self._delete(kind, key, None if grace is None else int(grace)))
        raise ApiError(405, "MethodNotAllowed", f"{method} not allowed")

    def _list(self, request: web.Request, kind: Kind, namespace: str | None) -> Obj:
        labels = request.query.get("labelSelector", "")
        fields = request.query.get("fieldSelector", "")
        w = _Watcher(kind, namespace, labels, fields)
        items = [
            copy.deepcopy(o)
            for (p, _, _), o in sorted(self.objects.items())
            if p == kind.plural and self._visible(w, o)
        ]
        for item in items:  # list items carry no kind/apiVersion
            item.pop("kind", None)
            item.pop("apiVersion", None)
        return {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(self.revision)},
            "items": items,
        }

    async def _watch(
        self, request: web.Request, kind: Kind, namespace: str | None
    ) -> web.StreamResponse:
        q = request.query
        watcher = _Watcher(kind, namespace, q.get("labelSelector", ""), q.get("fieldSelector", ""))
        rv_text = q.get("resourceVersion", "")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)

        async def send(event: Obj) -> None:
            await response.write(json.dumps(event).encode() + b"\n")

        if rv_text not in ("", "0"):
            rv = int(rv_text)
            if rv < self.compacted:
                self.expired_watches += 1
                # What the API sends when etcd has compacted that revision away.
                await send(
                    {
                        "type": "ERROR",
                        "object": status(
                            410,
                            "Expired",
                            f"too old resource version: {rv} ({self.compacted})",
                        ),
                    }
                )
                return response
            backlog = [
                {"type": e, "object": copy.deepcopy(o)}
                for r, p, e, o in self.history
                if r > rv and p == kind.plural and self._visible(watcher, o)
            ]
        else:
            # No resourceVersion: synthetic ADDED events for what exists, then changes.
            backlog = [
                {"type": "ADDED", "object": copy.deepcopy(o)}
                for (p, _, _), o in sorted(self.objects.items())
                if p == kind.plural and self._visible(watcher, o)
            ]
        self._watchers.append(watcher)
        timeout = float(q.get("timeoutSeconds", "1800"))
        bookmarks = _flag(q.get("allowWatchBookmarks"))
        loop = asyncio.get_running_loop()
        ends = loop.time() + timeout
        try:
            for event in backlog:
                await send(event)
            while (left := ends - loop.time()) > 0:
                wait = min(left, self.bookmark_interval_s) if bookmarks else left
                try:
                    event = await asyncio.wait_for(watcher.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and loop.time() < ends:
                        await send(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "kind": kind.kind,
                                    "apiVersion": kind.api_version,
                                    "metadata": {"resourceVersion": str(self.revision)},
                                },
                            }
                        )
                    continue
                if event is None:
                    break
                await send(event)
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        finally:
            self._watchers.remove(watcher)
        return response

    async def _post(self, kind: Kind, ns: str, body: Obj) -> Obj:
        meta = body.setdefault("metadata", {})
        if kind.namespaced:
            if meta.get("namespace", ns) != ns:
                raise ApiError(
                    400,
                    "BadRequest",
                    "the namespace of the provided object does not match "
                    "the namespace sent on the request",
                )
            meta["namespace"] = ns
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "name or generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if kind.plural == "pods":
            body = await self._admit_pod(body)
            body.setdefault("status", {"phase": "Pending"})
            body["spec"].setdefault("schedulerName", "default-scheduler")
        key = (kind.plural, ns, meta["name"])
        if key in self.objects:
            raise ApiError(
                409,
                "AlreadyExists",
                f'{kind.plural} "{meta["name"]}" already exists',
                name=meta["name"],
                kind=kind.plural,
            )
        return self._create(kind, key, body)

    def _replace(self, kind: Kind, key: tuple[str, str, str], body: Obj, sub: str | None) -> Obj:
        current = self.objects.get(key)
        if current is None:
            raise not_found(kind, key[2])
        given = body.get("metadata", {}).get("resourceVersion")
        if given and given != current["metadata"]["resourceVersion"]:
            raise conflict(
                kind,
                key[2],
                "the object has been modified; please apply your changes to "
                "the latest version and try again",
            )
        if sub == "status":
            updated = copy.deepcopy(current)
            updated["status"] = body.get("status", {})
        else:
            updated = copy.deepcopy(body)
            # Immutable and server-owned fields stay as they are.
            for k in ("uid", "creationTimestamp", "deletionTimestamp", "namespace", "name"):
                if k in current["metadata"]:
                    updated["metadata"][k] = current["metadata"][k]
            if kind.plural == "pods":
                if updated.get("spec") != current.get("spec"):
                    raise ApiError(
                        422,
                        "Invalid",
                        f'Pod "{key[2]}" is invalid: spec: Forbidden: pod '
                        "updates may not change fields other than a few (image, "
                        "tolerations, activeDeadlineSeconds...)",
                    )
                updated["status"] = current.get("status", {})
        return self._store(kind, key, updated, "MODIFIED")

    def _patch(self, kind: Kind, key: tuple[str, str, str], body: Any, content_type: str) -> Obj:
        current = self.objects.get(key)
        if current is None:
            raise not_found(kind, key[2])
        if content_type == "application/json-patch+json":
            updated = json_patch(current, body)
        else:  # merge or strategic merge: for metadata labels/annotations they agree
            updated = merge_patch(current, body)
        given = body.get("metadata", {}).get("resourceVersion") if isinstance(body, dict) else None
        if given and given != current["metadata"]["resourceVersion"]:
            raise conflict(kind, key[2], "the object has been modified")
        return self._store(kind, key, updated, "MODIFIED")

    def _delete(self, kind: Kind, key: tuple[str, str, str], grace: int | None) -> Obj:
        current = self.objects.get(key)
        if current is None:
            raise not_found(kind, key[2])
        if kind.plural == "pods":
            return self._delete_pod(key, grace)
        self._delete_now(kind, key)
        return status(200, "", "deleted") | {"status": "Success"}

    def _delete_pod(self, key: tuple[str, str, str], grace: int | None) -> Obj:
        kind = KINDS["pods"]
        pod = self.objects[key]
        spec_grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
        grace = spec_grace if grace is None else grace
        if (
            grace == 0
            or not pod["spec"].get("nodeName")
            or pod["status"].get("phase")
            in (
                "Succeeded",
                "Failed",
            )
        ):
            return self._delete_now(kind, key)
        meta = pod["metadata"]
        if "deletionTimestamp" in meta and meta.get("deletionGracePeriodSeconds", grace) <= grace:
            return copy.deepcopy(pod)
        updated = copy.deepcopy(pod)
        updated["metadata"]["deletionTimestamp"] = _now()
        updated["metadata"]["deletionGracePeriodSeconds"] = grace
        return self._store(kind, key, updated, "MODIFIED")

    def _bind(self, key: tuple[str, str, str], body: Obj) -> Obj:
        kind = KINDS["pods"]
        pod = self.objects.get(key)
        if pod is None:
            raise not_found(kind, key[2])
        target = (body.get("target") or {}).get("name")
        if not target:
            raise ApiError(422, "Invalid", "Binding is invalid: target.name: Required value")
        if pod["spec"].get("nodeName"):
            raise conflict(
                kind,
                key[2],
                f'pod {key[2]} is already assigned to node "{pod["spec"]["nodeName"]}"',
            )
        if "deletionTimestamp" in pod["metadata"]:
            raise conflict(kind, key[2], "pod is being deleted, cannot be assigned to a host")
        updated = copy.deepcopy(pod)
        updated["spec"]["nodeName"] = target
        conditions = updated["status"].setdefault("conditions", [])
        conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": _now()})
        self._store(kind, key, updated, "MODIFIED")
        return status(201, "", "") | {"status": "Success"}

    def _evict(self, key: tuple[str, str, str], body: Obj) -> Obj:
        kind = KINDS["pods"]
        pod = self.objects.get(key)
        if pod is None:
            raise not_found(kind, key[2])
        labels = pod["metadata"].get("labels") or {}
        healthy = pod["status"].get("phase") == "Running"
        for pdb in self.list("poddisruptionbudgets", key[1]):
            selector = (pdb["spec"].get("selector") or {}).get("matchLabels") or {}
            if not selector or any(labels.get(k) != v for k, v in selector.items()):
                continue
            if not healthy:
                continue  # an unhealthy pod may always be evicted (IfHealthyBudget)
            matching = [
                p
                for p in self.list("pods", key[1])
                if all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())
            ]
            running = sum(1 for p in matching if p["status"].get("phase") == "Running")
            spec = pdb["spec"]
            if "minAvailable" in spec:
                allowed = running - int(spec["minAvailable"])
                need = int(spec["minAvailable"])
            else:
                allowed = int(spec.get("maxUnavailable", 0)) - (len(matching) - running)
                need = len(matching) - int(spec.get("maxUnavailable", 0))
            if allowed <= 0:
                name = pdb["metadata"]["name"]
                raise ApiError(
                    429,
                    "TooManyRequests",
                    "Cannot evict pod as it would violate the pod's disruption budget.",
                    causes=[
                        {
                            "reason": "DisruptionBudget",
                            "message": f"The disruption budget {name} needs {need} healthy pods "
                            f"and has {running} currently",
                        }
                    ],
                )
        # The pod says why it goes (what a Job's podFailurePolicy matches on).
        disrupted = copy.deepcopy(pod)
        disrupted["status"].setdefault("conditions", []).append(
            {
                "type": "DisruptionTarget",
                "status": "True",
                "reason": "EvictionByEvictionAPI",
                "message": "Eviction API: evicting",
                "lastTransitionTime": _now(),
            }
        )
        self._store(kind, key, disrupted, "MODIFIED")
        grace = (body.get("deleteOptions") or {}).get("gracePeriodSeconds")
        self._delete_pod(key, grace)
        return status(201, "", "") | {"status": "Success"}

    async def _admit_pod(self, pod: Obj) -> Obj:
        """Call the mutating webhook (failurePolicy Fail), as the API server would."""
        if self.webhook_url is None:
            return pod
        review = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": pod["metadata"].get("namespace", ""),
                "operation": "CREATE",
                "object": pod,
                "userInfo": {"username": "system:serviceaccount:test:kubectl"},
                "dryRun": False,
            },
        }
        context = (
            ssl.create_default_context(cafile=str(self.webhook_ca)) if self.webhook_ca else None
        )
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.post(
                    self.webhook_url,
                    json=review,
                    ssl=context if context else False,
                    timeout=aiohttp.ClientTimeout(total=10),
                ) as reply,
            ):
                answer = await reply.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ApiError(
                500, "InternalError", f"Internal error occurred: failed calling webhook: {exc}"
            ) from exc
        response = answer.get("response") or {}
        if response.get("uid") != review["request"]["uid"]:
            raise ApiError(500, "InternalError", "webhook answered another request uid")
        if not response.get("allowed"):
            result = response.get("status") or {}
            raise ApiError(
                int(result.get("code", 403)),
                "Forbidden",
                f"admission webhook denied the request: {result.get('message', '')}",
            )
        if response.get("patch"):
            if response.get("patchType") != "JSONPatch":
                raise ApiError(500, "InternalError", "webhook patchType must be JSONPatch")
            result_pod: Obj = json_patch(pod, json.loads(base64.b64decode(response["patch"])))
            return result_pod
        return pod


@dataclass
class Served:
    """A stand-in serving HTTPS, whose pods are wired by a webhook on `webhook_port`
    (served by the agent with `pki`'s server certificate)."""

    api: KubeApiStandIn
    url: str
    pki: Any  # tests.support.tls.Pki
    webhook_port: int


async def serve_with_webhook(folder: Path, bookmark_interval_s: float) -> Served:
    """Certificates in `folder`, a free port for the agent's webhook, and the stand-in
    started over TLS, calling that webhook at every pod create."""
    from gpusched.infra.embedded import free_port
    from tests.support.tls import make_pki

    pki = make_pki(folder)
    webhook_port = free_port()
    api = KubeApiStandIn(
        bookmark_interval_s=bookmark_interval_s,
        webhook_url=f"https://127.0.0.1:{webhook_port}/mutate",
        webhook_ca=pki.ca_file,
    )
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(pki.server_cert, pki.server_key)
    return Served(api, await api.start(context), pki, webhook_port)


def kubeconfig(url: str, token: str, ca_file: Path | None, path: Path) -> Path:
    """A kubeconfig naming the stand-in, as `kubectl config view --raw` would write it."""
    cluster: Obj = {"server": url}
    if ca_file is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_file.read_bytes()).decode()
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "standin", "cluster": cluster}],
        "users": [{"name": "gpusched-agent", "user": {"token": token}}],
        "contexts": [
            {"name": "standin", "context": {"cluster": "standin", "user": "gpusched-agent"}}
        ],
        "current-context": "standin",
    }
    path.write_text(json.dumps(config))
    return path
