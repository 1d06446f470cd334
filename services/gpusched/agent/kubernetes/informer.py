"""List then watch one kind of object, keeping a cache that survives real API behaviour.

The pattern of client-go's reflector: a list gives the objects and a resourceVersion;
a watch from that version streams every change after it; bookmarks move the version
on without an object; a watch the server ends is opened again from the last version;
`410 Gone` (the version was compacted away) means list again and tell the owner what
changed meanwhile (including what was deleted unseen); an unreachable API is waited
out with a growing pause. After every (re)list `synced` is set: the agent holds no
durable state, and its view after a restart is this cache.

The owner is told of every change as `(event_type, object)`; it must be quick (it
marks work to do, it does not call the API).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

from gpusched.infra.errors import is_outage

from .kube import Gone, Kube, KubeError

log = logging.getLogger(__name__)

Obj = dict[str, Any]
Key = tuple[str, str]
Listener = Callable[[str, Obj], None]


def key_of(obj: Obj) -> Key:
    meta = obj.get("metadata") or {}
    return (str(meta.get("namespace", "")), str(meta.get("name", "")))


class Informer:
    def __init__(
        self,
        kube: Kube,
        kind: str,
        listener: Listener,
        *,
        field_selector: str = "",
        watch_timeout_s: int = 300,
    ) -> None:
        self._kube = kube
        self.kind = kind
        self._listener = listener
        self._fields = field_selector
        self._timeout = watch_timeout_s
        self.cache: dict[Key, Obj] = {}
        self.resource_version = ""
        self.synced = asyncio.Event()
        self.relists = 0  # how often it had to list again (410 Gone, an outage)

    async def run(self) -> None:
        pause = 0.2
        while True:
            try:
                await self._list()
                pause = 0.2
                while True:
                    await self._watch()
            except Gone as exc:
                log.info("%s watch expired (%s): listing again", self.kind, exc.message)
                self.relists += 1
            except KubeError as exc:
                log.warning("%s watch refused: %s; listing again in %.1fs", self.kind, exc, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, 10.0)
                self.relists += 1
            except Exception as exc:
                if not is_outage(exc):
                    raise
                log.warning("Kubernetes API unavailable (%s): retrying in %.1fs", exc, pause)
                await asyncio.sleep(pause * (0.5 + random.random()))
                pause = min(pause * 2, 10.0)
                self.relists += 1

    async def _list(self) -> None:
        listed = await self._kube.list(self.kind, self._fields)
        items = listed.get("items") or []
        fresh: dict[Key, Obj] = {}
        for item in items:
            fresh[key_of(item)] = item
        gone = [obj for key, obj in self.cache.items() if key not in fresh]
        self.cache = fresh
        self.resource_version = str((listed.get("metadata") or {}).get("resourceVersion", ""))
        for obj in gone:
            self._listener("DELETED", obj)
        for obj in fresh.values():
            self._listener("SYNC", obj)
        self.synced.set()

    async def _watch(self) -> None:
        async for event in self._kube.watch(
            self.kind, self.resource_version, self._timeout, self._fields
        ):
            kind, obj = event["type"], event["object"]
            version = str((obj.get("metadata") or {}).get("resourceVersion", ""))
            if kind == "BOOKMARK":
                self.resource_version = version or self.resource_version
                continue
            key = key_of(obj)
            if kind == "DELETED":
                self.cache.pop(key, None)
            elif kind in ("ADDED", "MODIFIED"):
                self.cache[key] = obj
            else:
                continue
            self.resource_version = version or self.resource_version
            self._listener(kind, obj)
