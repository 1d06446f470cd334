"""The Kubernetes agent: the cluster agent's subject contract, carried out on a cluster.

In: workload.start / workload.evict / workload.credentials / mig.configure commands and
admission's events. Out: workload.started / stopped / evict_failed, mig.configured /
configure_failed, node.health, agent.ready, and the nodes and jobs API requests that
keep admission's inventory and queue in step with the cluster.

It holds nothing durable: its view is two informers (nodes; pods of the gpusched
scheduler) rebuilt by a list at every start, plus admission's event history replayed
from the stream. What it decides is in the pure modules (nodes, pods, webhook, mig);
here are the calls and the bookkeeping that makes every handler idempotent:

- a pod's gpusched job id, allocation and attempt are annotations on the pod itself,
  so a restarted agent finds which pods run which allocation;
- envelope ids are deterministic (publisher.event_id), so a report sent again after a
  restart or a redelivery is dropped by JetStream and by every consumer's inbox;
- updates carry the object's resourceVersion and are retried on 409 Conflict (a pod's
  annotations are merged in, which needs none); an unreachable API is an outage
  (`Unavailable`): the command is applied again later.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml
from nats.aio.client import Client as NatsClient

from gpusched.agent.handlers import COMMAND_SOURCES
from gpusched.agent.publisher import Publisher
from gpusched.agent.reports import Reports, Stopped
from gpusched.agent.workloads import mps_environment, without_credentials
from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.messages import (
    AllocationGranted,
    AllocationReleased,
    AuditRecord,
    EvictWorkload,
    InventoryChanged,
    InventoryLoaded,
    MigConfigure,
    NodeChange,
    NodeHealth,
    NodeReply,
    NodeState,
    NodeVerb,
    RenewCredentials,
    StartWorkload,
    StopReason,
    SubmitReply,
    T,
)
from gpusched.contracts.subjects import Subjects
from gpusched.infra.errors import Rejected, Unavailable
from gpusched.infra.settings import KubernetesSettings
from gpusched.infra.tls import TlsSettings
from gpusched.sdk.environment import JobEnvironment

from . import labels as L
from . import mig
from .informer import Informer, Key, key_of
from .kube import Conflict, Kube, KubeError, NotFound, TooManyRequests
from .nodes import Action, KnownNode, NodeProblem, ObservedNode, known_from_wire, observe, reconcile
from .pods import (
    DraNames,
    GangMismatch,
    GpuschedPod,
    Outcome,
    Owner,
    PodRefused,
    Progress,
    assign_gang,
    claim_allocation,
    claimed_devices,
    crowd_refusal,
    crowded_controllers,
    gang_outcome,
    gpu_claim,
    is_gpusched_pod,
    job_secret,
    outcome,
    read_pod,
    submission,
    successor,
    successor_suffix,
    team_of_namespace,
)

log = logging.getLogger(__name__)

Obj = dict[str, Any]
_REQUEST_S = 10.0
# A node change sent to admission is not sent again until its event arrives or this passes.
_RESEND_S = 20.0
_CONFLICT_RETRIES = 5
_REMEMBERED_STOPS = 10_000
_SUBMITS_AT_ONCE = 16
# A pod whose submit admission failed on unexpectedly (an `internal` answer) is
# submitted again after this long.
_RETRY_FAILED_SUBMIT_S = 30.0
# How long a start waits for a Job controller to make the pods of a later attempt.
_CONTROLLER_POD_WAIT_S = 30.0


class StartFailed(Exception):
    """A start that cannot be carried out (the pods' fault or the placement's): reported
    as the workload stopped, failed, with this reason."""


@dataclass
class _MigChange:
    change_id: str
    node: str
    gpu: int
    profiles: list[str]
    config: str
    deadline: float
    causation_id: str


@dataclass
class _Allocation:
    """What the agent knows of an allocation it started (or found bound at a restart)."""

    job_id: str
    pods: set[Key] = field(default_factory=set)
    started_reported: bool = False
    saga_id: str | None = None  # set while the checkpoint saga evicts it


class KubernetesAgent:
    def __init__(
        self,
        kube: Kube,
        publisher: Publisher,
        subjects: Subjects,
        settings: KubernetesSettings,
        nc: NatsClient,
        *,
        api: NatsClient | None = None,
        agent_id: str,
        nats_url: str,
        nats_ca: str | None = None,
        clock: Callable[[], datetime] = utcnow,
    ) -> None:
        self.kube = kube
        self._publisher = publisher
        self._s = subjects
        self._settings = settings
        self._nc = nc
        # Submits and node commands go as a cluster agent (its own API credential), so
        # admission takes pods only for the teams that credential names.
        self._api = api or nc
        self.agent_id = agent_id
        self._pod_nats_url = settings.pod_nats_url or without_credentials(nats_url)
        # The CA the job pods verify NATS's certificate with (PEM), in their Secrets.
        self._pod_nats_ca = nats_ca
        self._now = clock
        self._reports = Reports(publisher, subjects, clock)
        self._names = DraNames(
            settings.dra_driver,
            settings.dra_device_class,
            settings.dra_device,
            settings.dra_mig_device,
        )
        self.pods = Informer(
            kube,
            "pods",
            self._on_pod,
            field_selector=f"spec.schedulerName={settings.scheduler_name}",
            watch_timeout_s=settings.watch_timeout_s,
        )
        self.nodes = Informer(
            kube, "nodes", self._on_node, watch_timeout_s=settings.watch_timeout_s
        )
        self.namespaces = Informer(
            kube, "namespaces", self._on_namespace, watch_timeout_s=settings.watch_timeout_s
        )
        self._wake = asyncio.Event()
        self._admission: dict[str, KnownNode] = {}
        self._granted: dict[str, AllocationGranted] = {}
        self._allocations: dict[str, _Allocation] = {}
        self._stopped: OrderedDict[str, Stopped] = OrderedDict()
        # Allocations admission released (why), from its event history: their pods must
        # not run on, nor be reported running, whoever ended them.
        self._released: OrderedDict[str, str] = OrderedDict()
        self._deleted: list[Obj] = []
        self._sent: dict[tuple[str, Action], float] = {}
        self._failed_nodes: set[str] = set()
        self._node_problems: dict[str, str] = {}
        self._refused: dict[Key, str] = {}
        # Refusals that a change of the cluster may lift, and which change: the pod's
        # namespace getting its team ("namespace"), a GPU node joining ("capacity"), or
        # time passing after admission failed on the submit ("retry").
        self._may_lift: dict[Key, str] = {}
        self._refused_at: dict[Key, float] = {}  # monotonic time of the refusal
        self._mig: dict[str, _MigChange] = {}
        self._announced_at: int | None = None
        self._closing = False
        self._tasks: set[asyncio.Future[None]] = set()

    # --- informer listeners: quick, they only mark work ---------------------------------
    def _on_pod(self, kind: str, pod: Obj) -> None:
        if kind == "DELETED":
            self._deleted.append(pod)
        self._wake.set()

    def _on_node(self, kind: str, node: Obj) -> None:
        self._wake.set()

    def _on_namespace(self, kind: str, namespace: Obj) -> None:
        # Its team may have been set or changed: pods refused for it are looked at again.
        name = str((namespace.get("metadata") or {}).get("name", ""))
        self._lift(lambda key, why: why == "namespace" and key[0] == name)

    def _lift(self, which: Callable[[Key, str], bool]) -> None:
        """Forget the refusals `which` selects, so their pods are looked at again."""
        lifted = [key for key, why in self._may_lift.items() if which(key, why)]
        for key in lifted:
            del self._may_lift[key]
            self._refused.pop(key, None)
            self._refused_at.pop(key, None)
        if lifted:
            self._wake.set()

    @property
    def synced(self) -> bool:
        return all(i.synced.is_set() for i in (self.pods, self.nodes, self.namespaces))

    # --- admission's events ---------------------------------------------------------------
    async def on_admission_event(self, envelope: Envelope) -> None:
        if envelope.type == T.INVENTORY_LOADED:
            for n in envelope.payload(InventoryLoaded).nodes:
                self._admission[n.name] = known_from_wire(
                    n.name, n.pool, n.gpu_model, n.gpus, NodeState.UP
                )
        elif envelope.type == T.INVENTORY_CHANGED:
            changed = envelope.payload(InventoryChanged)
            node = changed.node
            if changed.change is NodeChange.REMOVED or changed.state is None:
                self._admission.pop(node.name, None)
            else:
                self._admission[node.name] = known_from_wire(
                    node.name, node.pool, node.gpu_model, node.gpus, changed.state
                )
            for action in Action:
                self._sent.pop((node.name, action), None)
            if changed.change in (NodeChange.ADDED, NodeChange.UNDRAINED, NodeChange.RECOVERED):
                # More GPUs: a pod refused as larger than the cluster may fit now.
                self._lift(lambda key, why: why == "capacity")
        elif envelope.type == T.ALLOCATION_GRANTED:
            granted = envelope.payload(AllocationGranted)
            self._granted[granted.allocation_id] = granted
        elif envelope.type == T.ALLOCATION_RELEASED:
            released = envelope.payload(AllocationReleased)
            self._granted.pop(released.allocation_id, None)
            self._released[released.allocation_id] = released.reason
            while len(self._released) > _REMEMBERED_STOPS:
                self._released.popitem(last=False)
        self._wake.set()

    # --- the reconcile loop -----------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        """Bring admission and the cluster in step whenever either changes (and every few
        seconds: deadlines, retries). One pass at a time; a pass that meets an outage is
        tried again; a failing item is logged and skipped, never stops the loop."""
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 2.0)
            self._wake.clear()
            if not self.synced or self._closing:
                continue
            try:
                await self.reconcile_once()
            except Exception as exc:
                log.warning("reconcile pass interrupted (%r); trying again", exc)
                await asyncio.sleep(1.0)

    async def reconcile_once(self) -> None:
        await self._reconcile_nodes()
        await self._settle_deleted()
        await self._reconcile_pods()
        await self._check_mig()

    # --- nodes ------------------------------------------------------------------------------
    def observed_nodes(self) -> dict[str, ObservedNode]:
        observed: dict[str, ObservedNode] = {}
        for (_, name), obj in self.nodes.cache.items():
            try:
                node = observe(obj, self._settings.pool_label, self._settings.gpu_models)
            except NodeProblem as exc:
                if self._node_problems.get(name) != str(exc):
                    self._node_problems[name] = str(exc)
                    log.warning("%s", exc)
                    self._later(
                        self._event("Node", name, "", "GpuschedNodeIgnored", str(exc), "Warning")
                    )
                continue
            if node is not None:
                observed[name] = node
        return observed

    def _failed(self, observed: Iterable[str]) -> set[str]:
        """Admission's nodes that are failed, or that the cluster no longer has."""
        present = set(observed)
        return {
            name
            for name, known in self._admission.items()
            if known.state is NodeState.FAILED or name not in present
        }

    async def _reconcile_nodes(self) -> None:
        observed = self.observed_nodes()
        self._failed_nodes = self._failed(observed)
        now = time.monotonic()
        for step in reconcile(observed, self._admission):
            sent = self._sent.get((step.node, step.action))
            if sent is not None and now - sent < _RESEND_S:
                continue
            self._sent[(step.node, step.action)] = now
            try:
                await self._apply_node_action(step.action, step.node, step.reason, step.spec)
            except Unavailable:
                raise
            except Exception as exc:
                log.warning("node %s: %s failed: %r", step.node, step.action, exc)

    async def _apply_node_action(
        self, action: Action, node: str, reason: str, spec: Obj | None
    ) -> None:
        log.info("node %s: %s (%s)", node, action, reason)
        if action in (Action.FAIL, Action.RECOVER):
            healthy = action is Action.RECOVER
            if not healthy:
                self._failed_nodes.add(node)
            await self._publisher.publish(
                self._s.event("agent", T.NODE_HEALTH),
                T.NODE_HEALTH,
                NodeHealth(
                    node=node, healthy=healthy, reason=f"kubernetes: {reason}", time=self._now()
                ),
                correlation_id=node,
            )
            return
        operator = f"agent {self.agent_id}"
        if action is Action.ADD:
            body: Obj = {"spec": spec, "operator": operator, "reason": f"kubernetes: {reason}"}
            verb = NodeVerb.ADD
        else:
            verb = {
                Action.DRAIN: NodeVerb.DRAIN,
                Action.UNDRAIN: NodeVerb.UNDRAIN,
                Action.REMOVE: NodeVerb.REMOVE,
            }[action]
            body = {"node": node, "operator": operator, "reason": f"kubernetes: {reason}"}
        reply = NodeReply.model_validate_json(await self._request(self._s.api_nodes(verb), body))
        if not reply.ok and reply.error is not None:
            log.info("admission refused node %s %s: %s", verb, node, reply.error.message)

    async def _request(self, subject: str, body: Obj) -> bytes:
        import json

        try:
            msg = await self._api.request(subject, json.dumps(body).encode(), timeout=_REQUEST_S)
        except Exception as exc:
            raise Unavailable(f"admission did not answer on {subject}: {exc!r}") from exc
        return bytes(msg.data)

    # --- pods: submit, report ----------------------------------------------------------------
    def _pods(self) -> dict[Key, GpuschedPod]:
        read: dict[Key, GpuschedPod] = {}
        for key, obj in self.pods.cache.items():
            if not is_gpusched_pod(obj, self._settings.scheduler_name):
                continue
            try:
                read[key] = read_pod(obj)
            except PodRefused as exc:
                if key not in self._refused:
                    self._refused[key] = str(exc)
                    log.warning("%s", exc)
                    self._later(self._pod_event(obj, "GpuschedRefused", str(exc), "Warning"))
        return read

    async def _reconcile_pods(self) -> None:
        for key in [k for k in self._refused if k not in self.pods.cache]:
            self._refused.pop(key, None)  # the pod is gone: so is its refusal
            self._may_lift.pop(key, None)
            self._refused_at.pop(key, None)
        now = time.monotonic()
        self._lift(
            lambda key, why: (
                why == "retry" and now - self._refused_at.get(key, now) >= _RETRY_FAILED_SUBMIT_S
            )
        )
        pods = self._pods()
        groups: dict[tuple[str, str], list[GpuschedPod]] = defaultdict(list)
        by_alloc: dict[str, list[GpuschedPod]] = defaultdict(list)
        for pod in pods.values():
            if pod.allocation_id is not None:
                by_alloc[pod.allocation_id].append(pod)
            elif pod.job_id is None and not pod.bound and not pod.deleting:
                groups[pod.group].append(pod)
        crowded = crowded_controllers(
            p
            for key, p in pods.items()
            if not p.deleting and outcome(self.pods.cache[key]).progress is not Progress.ENDED
        )
        # A controller scaled down to one pod: that pod may be submitted after all.
        self._lift(
            lambda key, why: (
                why == "crowd"
                and (key not in pods or (pods[key].owner or Owner("", "", "")).uid not in crowded)
            )
        )
        ready: list[list[GpuschedPod]] = []
        for members in groups.values():
            if any(m.key in self._refused for m in members):
                continue
            owner = members[0].owner
            if owner is not None and owner.uid in crowded:
                await self._refuse(members, crowd_refusal(owner), lifted_by="crowd")
                continue
            if members[0].gang and len(members) < members[0].gang_size:
                continue  # the rest of the gang is not created yet
            ready.append(members)
        # Several at once: admission commits concurrent submits together, and each
        # submit is mostly waiting on it and on the API.
        limit = asyncio.Semaphore(_SUBMITS_AT_ONCE)

        async def submit(members: list[GpuschedPod]) -> None:
            async with limit:
                try:
                    await self._submit(members)
                except Unavailable:
                    raise
                except Exception as exc:
                    log.warning("submitting %s failed: %r", [m.name for m in members], exc)

        outcomes = await asyncio.gather(*(submit(m) for m in ready), return_exceptions=True)
        for failed in outcomes:
            if isinstance(failed, BaseException):
                raise failed  # an outage: the pass is tried again
        for alloc, members in by_alloc.items():
            try:
                if alloc in self._released:
                    await self._end_released(alloc, members)
                else:
                    await self._report(alloc, members)
            except Unavailable:
                raise
            except Exception as exc:
                log.warning("reporting allocation %s failed: %r", alloc, exc)

    def _team_of(self, namespace: str, team: str) -> str:
        """The team of a pod in `namespace` that says it is `team`'s: the namespace's, as
        the cluster enforces it (the operator's NAMESPACE_TEAMS, else the namespace's
        gpusched.io/team label, which only who may change Namespaces can set). A pod
        cannot name another team, whatever its own label says."""
        obj = self.namespaces.cache.get(("", namespace)) or {}
        labelled = ((obj.get("metadata") or {}).get("labels") or {}).get(L.TEAM)
        owner = team_of_namespace(namespace, self._settings.namespace_teams, labelled)
        if team != owner:
            raise PodRefused(
                f"label {L.TEAM}={team!r} claims another team than namespace {namespace}'s "
                f"({owner}): a pod runs for its namespace's team only"
            )
        return owner

    async def _submit(self, members: list[GpuschedPod]) -> None:
        objects = [self.pods.cache[m.key] for m in members]
        try:
            for m in members:
                self._team_of(m.namespace, m.team)
        except PodRefused as exc:
            await self._refuse(members, str(exc), lifted_by="namespace")
            return
        try:
            job = submission(members, objects)
        except PodRefused as exc:
            await self._refuse(members, str(exc))
            return
        reply = SubmitReply.model_validate_json(
            await self._request(self._s.api_jobs_submit, job.model_dump(mode="json"))
        )
        if not reply.ok or reply.job_id is None:
            message = reply.error.message if reply.error else "refused"
            code = reply.error.code if reply.error else None
            if code == "unavailable":
                # Admission is waiting out its own outage: not a verdict on the pod.
                raise Unavailable(f"admission could not take the submit: {message}")
            if code == "internal":
                # Admission failed on it unexpectedly: said on the pod, tried again later.
                await self._refuse(
                    members,
                    f"gpusched could not take the job ({message}); trying again in "
                    f"{_RETRY_FAILED_SUBMIT_S:.0f} s",
                    lifted_by="retry",
                )
                return
            await self._refuse(
                members,
                f"gpusched refused the job: {message}",
                lifted_by="capacity" if code == "unsatisfiable" else None,
            )
            return
        for m in members:
            # A refusal that no longer holds (its namespace got its team) is cleared.
            await self._annotate(m.namespace, m.name, {L.JOB_ID: reply.job_id, L.REFUSED: None})
        log.info("submitted %s as job %s", ", ".join(m.name for m in members), reply.job_id)
        await self._pod_event(
            objects[0], "GpuschedQueued", f"submitted to gpusched as job {reply.job_id}", "Normal"
        )

    async def _refuse(
        self, members: list[GpuschedPod], why: str, lifted_by: str | None = None
    ) -> None:
        log.warning("not submitting %s: %s", ", ".join(m.name for m in members), why)
        for m in members:
            self._refused[m.key] = why
            self._refused_at[m.key] = time.monotonic()
            if lifted_by is not None:
                self._may_lift[m.key] = lifted_by
            with contextlib.suppress(NotFound, Conflict):
                await self._annotate(m.namespace, m.name, {L.REFUSED: why[:1000]})
            await self._pod_event(
                self.pods.cache.get(
                    m.key, {"metadata": {"name": m.name, "namespace": m.namespace}}
                ),
                "GpuschedRefused",
                why,
                "Warning",
            )
        await self._audit("k8s.pod_refused", ",".join(m.name for m in members), why, {})

    async def _annotate(self, namespace: str, name: str, notes: dict[str, str | None]) -> Obj:
        """Set annotations (None: remove one)."""
        return await self.kube.patch_pod_annotations(namespace, name, notes)

    async def _report(self, alloc: str, members: list[GpuschedPod]) -> None:
        if alloc in self._stopped:
            return
        state = self._allocations.setdefault(alloc, _Allocation(members[0].job_id or ""))
        state.pods |= {m.key for m in members}
        state.saga_id = state.saga_id or next((m.saga_id for m in members if m.saga_id), None)
        if any(m.node in self._failed_nodes for m in members if m.node):
            return  # the node's failure is the news: admission ends the allocation
        outcomes = [outcome(self.pods.cache[m.key]) for m in members]
        result = gang_outcome(outcomes)
        if result.progress is Progress.RUNNING and not state.started_reported:
            node = next((m.node for m in members if m.node), "")
            await self._reports.send(self._reports.started(alloc, state.job_id, node or ""))
            state.started_reported = True
            log.info("allocation %s of job %s is running", alloc, state.job_id)
        elif result.progress is Progress.ENDED:
            reason = result.reason or StopReason.FAILED
            if state.saga_id is not None and reason is not StopReason.COMPLETED:
                reason = StopReason.EVICTED
            await self._stop(alloc, state, reason, result.exit_code, result.error)
            if result.reason is not StopReason.COMPLETED:
                # A gang without one of its pods cannot go on: the rest go too.
                for m in members:
                    if outcome(self.pods.cache[m.key]).progress is not Progress.ENDED:
                        with contextlib.suppress(NotFound):
                            await self.kube.delete_pod(m.namespace, m.name)

    async def _end_released(self, alloc: str, members: list[GpuschedPod]) -> None:
        """Admission ended this allocation (cancelled, scaled down, its node failed, its
        job requeued): no pod of it runs on. Deleted with its class's grace (a release is
        not a disruption a budget may hold); remembered as stopped, so its pods' end is
        not reported again (admission has released it already)."""
        why = self._released[alloc]
        if alloc not in self._stopped:
            self._remember(alloc, members[0].job_id or "", StopReason.INTERRUPTED, None)
        for m in members:
            if m.deleting or outcome(self.pods.cache[m.key]).progress is Progress.ENDED:
                continue
            grace = self._settings.evict_grace_s.get(m.priority_class.value, 30)
            with contextlib.suppress(NotFound):
                await self.kube.delete_pod(m.namespace, m.name, grace)
            log.info("allocation %s was released (%s): deleted pod %s", alloc, why, m.name)
            await self._pod_event(
                self.pods.cache[m.key],
                "GpuschedReleased",
                f"gpusched ended allocation {alloc} ({why}): the pod is deleted",
                "Normal",
            )

    async def _settle_deleted(self) -> None:
        deleted, self._deleted = self._deleted, []
        for obj in deleted:
            notes = (obj.get("metadata") or {}).get("annotations") or {}
            alloc = notes.get(L.ALLOCATION_ID)
            if not alloc or alloc in self._stopped:
                continue
            state = self._allocations.setdefault(alloc, _Allocation(notes.get(L.JOB_ID, "")))
            state.saga_id = state.saga_id or notes.get(L.SAGA) or None
            left = [k for k in state.pods if k in self.pods.cache and k != key_of(obj)]
            node = (obj.get("spec") or {}).get("nodeName")
            if state.saga_id is not None:
                if left:
                    continue  # the rest of the gang is still going
                await self._stop(alloc, state, StopReason.EVICTED, None, None)
            elif node in self._failed_nodes:
                self._remember(alloc, state.job_id, StopReason.INTERRUPTED, None)
            else:
                ended = outcome(obj)
                if ended.progress is Progress.ENDED:
                    reason, code, error = (
                        ended.reason or StopReason.FAILED,
                        ended.exit_code,
                        ended.error,
                    )
                else:
                    name = key_of(obj)[1]
                    reason, code, error = (
                        StopReason.FAILED,
                        None,
                        f"pod {name} was deleted by someone else",
                    )
                await self._stop(alloc, state, reason, code, error)
                for key in left:
                    with contextlib.suppress(NotFound):
                        await self.kube.delete_pod(key[0], key[1])

    def _remember(self, alloc: str, job_id: str, reason: StopReason, code: int | None) -> Stopped:
        stopped = Stopped(job_id, reason, self._now(), code)
        self._stopped[alloc] = stopped
        while len(self._stopped) > _REMEMBERED_STOPS:
            self._stopped.popitem(last=False)
        self._allocations.pop(alloc, None)
        return stopped

    async def _stop(
        self,
        alloc: str,
        state: _Allocation,
        reason: StopReason,
        code: int | None,
        error: str | None,
    ) -> None:
        saga = state.saga_id
        stopped = self._remember(alloc, state.job_id, reason, code)
        log.info(
            "allocation %s of job %s stopped: %s%s",
            alloc,
            state.job_id,
            reason.value,
            f" ({error})" if error else "",
        )
        await self._reports.stopped(alloc, stopped, saga, None)

    async def on_start(self, envelope: Envelope) -> None:
        _require_producer(envelope)
        start = envelope.payload(StartWorkload)
        alloc = start.allocation_id
        if self._closing:
            raise Unavailable("the agent is shutting down")
        await self._until_synced()
        if alloc in self._stopped:
            log.info("ignoring a start for allocation %s, which already ran", alloc)
            return
        if alloc in self._released:
            log.info("ignoring a start for allocation %s, released already", alloc)
            return
        if any(p.allocation_id == alloc and p.bound for p in self._pods().values()):
            self._wake.set()  # bound already (a redelivery): its report follows its phase
            return
        try:
            await self._start(start)
        except StartFailed as exc:
            log.warning("cannot start allocation %s (job %s): %s", alloc, start.job_id, exc)
            await self._audit("k8s.start_failed", start.job_id, str(exc), {"allocation_id": alloc})
            state = _Allocation(start.job_id)
            await self._stop(alloc, state, StopReason.FAILED, None, str(exc))

    async def _until_synced(self) -> None:
        try:
            await asyncio.wait_for(
                asyncio.gather(self.pods.synced.wait(), self.nodes.synced.wait()), _REQUEST_S
            )
        except TimeoutError:
            raise Unavailable("the agent has not listed the cluster yet") from None

    async def _job_pods(self, start: StartWorkload) -> list[Obj]:
        """The pods that run this start: the job's pods waiting to be bound (the user's,
        or a Job controller's), else new ones from its templates."""
        waiting = [
            self.pods.cache[key]
            for key, pod in self._pods().items()
            if pod.job_id == start.job_id
            and pod.allocation_id is None
            and not pod.bound
            and not pod.deleting
            and pod.phase == "Pending"
        ]
        spec = start.workload.pod or {}
        templates = spec.get("pods") or []
        expected = len(templates) or 1
        if len(waiting) >= expected:
            return sorted(waiting, key=lambda p: p["metadata"]["name"])[:expected]
        if spec.get("controller"):
            # A Job's controller makes the pods again; wait for them a little.
            deadline = time.monotonic() + _CONTROLLER_POD_WAIT_S
            while time.monotonic() < deadline:
                await asyncio.sleep(0.5)
                waiting = [
                    self.pods.cache[k]
                    for k, p in self._pods().items()
                    if p.job_id == start.job_id
                    and not p.bound
                    and p.allocation_id is None
                    and not p.deleting
                ]
                if len(waiting) >= expected:
                    return waiting[:expected]
            raise StartFailed(f"its {spec['controller']} made no pod for attempt {start.attempt}")
        if not templates:
            raise StartFailed("the job has no pod and no pod template")
        for tmpl in templates:
            meta = tmpl.get("metadata") or {}
            key = (str(meta.get("namespace") or "default"), str(meta.get("name") or ""))
            original = self._pods().get(key)
            if (
                original is not None
                and original.uid == meta.get("uid")
                and original.job_id is None
                and not original.bound
                and not original.deleting
                and key not in self._refused
            ):
                # The pod this job was submitted for is not annotated yet (the submit's
                # reply raced the placement, or a restarted agent submits it again): it
                # is the one to bind, not a copy of it. Applied again shortly.
                raise Unavailable(f"pod {key[1]} is being submitted; its start waits for it")
        granted = self._granted.get(start.allocation_id)
        created = []
        for tmpl in templates:
            namespace = str((tmpl.get("metadata") or {}).get("namespace") or "default")
            if granted is None:
                raise Unavailable("the allocation's grant has not arrived yet")
            try:
                self._team_of(namespace, granted.team)
            except PodRefused as exc:
                raise StartFailed(str(exc)) from None
            replica = bool(spec.get("replicas"))
            suffix = successor_suffix(start.allocation_id, start.attempt, replica)
            pod = successor(tmpl, suffix, start.job_id)
            pod["metadata"]["namespace"] = namespace
            created.append(await self._create_successor(namespace, pod, start.job_id))
        return created

    async def _create_successor(self, namespace: str, pod: Obj, job_id: str) -> Obj:
        """Create a pod of a later attempt or another replica. One of that name that is
        already there is this one if it is the job's (a start applied again after a
        restart); a stranger's pod of that name is left alone and the name made unique."""
        name = pod["metadata"]["name"]
        for candidate in (name, f"{name[:240]}-{job_id[-6:]}"):
            pod["metadata"]["name"] = candidate
            try:
                return await self.kube.create_pod(namespace, pod)
            except Conflict:
                existing = await self.kube.get_pod(namespace, candidate)
                notes = existing["metadata"].get("annotations") or {}
                if notes.get(L.JOB_ID) == job_id:
                    return existing
            except TooManyRequests:
                raise  # the API throttles: an outage to wait out, the start is applied again
            except KubeError as exc:
                raise StartFailed(f"cannot create pod {candidate}: {exc.message}") from None
        raise StartFailed(f"pods named {name} already exist in {namespace} and are not its own")

    async def _start(self, start: StartWorkload) -> None:
        alloc = start.allocation_id
        objects = await self._job_pods(start)
        members = [read_pod(o) for o in objects]
        try:
            placement = assign_gang(members, start.gpus)
        except GangMismatch as exc:
            raise StartFailed(str(exc)) from None
        state = self._allocations.setdefault(alloc, _Allocation(start.job_id))
        bound: list[GpuschedPod] = []
        try:
            for obj, pod in zip(objects, members, strict=True):
                node, indices = placement[pod.key]
                await self._prepare(obj, pod, start, node, indices)
                await self._bind(pod, node)
                bound.append(pod)
                state.pods.add(pod.key)
        except (StartFailed, NotFound, Conflict) as exc:
            # All or none: what was bound of a gang goes again.
            for pod in bound:
                with contextlib.suppress(NotFound):
                    await self.kube.delete_pod(pod.namespace, pod.name, 0)
            self._allocations.pop(alloc, None)
            raise StartFailed(str(exc)) from None
        for obj, pod in zip(objects, members, strict=True):
            node, _ = placement[pod.key]
            await self._pod_event(
                obj,
                "Scheduled",
                f"gpusched assigned {pod.namespace}/{pod.name} to {node} "
                f"(job {start.job_id}, attempt {start.attempt}, allocation {alloc})",
                "Normal",
            )
        log.info(
            "bound allocation %s of job %s: %s",
            alloc,
            start.job_id,
            ", ".join(f"{p.name}->{placement[p.key][0]}" for p in members),
        )
        self._wake.set()

    async def _prepare(
        self, obj: Obj, pod: GpuschedPod, start: StartWorkload, node: str, indices: tuple[int, ...]
    ) -> None:
        """The pod's Secret and its GPU claim, allocated to admission's devices, and the
        annotations that say which allocation it runs (all before it is bound)."""
        if pod.handle is None:
            raise StartFailed(
                f"pod {pod.name} was not wired by the gpusched webhook (no {L.HANDLE}): "
                "install the agent's MutatingWebhookConfiguration (docs/kubernetes.md)"
            )
        resume = start.resume_from
        environ = JobEnvironment(
            nats_url=self._pod_nats_url,
            job_id=start.job_id,
            attempt=start.attempt,
            prefix=self._s.prefix,
            resume_uri=resume.uri if resume else None,
            resume_checkpoint_id=resume.checkpoint_id if resume else None,
            checkpoint_dir=Path(pod.checkpoint_dir) if pod.checkpoint_dir else None,
            credentials=Path(L.SECRET_MOUNT) / L.CREDENTIALS_KEY if start.credentials else None,
            nats_tls=None
            if self._pod_nats_ca is None
            else TlsSettings(ca_file=Path(L.SECRET_MOUNT) / L.NATS_CA_KEY),
        ).to_environ()
        environ.update(mps_environment(start.share))
        secret = job_secret(obj, pod.handle, environ, start.credentials, self._pod_nats_ca)
        try:
            await self.kube.create_secret(pod.namespace, secret)
        except Conflict:
            current = await self.kube.get_secret(pod.namespace, pod.handle)
            secret["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
            await self.kube.replace_secret(secret)
        await self._claim(obj, pod, node, indices, start)
        await self._annotate(
            pod.namespace,
            pod.name,
            {
                L.ALLOCATION_ID: start.allocation_id,
                L.ATTEMPT: str(start.attempt),
                L.JOB_ID: start.job_id,
            },
        )

    async def _claim(
        self, obj: Obj, pod: GpuschedPod, node: str, indices: tuple[int, ...], start: StartWorkload
    ) -> None:
        assert pod.handle is not None
        allocation = claim_allocation(obj, node, indices, start.share, self._names)
        wanted = (
            node,
            tuple(sorted(r["device"] for r in allocation["allocation"]["devices"]["results"])),
        )
        try:
            claim = await self.kube.create_claim(
                pod.namespace, gpu_claim(obj, pod.handle, pod.gpus, self._names)
            )
        except Conflict:
            claim = await self.kube.get_claim(pod.namespace, pod.handle)
            have = claimed_devices(claim)
            if have is not None and have != wanted:
                # Allocated to other devices than admission chose (an earlier placement,
                # or another scheduler): corrected before the pod may start, and said.
                why = f"claim {pod.handle} held {have}, admission chose {wanted}: reallocated"
                log.warning("pod %s: %s", pod.name, why)
                await self._audit(
                    "k8s.claim_corrected", start.job_id, why, {"allocation_id": start.allocation_id}
                )
                await self._pod_event(obj, "GpuschedClaimCorrected", why, "Warning")
                await self.kube.delete_claim(pod.namespace, pod.handle)
                claim = await self.kube.create_claim(
                    pod.namespace, gpu_claim(obj, pod.handle, pod.gpus, self._names)
                )
        claim["status"] = allocation
        for _ in range(_CONFLICT_RETRIES):
            try:
                await self.kube.replace_claim_status(claim)
                return
            except Conflict:
                claim = await self.kube.get_claim(pod.namespace, pod.handle)
                claim["status"] = allocation
        raise Unavailable(f"claim {pod.handle} kept changing")

    async def _bind(self, pod: GpuschedPod, node: str) -> None:
        try:
            await self.kube.bind(pod.namespace, pod.name, node)
        except Conflict:
            current = await self.kube.get_pod(pod.namespace, pod.name)
            if (current.get("spec") or {}).get("nodeName") != node:
                raise StartFailed(
                    f"pod {pod.name} is bound to {current['spec'].get('nodeName')} by someone "
                    f"else, not to {node}"
                ) from None

    async def on_evict(self, envelope: Envelope) -> None:
        _require_producer(envelope)
        evict = envelope.payload(EvictWorkload)
        alloc = evict.allocation_id
        await self._until_synced()
        members = [p for p in self._pods().values() if p.allocation_id == alloc]
        if members and members[0].job_id != evict.job_id:
            await self._evict_failed(
                evict, envelope.id, f"allocation {alloc} runs job {members[0].job_id}"
            )
            return
        if not members:
            stopped = self._stopped.get(alloc)
            if stopped is None:
                await self._evict_failed(
                    evict, envelope.id, "no pod of this allocation on the cluster"
                )
            else:
                await self._reports.stopped(alloc, stopped, evict.saga_id, envelope.id)
            return
        state = self._allocations.setdefault(
            alloc, _Allocation(evict.job_id, {m.key for m in members})
        )
        grace = self._settings.evict_grace_s.get(members[0].priority_class.value, 30)
        deadline = time.monotonic() + self._settings.evict_retry_s
        pending = [m for m in members if not m.deleting]
        while pending:
            pod = pending[0]
            try:
                if pod.saga_id != evict.saga_id:
                    await self._annotate(pod.namespace, pod.name, {L.SAGA: evict.saga_id})
                if evict.forced:
                    # The saga's FORCED exit: no budget can hold it (audited by the saga).
                    await self.kube.delete_pod(pod.namespace, pod.name, grace)
                else:
                    await self.kube.evict(pod.namespace, pod.name, grace)
            except NotFound:
                pass
            except TooManyRequests as exc:
                if time.monotonic() >= deadline:
                    causes = exc.body.get("details", {}).get("causes") or [{}]
                    why = causes[0].get("message") or exc.message
                    await self._pod_event(
                        self.pods.cache.get(pod.key, {}), "GpuschedEvictionRefused", why, "Warning"
                    )
                    await self._evict_failed(
                        evict, envelope.id, f"the Eviction API refused pod {pod.name}: {why}"
                    )
                    return
                await asyncio.sleep(min(exc.retry_after_s, max(0.1, deadline - time.monotonic())))
                continue
            state.saga_id = evict.saga_id
            pending.pop(0)
        log.info(
            "evicting allocation %s of job %s (saga %s, grace %ds)",
            alloc,
            evict.job_id,
            evict.saga_id,
            grace,
        )
        self._wake.set()

    async def _evict_failed(self, evict: EvictWorkload, causation_id: str, error: str) -> None:
        log.warning("cannot evict %s (saga %s): %s", evict.allocation_id, evict.saga_id, error)
        await self._reports.evict_failed(evict, causation_id, error, causation_id)

    async def on_renew_credentials(self, envelope: Envelope) -> None:
        renewal = envelope.payload(RenewCredentials)
        import base64

        for pod in self._pods().values():
            if pod.allocation_id != renewal.allocation_id or pod.handle is None:
                continue
            for _ in range(_CONFLICT_RETRIES):
                try:
                    secret = await self.kube.get_secret(pod.namespace, pod.handle)
                except NotFound:
                    break
                secret.setdefault("data", {})[L.CREDENTIALS_KEY] = base64.b64encode(
                    renewal.credentials.encode()
                ).decode()
                try:
                    await self.kube.replace_secret(secret)
                    break
                except Conflict:
                    continue

    # --- MIG ----------------------------------------------------------------------------------
    async def on_mig_configure(self, envelope: Envelope) -> None:
        _require_producer(envelope)
        command = envelope.payload(MigConfigure)
        await self._until_synced()
        node = self.nodes.cache.get(("", command.node))
        refusal = None
        if node is None or command.node in self._failed_nodes:
            refusal = f"node {command.node} is not a live node of the cluster"
        else:
            for granted in self._granted.values():
                if any(g.node == command.node and g.index == command.gpu for g in granted.gpus):
                    refusal = (
                        f"GPU {command.node}/{command.gpu} still runs allocation "
                        f"{granted.allocation_id}"
                    )
                    break
        if refusal is not None:
            await self._mig_failed(
                command.change_id, command.node, command.gpu, refusal, envelope.id
            )
            return
        assert node is not None
        layouts = await self._node_layouts(node)
        layouts[command.gpu] = list(command.profiles)
        name = mig.config_name(layouts)
        await self._write_mig_config(name, layouts)
        await self.kube.patch_node_labels(command.node, {L.MIG_CONFIG: name})
        self._mig[command.node] = _MigChange(
            command.change_id,
            command.node,
            command.gpu,
            list(command.profiles),
            name,
            time.monotonic() + self._settings.mig_timeout_s,
            envelope.id,
        )
        log.info(
            "node %s: MIG config %s asked of the MIG manager (GPU %d: %s)",
            command.node,
            name,
            command.gpu,
            "+".join(command.profiles) or "off",
        )

    async def _node_layouts(self, node: Obj) -> dict[int, list[str]]:
        current = ((node.get("metadata") or {}).get("labels") or {}).get(L.MIG_CONFIG)
        if not current or not current.startswith("gpusched-"):
            return {}
        try:
            configmap = await self.kube.get_configmap(
                self._settings.namespace, self._settings.mig_configmap
            )
        except NotFound:
            return {}
        parsed = yaml.safe_load((configmap.get("data") or {}).get("config.yaml") or "{}") or {}
        layouts: dict[int, list[str]] = {}
        for entry in (parsed.get("mig-configs") or {}).get(current) or []:
            for index in entry.get("devices") or []:
                devices = entry.get("mig-devices") or {}
                layouts[int(index)] = [p for p, n in sorted(devices.items()) for _ in range(int(n))]
        return layouts

    async def _write_mig_config(self, name: str, layouts: dict[int, list[str]]) -> None:
        ns, cm_name = self._settings.namespace, self._settings.mig_configmap
        for _ in range(_CONFLICT_RETRIES):
            try:
                configmap = await self.kube.get_configmap(ns, cm_name)
            except NotFound:
                configmap = {
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": cm_name, "namespace": ns},
                    "data": {},
                }
            parsed = yaml.safe_load((configmap.get("data") or {}).get("config.yaml") or "{}") or {}
            parsed.setdefault("version", "v1")
            parsed.setdefault("mig-configs", {})[name] = mig.mig_parted(layouts)
            configmap.setdefault("data", {})["config.yaml"] = yaml.safe_dump(parsed, sort_keys=True)
            try:
                if "resourceVersion" in configmap["metadata"]:
                    await self.kube.replace_configmap(configmap)
                else:
                    await self.kube.create_configmap(ns, configmap)
                return
            except Conflict:
                continue
        raise Unavailable(f"configmap {cm_name} kept changing")

    async def _check_mig(self) -> None:
        for node_name, change in list(self._mig.items()):
            node = self.nodes.cache.get(("", node_name))
            node_labels = ((node or {}).get("metadata") or {}).get("labels") or {}
            state = node_labels.get(L.MIG_CONFIG_STATE)
            if (
                node is not None
                and node_labels.get(L.MIG_CONFIG) == change.config
                and state == mig.SUCCESS
            ):
                del self._mig[node_name]
                await self._reports.mig_configured(
                    change.change_id, node_name, change.gpu, change.profiles, change.causation_id
                )
            elif node is None or state == mig.FAILED or time.monotonic() > change.deadline:
                del self._mig[node_name]
                why = (
                    "the MIG manager reported failed"
                    if state == mig.FAILED
                    else "the node is gone"
                    if node is None
                    else "the MIG manager did not finish in time"
                )
                await self._mig_failed(
                    change.change_id, node_name, change.gpu, why, change.causation_id
                )

    async def _mig_failed(
        self, change_id: str, node: str, gpu: int, error: str, causation_id: str
    ) -> None:
        log.warning("cannot change the MIG layout of %s/%d: %s", node, gpu, error)
        await self._reports.mig_failed(change_id, node, gpu, error, causation_id)

    # --- lifecycle ----------------------------------------------------------------------------
    async def announce_if_due(self, caught_up: Callable[[], Awaitable[bool]]) -> bool:
        """`agent.ready` once after start and after every reconnect to NATS, once the
        cluster is listed and admission's events are caught up with."""
        if self._closing or not self._nc.is_connected or not self.synced:
            return False
        epoch = int(self._nc.stats.get("reconnects", 0))
        if epoch == self._announced_at or not await caught_up():
            return False
        self._announced_at = epoch
        await self.announce()
        return True

    def running(self) -> list[str]:
        """Allocations whose pods are bound and not ended: they run (or are starting).
        Not a pod on a failed node (Kubernetes keeps it until the node is back or gone),
        nor one of an allocation admission released (its delete may still be under way)."""
        failed = self._failed(self.observed_nodes())
        allocs: set[str] = set()
        for key, pod in self._pods().items():
            ended = outcome(self.pods.cache[key]).progress is Progress.ENDED
            if (
                pod.allocation_id
                and pod.bound
                and not pod.deleting
                and not ended
                and pod.node not in failed
                and pod.allocation_id not in self._released
            ):
                allocs.add(pod.allocation_id)
        return sorted(allocs)

    async def announce(self) -> None:
        nodes = sorted(set(self.observed_nodes()) & set(self._admission))
        await self._reports.ready(self.agent_id, nodes, self.running())

    async def close(self) -> None:
        """Pods keep running without the agent (the kubelet runs them): nothing to stop."""
        self._closing = True
        left = await self._publisher.close(2.0)
        if left:
            log.warning("agent stopped with %d report(s) undelivered", left)

    def _later(self, work: Awaitable[None]) -> None:
        """Run `work` (an Event to record) beside the caller, which must not wait."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- Events and audit ---------------------------------------------------------------------
    async def _pod_event(self, pod: Obj, reason: str, message: str, kind: str) -> None:
        meta = pod.get("metadata") or {}
        await self._event(
            "Pod",
            meta.get("name", ""),
            meta.get("namespace", "default"),
            reason,
            message,
            kind,
            meta.get("uid"),
        )

    async def _event(
        self,
        kind: str,
        name: str,
        namespace: str,
        reason: str,
        message: str,
        type_: str,
        uid: str | None = None,
    ) -> None:
        """A Kubernetes Event (what `kubectl describe` shows); best effort."""
        stamp = self._now().strftime("%Y-%m-%dT%H:%M:%SZ")
        ns = namespace or self._settings.namespace
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{name}.", "namespace": ns},
            "involvedObject": {
                "kind": kind,
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "apiVersion": "v1",
            },
            "reason": reason,
            "message": message[:1024],
            "type": type_,
            "source": {"component": self._settings.scheduler_name},
            "reportingComponent": self._settings.scheduler_name,
            "reportingInstance": self.agent_id[:128],
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self.kube.create_event(ns, event)
        except Exception as exc:
            log.debug("could not record event %s on %s: %r", reason, name, exc)

    async def _audit(self, action: str, entity: str, reason: str, details: dict[str, Any]) -> None:
        await self._publisher.publish(
            self._s.audit(action),
            T.AUDIT,
            AuditRecord(
                action=action,
                actor="agent",
                entity=entity[:200],
                reason=reason[:4000],
                details=details,
                time=self._now(),
            ),
        )


def _require_producer(envelope: Envelope) -> None:
    allowed = COMMAND_SOURCES[envelope.type]
    if envelope.source not in allowed:
        raise Rejected(
            f"{envelope.type} from {envelope.source!r} refused: only "
            f"{' or '.join(sorted(allowed))} may send it to the cluster agent"
        )


def names(items: Iterable[GpuschedPod]) -> str:
    return ", ".join(p.name for p in items)


__all__ = ["KubernetesAgent", "Outcome"]
