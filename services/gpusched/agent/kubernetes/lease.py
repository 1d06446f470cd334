"""Leader election with a coordination.k8s.io/v1 Lease, as client-go's leaderelection.

One replica holds the Lease and renews it every third of its duration; the others try
every few seconds and take it once it has not been renewed for a whole duration. A
leader that cannot renew within the duration stops (its process exits and is
restarted as a follower), so two agents never act on the cluster at once for longer
than the skew between their clocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import datetime, timedelta

from gpusched.contracts.envelope import utcnow
from gpusched.infra.errors import Unavailable

from .kube import Conflict, Kube, NotFound

log = logging.getLogger(__name__)

_FORMAT = "%Y-%m-%dT%H:%M:%S.%fZ"  # metav1.MicroTime


def _stamp(moment: datetime) -> str:
    return moment.strftime(_FORMAT)


def _parse(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return datetime.strptime(text, _FORMAT).replace(tzinfo=utcnow().tzinfo)
    except ValueError:
        return None


class LeaderLease:
    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        identity: str,
        duration_s: float,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._kube = kube
        self._namespace = namespace
        self._name = name
        self.identity = identity
        self._duration = duration_s
        self._now = clock

    async def try_acquire(self) -> bool:
        """Take or renew the lease; True if this replica holds it now."""
        now = self._now()
        try:
            lease = await self._kube.get_lease(self._namespace, self._name)
        except NotFound:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self._name, "namespace": self._namespace},
                "spec": self._spec(now, now, 0),
            }
            try:
                await self._kube.create_lease(self._namespace, body)
            except Conflict:
                return False  # another replica created it first
            return True
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity")
        renewed = _parse(spec.get("renewTime"))
        duration = float(spec.get("leaseDurationSeconds") or self._duration)
        expired = renewed is None or now - renewed > timedelta(seconds=duration)
        if holder not in (None, "", self.identity) and not expired:
            return False
        transitions = int(spec.get("leaseTransitions") or 0) + (holder != self.identity)
        acquired = _parse(spec.get("acquireTime")) if holder == self.identity else now
        lease["spec"] = self._spec(acquired or now, now, transitions)
        try:
            await self._kube.replace_lease(lease)  # carries the resourceVersion read
        except Conflict:
            return False
        return True

    def _spec(self, acquired: datetime, renewed: datetime, transitions: int) -> dict[str, object]:
        return {
            "holderIdentity": self.identity,
            "leaseDurationSeconds": max(1, round(self._duration)),
            "acquireTime": _stamp(acquired),
            "renewTime": _stamp(renewed),
            "leaseTransitions": transitions,
        }

    async def acquire(self) -> None:
        """Wait until this replica leads."""
        announced = False
        while True:
            try:
                if await self.try_acquire():
                    log.info(
                        "leading as %s (lease %s/%s)", self.identity, self._namespace, self._name
                    )
                    return
            except Unavailable as exc:
                log.warning("cannot reach the Kubernetes API for the lease: %s", exc)
            if not announced:
                log.info("another agent leads (lease %s/%s): waiting", self._namespace, self._name)
                announced = True
            await asyncio.sleep(max(1.0, self._duration / 3))

    async def keep(self, stopping: asyncio.Event, lost: Callable[[], None]) -> None:
        """Renew until `stopping`; call `lost` once the lease could not be renewed for a
        whole duration (or another replica took it)."""
        last = self._now()
        while not stopping.is_set():
            try:
                await asyncio.wait_for(stopping.wait(), self._duration / 3)
                return
            except TimeoutError:
                pass
            try:
                if await self.try_acquire():
                    last = self._now()
                    continue
                log.error("another agent took the lease %s/%s", self._namespace, self._name)
            except Unavailable as exc:
                if self._now() - last < timedelta(seconds=self._duration):
                    log.warning("lease renewal failed (%s): retrying", exc)
                    continue
                log.error("lease not renewed for %.0fs: stepping down", self._duration)
            lost()
            return
