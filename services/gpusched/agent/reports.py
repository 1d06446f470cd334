"""What any cluster edge reports about workloads and MIG changes, one way for both
agents (the simulated cluster and Kubernetes): the same events, subjects, correlation
and deterministic envelope ids (publisher.event_id), so a redelivered command or a
re-observed pod reports the very same event and consumers drop the copy."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from gpusched.agent.publisher import Publisher, event_id
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import (
    AgentReady,
    EvictFailed,
    EvictWorkload,
    MigConfigured,
    MigConfigureFailed,
    StopReason,
    T,
    WorkloadStarted,
    WorkloadStopped,
)
from gpusched.contracts.subjects import Subjects

__all__ = ["Reports", "Stopped"]

log = logging.getLogger(__name__)

# An evict failure's error as reported: enough to say what went wrong.
ERROR_MAX = 1000


@dataclass(frozen=True, slots=True)
class Stopped:
    """How a workload ended, remembered so a late or repeated command is answered alike."""

    job_id: str
    reason: StopReason
    stopped_at: datetime
    exit_code: int | None


class Reports:
    def __init__(
        self, publisher: Publisher, subjects: Subjects, clock: Callable[[], datetime]
    ) -> None:
        self._publisher = publisher
        self._s = subjects
        self._now = clock

    def started(
        self, alloc: str, job_id: str, node: str, causation_id: str | None = None
    ) -> Envelope:
        """The started event, made now and sent by the caller when it is due."""
        return self._publisher.envelope(
            T.WORKLOAD_STARTED,
            WorkloadStarted(allocation_id=alloc, job_id=job_id, node=node, started_at=self._now()),
            correlation_id=job_id,
            causation_id=causation_id,
            envelope_id=event_id(alloc, "started"),
        )

    async def send(self, event: Envelope) -> None:
        await self._publisher.send(self._s.event("agent", T(event.type)), event)

    async def stopped(
        self, alloc: str, stopped: Stopped, saga_id: str | None, causation_id: str | None
    ) -> None:
        await self._publisher.publish(
            self._s.event("agent", T.WORKLOAD_STOPPED),
            T.WORKLOAD_STOPPED,
            WorkloadStopped(
                allocation_id=alloc,
                job_id=stopped.job_id,
                reason=stopped.reason,
                stopped_at=stopped.stopped_at,
                exit_code=stopped.exit_code,
                saga_id=saga_id,
            ),
            correlation_id=saga_id or stopped.job_id,
            causation_id=causation_id,
            envelope_id=event_id(alloc, "stopped", saga_id or ""),
        )

    async def evict_failed(
        self, evict: EvictWorkload, causation_id: str, error: str, *id_parts: str
    ) -> None:
        """``id_parts``: more of what makes this failure one fact (e.g. the attempt's
        command), for an edge that may fail the same eviction more than once."""
        await self._publisher.publish(
            self._s.event("agent", T.EVICT_FAILED),
            T.EVICT_FAILED,
            EvictFailed(
                allocation_id=evict.allocation_id,
                job_id=evict.job_id,
                saga_id=evict.saga_id,
                error=error[:ERROR_MAX],
            ),
            correlation_id=evict.saga_id,
            causation_id=causation_id,
            envelope_id=event_id(evict.allocation_id, "evict_failed", evict.saga_id, *id_parts),
        )

    async def ready(self, agent_id: str, nodes: list[str], running: list[str]) -> None:
        """The agent is up: its nodes and the allocations running on them (admission
        reconciles its ledger with them)."""
        log.info(
            "agent %s ready: %d node(s), %d allocation(s) running",
            agent_id,
            len(nodes),
            len(running),
        )
        await self._publisher.publish(
            self._s.event("agent", T.AGENT_READY),
            T.AGENT_READY,
            AgentReady(agent_id=agent_id, nodes=nodes, running=running, time=self._now()),
            correlation_id=agent_id,
        )

    async def mig_configured(
        self, change_id: str, node: str, gpu: int, profiles: list[str], causation_id: str
    ) -> None:
        await self._publisher.publish(
            self._s.event("agent", T.MIG_CONFIGURED),
            T.MIG_CONFIGURED,
            MigConfigured(
                change_id=change_id, node=node, gpu=gpu, profiles=profiles, applied_at=self._now()
            ),
            correlation_id=change_id,
            causation_id=causation_id,
            envelope_id=event_id(change_id, "mig"),
        )

    async def mig_failed(
        self, change_id: str, node: str, gpu: int, error: str, causation_id: str
    ) -> None:
        await self._publisher.publish(
            self._s.event("agent", T.MIG_CONFIGURE_FAILED),
            T.MIG_CONFIGURE_FAILED,
            MigConfigureFailed(
                change_id=change_id, node=node, gpu=gpu, error=error, time=self._now()
            ),
            correlation_id=change_id,
            causation_id=causation_id,
            envelope_id=event_id(change_id, "mig-failed"),
        )
