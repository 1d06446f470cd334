"""The cluster agent's edge handlers: start and evict workloads, report the cluster.

Every handler is idempotent by itself (there is no inbox at the edge): a start for an
allocation already known is not started twice, an evict for a workload already gone
answers with how it ended, and events carry deterministic ids (publisher.event_id).

The agent runs only what admission sent (DESIGN §5a): a command whose envelope does not
come from that command's producer is rejected (dead-lettered and audited) before it
does anything. NATS permissions decide who may publish on the command subjects; this
check is the agent's own, in depth.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path
from typing import Final

from nats.aio.client import Client as NatsClient

from gpusched.agent.identity import prepare_workdir, workload_user
from gpusched.agent.publisher import Publisher, event_id
from gpusched.agent.reports import Reports, Stopped
from gpusched.agent.workloads import (
    ProcessWorkload,
    SimWorkload,
    Workload,
    WorkloadExit,
    WorkloadLaunchError,
)
from gpusched.contracts import messages as wire
from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.messages import (
    AllocationReleased,
    EvictWorkload,
    GpusReserved,
    GpusReturned,
    InferenceStats,
    InventoryChanged,
    InventoryLoaded,
    MigConfigure,
    NodeChange,
    NodeHealth,
    RenewCredentials,
    StartWorkload,
    StopReason,
    T,
)
from gpusched.contracts.subjects import Subjects, untelemetered_note
from gpusched.domain.inventory import GpuRef
from gpusched.infra.errors import Rejected
from gpusched.infra.settings import AgentSettings
from gpusched.infra.tasks import cancel_and_wait
from gpusched.simcluster.cluster import ClusterView, gpu_samples
from gpusched.simcluster.demand import InferenceDemand
from gpusched.simcluster.faults import SetNodeHealth
from gpusched.simcluster.load import inference_load

log = logging.getLogger(__name__)

INFERENCE_SERVICE = "chat"
_REMEMBERED_STOPS = 10_000
_SHUTDOWN_PUBLISH_S = 2.0
# Telemetry older than this is not worth sending after an outage: newer samples follow.
TELEMETRY_STALE_S = 30.0
# The services that send each command (the envelope's `source`): admission places
# workloads and lays out MIG; the checkpoint service evicts for its sagas, admission for
# a cancel or a replica scale-down. The simulated cluster's own inputs (sim.demand,
# sim.node_health, from the demo and `gpusched node`) are not commands to a real cluster.
COMMAND_SOURCES: Final[dict[str, frozenset[str]]] = {
    T.START_WORKLOAD: frozenset({"admission"}),
    T.EVICT_WORKLOAD: frozenset({"checkpoint", "admission"}),
    T.MIG_CONFIGURE: frozenset({"admission"}),
}


class Phase(StrEnum):
    RUNNING = "running"
    STOPPING = "stopping"  # the agent is ending it; its own exit is not news


@dataclass
class _Running:
    start: StartWorkload
    workload: Workload
    started: Envelope
    phase: Phase = Phase.RUNNING
    watcher: asyncio.Task[None] | None = None


class ClusterAgent:
    def __init__(
        self,
        publisher: Publisher,
        subjects: Subjects,
        settings: AgentSettings,
        *,
        agent_id: str,
        nats_url: str,
        connection: NatsClient,
        nats_ca: Path | None = None,
        evict_grace_s: float = 10.0,
        shutdown_grace_s: float = 3.0,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self._publisher = publisher
        self._s = subjects
        self._settings = settings
        self._workdir = Path(settings.workdir).resolve()
        # Resolved once, at start: a run_as that names no user, or root, stops the agent.
        self._user = workload_user(settings)
        prepare_workdir(self._workdir, self._user)
        self._nats_url = nats_url
        self._nc = connection
        # The CA a job needs to reach a NATS that requires TLS (never the agent's own
        # client certificate or key: those are the agent's identity).
        self._nats_ca = nats_ca
        self._evict_grace_s = evict_grace_s
        self._shutdown_grace_s = shutdown_grace_s
        self._now = clock
        self._reports = Reports(publisher, subjects, clock)
        self.view = ClusterView()
        self.demand_gpus = 0.0
        self._running: dict[str, _Running] = {}
        # The MIG layout of each GPU this (simulated) cluster was told to configure.
        self.mig_layouts: dict[GpuRef, tuple[str, ...]] = {}
        # Nodes this (simulated) cluster was told broke: nothing can be done on them.
        self.down_nodes: set[str] = set()
        self._stopped: OrderedDict[str, Stopped] = OrderedDict()
        self._tick = 0
        # Nodes already said to get no telemetry (said once each).
        self._unsampled: set[str] = set()
        self.agent_id = agent_id
        # The connection's reconnect count when agent.ready last went out (None: never).
        self._announced_at: int | None = None
        self._closing = False
        self._closed = asyncio.Event()

    @property
    def running_allocations(self) -> list[str]:
        return list(self._running)

    # --- commands ---------------------------------------------------------------------
    async def on_start(self, envelope: Envelope) -> None:
        _require_producer(envelope)
        start = envelope.payload(StartWorkload)
        alloc = start.allocation_id
        if self._closing:
            raise RuntimeError("the agent is shutting down")  # redelivered to the next agent
        if (entry := self._running.get(alloc)) is not None:
            # A redelivery: its first delivery may have failed to report the start.
            await self._reports.send(entry.started)
            return
        if alloc in self._stopped:
            log.info("ignoring a start for allocation %s, which already ran", alloc)
            return
        # An outage while launching (Unavailable) is not caught: nothing was tracked or
        # reported, and the consumer applies this same command again once NATS is back.
        try:
            workload = self._make_workload(start)
            await workload.launch()
        except WorkloadLaunchError as exc:
            log.warning("cannot start %s (job %s): %s", alloc, start.job_id, exc)
            failed = WorkloadExit(StopReason.FAILED, error=str(exc))
            await self._report_stop(start, failed, saga_id=None, causation_id=envelope.id)
            return
        node = start.gpus[0].node if start.gpus else (start.node or "")
        started = self._reports.started(alloc, start.job_id, node, envelope.id)
        # Tracked before the report goes out: if publishing fails, the redelivered
        # command finds the workload running and reports it again.
        entry = _Running(start, workload, started)
        self._running[alloc] = entry
        entry.watcher = asyncio.create_task(self._watch(entry), name=f"watch-{alloc}")
        log.info(
            "started %s workload for job %s (allocation %s)",
            start.workload.kind,
            start.job_id,
            alloc,
        )
        await self._reports.send(started)

    async def on_renew_credentials(self, envelope: Envelope) -> None:
        """Fresh credentials for a running process workload (its file is rewritten); a
        renewal for an allocation not running here is stale and changes nothing."""
        renewal = envelope.payload(RenewCredentials)
        entry = self._running.get(renewal.allocation_id)
        if entry is None or entry.start.job_id != renewal.job_id:
            return
        renew = getattr(entry.workload, "renew_credentials", None)
        if renew is not None:
            renew(renewal.credentials)

    async def on_evict(self, envelope: Envelope) -> None:
        _require_producer(envelope)
        evict = envelope.payload(EvictWorkload)
        alloc = evict.allocation_id
        entry = self._running.get(alloc)
        if entry is not None and entry.start.job_id != evict.job_id:
            await self._evict_failed(
                evict, envelope.id, f"allocation {alloc} runs job {entry.start.job_id}"
            )
            return
        if entry is None:
            stopped = self._stopped.get(alloc)
            if stopped is None:
                await self._evict_failed(evict, envelope.id, "no such workload on this cluster")
            else:
                # Already gone (a redelivered evict, or it ended on its own first):
                # answer with how it ended, for this saga.
                await self._reports.stopped(alloc, stopped, evict.saga_id, envelope.id)
            return
        if entry.phase is Phase.STOPPING:
            return  # the agent is already ending it and will report it
        entry.phase = Phase.STOPPING
        exit_code = await entry.workload.stop(self._evict_grace_s)
        await self._forget_watcher(entry)
        log.info("evicted job %s (allocation %s, saga %s)", evict.job_id, alloc, evict.saga_id)
        await self._report_stop(
            entry.start,
            WorkloadExit(StopReason.EVICTED, exit_code=exit_code),
            saga_id=evict.saga_id,
            causation_id=envelope.id,
        )

    async def on_mig_configure(self, envelope: Envelope) -> None:
        """Apply a MIG layout change and report it (or why it could not be applied).
        Simulated: the layout is recorded (a real agent runs the MIG reconfiguration on
        the empty GPU admission chose)."""
        _require_producer(envelope)
        command = envelope.payload(MigConfigure)
        ref = GpuRef(command.node, command.gpu)
        error = self._mig_refusal(ref)
        if error is not None:
            log.warning("cannot change the MIG layout of %s: %s", ref, error)
            await self._reports.mig_failed(
                command.change_id, command.node, command.gpu, error, envelope.id
            )
            return
        self.mig_layouts[ref] = tuple(command.profiles)
        log.info(
            "MIG layout of %s/%d is now %s",
            command.node,
            command.gpu,
            "+".join(command.profiles) or "none",
        )
        await self._reports.mig_configured(
            command.change_id, command.node, command.gpu, command.profiles, envelope.id
        )

    def _mig_refusal(self, ref: GpuRef) -> str | None:
        """Why a layout change of ``ref`` cannot be applied now (None: it can): a
        reconfiguration resets the GPU, so it needs a live node and an idle GPU."""
        if ref.node in self.down_nodes:
            return f"node {ref.node} is down"
        for entry in self._running.values():
            if any((g.node, g.index) == (ref.node, ref.index) for g in entry.start.gpus):
                return f"GPU {ref} still runs allocation {entry.start.allocation_id}"
        return None

    async def on_sim_demand(self, envelope: Envelope) -> None:
        self.demand_gpus = envelope.payload(InferenceDemand).gpus
        log.info("simulated inference demand is now %.2f GPUs", self.demand_gpus)

    async def on_set_node_health(self, envelope: Envelope) -> None:
        """The simulated cluster is told a node broke (or was fixed): what ran there dies
        with it, and the agent reports the node's health as a real agent would."""
        command = envelope.payload(SetNodeHealth)
        if not command.healthy:
            self.down_nodes.add(command.node)
            await self._lose_node(command.node)
        else:
            self.down_nodes.discard(command.node)
        await self._publisher.publish(
            self._s.event("agent", T.NODE_HEALTH),
            T.NODE_HEALTH,
            NodeHealth(
                node=command.node,
                healthy=command.healthy,
                reason=command.reason,
                time=self._now(),
            ),
            correlation_id=command.node,
            causation_id=envelope.id,
            envelope_id=event_id(command.node, "health", envelope.id),
        )

    # --- admission's events: what exists and what serves inference ---------------------
    async def on_admission_event(self, envelope: Envelope) -> None:
        if envelope.type == T.INVENTORY_LOADED:
            self.view.apply_inventory(envelope.payload(InventoryLoaded).nodes)
        elif envelope.type == T.INVENTORY_CHANGED:
            changed = envelope.payload(InventoryChanged)
            self.view.apply_node_change(changed.change, changed.node)
            if changed.change in (NodeChange.FAILED, NodeChange.REMOVED):
                # Admission has ended these allocations already (an operator failed the
                # node): nothing of theirs may keep running.
                await self._lose_node(changed.node.name)
        elif envelope.type == T.GPUS_RESERVED:
            reserved = envelope.payload(GpusReserved)
            self.view.apply_reserved(
                reserved.reservation_id, _refs(reserved.gpus), _refs(reserved.pending)
            )
        elif envelope.type == T.GPUS_RETURNED:
            returned = envelope.payload(GpusReturned)
            self.view.apply_returned(returned.reservation_id, _refs(returned.gpus))
        elif envelope.type == T.ALLOCATION_RELEASED:
            released = envelope.payload(AllocationReleased)
            held = set(_refs(released.still_held))
            self.view.apply_released(ref for ref in _refs(released.gpus) if ref not in held)

    # --- telemetry ----------------------------------------------------------------------
    async def publish_telemetry(self) -> None:
        if self._closing:
            return
        self._tick += 1
        now = self._now()
        training = {GpuRef(g.node, g.index) for e in self._running.values() for g in e.start.gpus}
        models = {g.node: g.model for e in self._running.values() for g in e.start.gpus}
        samples = gpu_samples(self.view, training, self.demand_gpus, self._tick, now, models)
        for node in sorted(set(self.view.nodes) - {s.node for s in samples} - self._unsampled):
            self._unsampled.add(node)
            log.warning("%s", untelemetered_note(node))
        for sample in samples:
            await self._publisher.publish(
                self._s.telemetry_gpu(sample.node),
                T.GPU_SAMPLE,
                sample,
                stale_after_s=TELEMETRY_STALE_S,
            )
        serving = len(self.view.serving_gpus())
        if serving == 0:
            return  # no inference service is deployed yet
        window = self._settings.telemetry_interval_s
        load = inference_load(self.demand_gpus, serving, window)
        stats = InferenceStats(
            service=INFERENCE_SERVICE,
            time=now,
            window_s=window,
            requests=load.requests,
            queue_depth=load.queue_depth,
            p50_ms=round(load.p50_ms, 3),
            p99_ms=round(load.p99_ms, 3),
        )
        await self._publisher.publish(
            self._s.telemetry_inference(INFERENCE_SERVICE),
            T.INFERENCE_STATS,
            stats,
            stale_after_s=TELEMETRY_STALE_S,
        )

    # --- lifecycle ----------------------------------------------------------------------
    async def announce_if_due(self, caught_up: Callable[[], Awaitable[bool]]) -> bool:
        """Say `agent.ready` once after start and once after every reconnect to NATS,
        as soon as the agent has caught up with admission's events (it then knows its
        nodes). True if it announced now."""
        if self._closing or not self._nc.is_connected:
            return False
        epoch = int(self._nc.stats.get("reconnects", 0))
        if epoch == self._announced_at or not await caught_up():
            return False
        self._announced_at = epoch
        await self.announce()
        return True

    async def announce(self) -> None:
        """Publish `agent.ready`: this agent, its nodes and the allocations it runs."""
        running = sorted(a for a, e in self._running.items() if e.phase is Phase.RUNNING)
        await self._reports.ready(self.agent_id, sorted(self.view.nodes), running)

    async def supervise(self) -> None:
        """Runs for the agent's life; when the runtime stops (cancels it), no workload
        outlives the agent."""
        try:
            await self._closed.wait()
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop every workload (a sim job checkpoints first if it can within the grace;
        processes get SIGTERM, then SIGKILL) and report them interrupted: admission
        requeues them from their newest verified checkpoint. Bounded in time."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            entries = [e for e in self._running.values() if e.phase is Phase.RUNNING]
            for entry in entries:
                entry.phase = Phase.STOPPING
            codes = await asyncio.gather(
                *(e.workload.stop(self._shutdown_grace_s, checkpoint=True) for e in entries),
                return_exceptions=True,
            )
            for entry, code in zip(entries, codes, strict=True):
                await self._forget_watcher(entry)
                exit_code = code if isinstance(code, int) else None
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(
                        self._report_stop(
                            entry.start,
                            WorkloadExit(
                                StopReason.INTERRUPTED, exit_code, "the cluster agent stopped"
                            ),
                            saga_id=None,
                            causation_id=None,
                        ),
                        _SHUTDOWN_PUBLISH_S,
                    )
            # The cluster goes away with the agent; say so if the bus still listens.
            left = await self._publisher.close(_SHUTDOWN_PUBLISH_S)
            if left:
                log.warning("agent stopped with %d report(s) undelivered", left)
        finally:
            self._running.clear()
            self._closed.set()

    # --- plumbing -----------------------------------------------------------------------
    async def _lose_node(self, node: str) -> None:
        """Stop every workload with a GPU on ``node`` without reporting it: the node's
        failure is the news, and admission ends their allocations from it (a stop report
        could otherwise settle a job as failed before the failure is known)."""
        lost = [
            entry
            for entry in self._running.values()
            if entry.phase is Phase.RUNNING
            and (entry.start.node == node or any(g.node == node for g in entry.start.gpus))
        ]
        for entry in lost:
            entry.phase = Phase.STOPPING
            exit_code = await entry.workload.stop(self._evict_grace_s)
            await self._forget_watcher(entry)
            alloc = entry.start.allocation_id
            self._running.pop(alloc, None)
            self._stopped[alloc] = Stopped(
                entry.start.job_id, StopReason.FAILED, self._now(), exit_code
            )
            log.info("job %s lost with node %s (allocation %s)", entry.start.job_id, node, alloc)

    def _make_workload(self, start: StartWorkload) -> Workload:
        if start.workload.kind == "pod":
            raise WorkloadLaunchError(
                "a pod workload runs on Kubernetes only (GPUSCHED_AGENT__CLUSTER=kubernetes)"
            )
        if start.workload.kind == "process":
            return ProcessWorkload(
                start,
                nats_url=self._nats_url,
                prefix=self._s.prefix,
                workdir=self._workdir,
                user=self._user,
                pass_env=self._settings.workload_env,
                nats_ca=self._nats_ca,
            )
        return SimWorkload(
            start,
            connection=self._nc,
            prefix=self._s.prefix,
            workdir=self._workdir,
            time_scale=self._settings.time_scale,
        )

    async def _watch(self, entry: _Running) -> None:
        try:
            result = await entry.workload.wait()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("workload %s crashed", entry.start.allocation_id)
            result = WorkloadExit(StopReason.FAILED, error=repr(exc))
        if entry.phase is not Phase.RUNNING:
            return  # an evict or the shutdown is ending it and reports it
        entry.phase = Phase.STOPPING
        log.info(
            "job %s %s (allocation %s): %s",
            entry.start.job_id,
            result.reason.value,
            entry.start.allocation_id,
            result.error or "exit code 0",
        )
        await self._report_stop(entry.start, result, saga_id=None, causation_id=None)

    async def _forget_watcher(self, entry: _Running) -> None:
        watcher, entry.watcher = entry.watcher, None
        if watcher is not None and watcher is not asyncio.current_task():
            await cancel_and_wait(watcher)

    async def _report_stop(
        self,
        start: StartWorkload,
        result: WorkloadExit,
        *,
        saga_id: str | None,
        causation_id: str | None,
    ) -> None:
        alloc = start.allocation_id
        stopped = Stopped(start.job_id, result.reason, self._now(), result.exit_code)
        # Recorded before publishing: a redelivered evict finds it and publishes again.
        self._running.pop(alloc, None)
        self._stopped[alloc] = stopped
        while len(self._stopped) > _REMEMBERED_STOPS:
            self._stopped.popitem(last=False)
        await self._reports.stopped(alloc, stopped, saga_id, causation_id)

    async def _evict_failed(self, evict: EvictWorkload, causation_id: str, error: str) -> None:
        log.warning("cannot evict %s (saga %s): %s", evict.allocation_id, evict.saga_id, error)
        await self._reports.evict_failed(evict, causation_id, error)


def _require_producer(envelope: Envelope) -> None:
    """Reject a command that its producer did not send: nothing of it is applied."""
    allowed = COMMAND_SOURCES[envelope.type]
    if envelope.source not in allowed:
        log.warning(
            "refused %s %s from %r: only %s send it",
            envelope.type,
            envelope.id,
            envelope.source,
            " or ".join(sorted(allowed)),
        )
        raise Rejected(
            f"{envelope.type} from {envelope.source!r} refused: only "
            f"{' or '.join(sorted(allowed))} may send it to the cluster agent"
        )


def _refs(gpus: Iterable[wire.GpuRef]) -> list[GpuRef]:
    return [GpuRef(g.node, g.index) for g in gpus]
