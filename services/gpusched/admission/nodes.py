"""Inventory changes: nodes added, drained, failed, recovered and removed.

Each change holds the ledger (see keeper) for its whole transaction, applies itself to
the in-memory ledger, writes the node's row and GPU slots, emits `inventory.changed`
(and, for a failure, the allocation releases and returned reservations it causes) and
audits it, all in one unit of work. Operators ask through `<p>.api.nodes.<verb>`; the
cluster agent reports node health as an event, which takes the same failure path.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from functools import partial
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gpusched.contracts.envelope import Envelope, utcnow
from gpusched.contracts.messages import (
    AddNode,
    ApiError,
    CheckpointInfo,
    CheckpointVerified,
    InventoryChanged,
    ListNodes,
    NodeChange,
    NodeCommand,
    NodeHealth,
    NodeReply,
    NodeState,
    NodeVerb,
    NodeView,
    ReloadInventory,
    T,
)
from gpusched.contracts.subjects import has_node_token, untelemetered_note
from gpusched.contracts.validation import Invalid, first_error, parse_request
from gpusched.domain import ledger as d
from gpusched.domain.inventory import Inventory, InventoryError, NodeSpec, parse_inventory
from gpusched.domain.ledger import Ledger, NodeCondition
from gpusched.domain.lostwork import lost_gpu_seconds
from gpusched.infra.db import UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import is_outage

from . import parking, replicas, store, wire
from .catalog import Catalog
from .keeper import LedgerKeeper
from .queue import Clock, JobState

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

# The release reason an allocation ended by its node's failure carries on the wire.
NODE_FAILED = "node_failed"


class NodeErrorCode(StrEnum):
    UNKNOWN_NODE = "unknown_node"
    DUPLICATE_NODE = "duplicate_node"
    INVALID_SPEC = "invalid_node_spec"
    # The command does not apply to the node's state (e.g. undrain a node that is up).
    WRONG_STATE = "wrong_node_state"
    NODE_BUSY = "node_busy"
    INVENTORY_UNAVAILABLE = "inventory_unavailable"


_STATE = {
    None: NodeState.UP,
    NodeCondition.DRAINED: NodeState.DRAINED,
    NodeCondition.FAILED: NodeState.FAILED,
}

# What each operator command needs the node to be, and what it makes of it.
_TRANSITIONS: dict[NodeChange, tuple[tuple[NodeCondition | None, ...], NodeCondition | None]] = {
    NodeChange.DRAINED: ((None,), NodeCondition.DRAINED),
    NodeChange.UNDRAINED: ((NodeCondition.DRAINED,), None),
    NodeChange.FAILED: ((None, NodeCondition.DRAINED), NodeCondition.FAILED),
    NodeChange.RECOVERED: ((NodeCondition.FAILED,), None),
}


class NodeRefused(Exception):
    """A well-formed node request the ledger's state refuses; nothing is changed."""

    def __init__(self, code: StrEnum, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.error = ApiError(code=code, message=message, field=field)


@dataclass(frozen=True, slots=True)
class FailureOutcome:
    ended: tuple[str, ...]  # allocation ids
    lost_gpu_seconds: float
    unreserved: int


def newest_checkpoint(*checkpoints: CheckpointInfo | None) -> CheckpointInfo | None:
    known = [c for c in checkpoints if c is not None]
    return max(known, key=lambda c: c.step) if known else None


class NodeOps:
    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        catalog: Catalog,
        kick: Callable[[], None],
        read_inventory: Callable[[], Inventory],
        clock: Clock = utcnow,
    ) -> None:
        self._clock = clock
        self._uow = uow
        self._keeper = keeper
        self._catalog = catalog
        self._kick = kick
        self._read_inventory = read_inventory

    # --- the operator's API (request/reply) ---------------------------------------------

    async def add(self, raw: bytes) -> NodeReply:
        request = _parse(AddNode, raw)
        if isinstance(request, NodeReply):
            return request
        try:
            specs = parse_inventory({"nodes": [request.spec]}).nodes
        except InventoryError as exc:
            return _refused(NodeErrorCode.INVALID_SPEC, f"invalid node spec: {exc}")
        return await self._decide(
            request.operator, f"node.{NodeVerb.ADD}", lambda uow, ledger: self._add_all(
                uow, ledger, specs, _why(request.operator, request.reason, "added")
            ),
        )  # fmt: skip

    async def reload(self, raw: bytes) -> NodeReply:
        request = _parse(ReloadInventory, raw)
        if isinstance(request, NodeReply):
            return request
        try:
            inventory = self._read_inventory()
        except (RuntimeError, InventoryError) as exc:
            return _refused(NodeErrorCode.INVENTORY_UNAVAILABLE, str(exc))
        reason = _why(request.operator, request.reason, "inventory file reloaded")

        async def apply(uow: UnitOfWork, ledger: Ledger) -> NodeReply:
            stored = {node.name: node for node in self._keeper.inventory.nodes}
            new = [node for node in inventory.nodes if node.name not in stored]
            notes = [
                f"node {node.name} differs from the file; it is left as stored "
                f"(remove it and add it again to change it)"
                for node in inventory.nodes
                if node.name in stored and node != stored[node.name]
            ]
            listed = {node.name for node in inventory.nodes}
            notes += [
                f"node {name} is stored but not in the file; `gpusched node remove {name}` "
                "removes it once it is empty"
                for name in sorted(set(stored) - listed)
            ]
            reply = await self._add_all(uow, ledger, new, reason) if new else NodeReply(ok=True)
            return reply.model_copy(update={"notes": [*reply.notes, *notes]})

        return await self._decide(request.operator, f"node.{NodeVerb.RELOAD}", apply)

    async def drain(self, raw: bytes) -> NodeReply:
        return await self._change(raw, NodeVerb.DRAIN, NodeChange.DRAINED)

    async def undrain(self, raw: bytes) -> NodeReply:
        return await self._change(raw, NodeVerb.UNDRAIN, NodeChange.UNDRAINED)

    async def fail(self, raw: bytes) -> NodeReply:
        return await self._change(raw, NodeVerb.FAIL, NodeChange.FAILED)

    async def recover(self, raw: bytes) -> NodeReply:
        return await self._change(raw, NodeVerb.RECOVER, NodeChange.RECOVERED)

    async def remove(self, raw: bytes) -> NodeReply:
        request = _parse(NodeCommand, raw)
        if isinstance(request, NodeReply):
            return request

        async def apply(uow: UnitOfWork, ledger: Ledger) -> NodeReply:
            spec = self._spec(ledger, request.node)
            view = _view(ledger, spec)
            try:
                ledger.remove_node(spec.name)
            except d.NodeBusy as exc:
                raise NodeRefused(NodeErrorCode.NODE_BUSY, str(exc)) from None
            await store.delete_node(uow, spec.name)
            self._set_inventory(
                Inventory(tuple(n for n in self._keeper.inventory.nodes if n.name != spec.name))
            )
            reason = _why(request.operator, request.reason, "removed")
            await self._announce(uow, NodeChange.REMOVED, spec, None, reason)
            return NodeReply(ok=True, nodes=[view.model_copy(update={"allocations": []})])

        return await self._decide(request.operator, f"node.{NodeVerb.REMOVE}", apply)

    async def list_nodes(self, raw: bytes) -> NodeReply:
        request = _parse(ListNodes, raw)
        if isinstance(request, NodeReply):
            return request
        async with self._uow() as uow:
            ledger = await self._keeper.read(uow)
            return NodeReply(
                ok=True, nodes=[_view(ledger, spec) for spec in self._keeper.inventory.nodes]
            )

    # --- events -------------------------------------------------------------------------

    async def on_node_health(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """The cluster agent's report: an unhealthy node fails, a healthy failed one
        recovers; a report that changes nothing is not news."""
        health = envelope.payload(NodeHealth)
        ledger = await self._keeper.hold(uow)
        if health.node not in ledger.nodes:
            await uow.audit(
                "node.health_ignored",
                entity=health.node,
                reason="the agent reports a node the inventory does not have",
                details={"healthy": health.healthy, "reason": health.reason},
                causation_id=envelope.id,
            )
            return
        condition = ledger.node_condition(health.node)
        reason = f"cluster agent: {health.reason or ('healthy' if health.healthy else 'failed')}"
        if not health.healthy and condition is not NodeCondition.FAILED:
            await self._apply(uow, ledger, health.node, NodeChange.FAILED, reason, envelope.id)
        elif health.healthy and condition is NodeCondition.FAILED:
            await self._apply(uow, ledger, health.node, NodeChange.RECOVERED, reason, envelope.id)
        else:
            return
        self._kick()

    async def on_checkpoint_verified(self, envelope: Envelope, uow: UnitOfWork) -> None:
        """Remember each job's newest verified checkpoint: a node failure requeues the
        job from it, and `jobs.get` shows it. Only the checkpoint service's verified
        checkpoints count; a job's raw claim may name a file that does not hold it."""
        verified = envelope.payload(CheckpointVerified)
        await store.record_checkpoint(
            uow, verified.job_id, verified.checkpoint, verified.confirmed_at
        )

    # --- the changes ----------------------------------------------------------------------

    async def _change(self, raw: bytes, verb: NodeVerb, change: NodeChange) -> NodeReply:
        request = _parse(NodeCommand, raw)
        if isinstance(request, NodeReply):
            return request

        async def apply(uow: UnitOfWork, ledger: Ledger) -> NodeReply:
            spec = self._spec(ledger, request.node)
            reason = _why(request.operator, request.reason, change.value)
            await self._apply(uow, ledger, spec.name, change, reason, None)
            return NodeReply(ok=True, nodes=[_view(ledger, spec)])

        return await self._decide(request.operator, f"node.{verb}", apply)

    async def _apply(
        self,
        uow: UnitOfWork,
        ledger: Ledger,
        node: str,
        change: NodeChange,
        reason: str,
        causation_id: str | None,
    ) -> None:
        allowed, target = _TRANSITIONS[change]
        current = ledger.node_condition(node)
        if current not in allowed:
            raise NodeRefused(
                NodeErrorCode.WRONG_STATE,
                f"node {node} is {_STATE[current]}: it cannot be {change} "
                f"(only a node that is {' or '.join(_STATE[c] for c in allowed)})",
            )
        failure = None
        if change is NodeChange.FAILED:
            failure = await self._end_everything_on(uow, ledger, node, causation_id)
        ledger.set_condition(node, target)
        now = self._clock()
        await store.set_node_state(uow, node, target, now)
        spec = self._keeper.inventory.node(node)
        await self._announce(uow, change, spec, _STATE[target], reason, causation_id, failure)

    async def _end_everything_on(
        self, uow: UnitOfWork, ledger: Ledger, node: str, causation_id: str | None
    ) -> FailureOutcome:
        """A failed node runs nothing: every allocation on it ends (training is requeued
        from its newest checkpoint, inference re-placed), and GPUs lent to inference
        there go back, so the controller can lend others."""
        now = self._clock()
        ended: list[str] = []
        lost_total = 0.0
        for allocation in ledger.allocations_on_node(node):
            released = ledger.release(allocation.allocation_id, max(now, allocation.granted_at))
            await store.release_allocation(
                uow, allocation.allocation_id, released.released_at, NODE_FAILED
            )
            await uow.emit(
                uow.subjects.event(uow.source, T.ALLOCATION_RELEASED),
                T.ALLOCATION_RELEASED,
                wire.allocation_released(released, NODE_FAILED, ledger),
                correlation_id=allocation.job_id,
                causation_id=causation_id,
            )
            lost_total += await requeue_or_park(
                uow, allocation.job_id, now,
                partial(self._requeue, uow, allocation, node, now, causation_id),
            )  # fmt: skip
            ended.append(allocation.allocation_id)
        lent = [ref for ref in ledger.node_gpus(node) if ledger.gpu(ref).reserved_for is not None]
        if lent:
            await self._keeper.return_lent(uow, lent, causation_id=causation_id)
        return FailureOutcome(tuple(ended), lost_total, len(lent))

    async def _requeue(
        self,
        uow: UnitOfWork,
        allocation: d.Allocation,
        node: str,
        now: datetime,
        causation_id: str | None,
    ) -> float:
        return await requeue_lost(uow, allocation, node, now, causation_id)

    async def _add_all(
        self, uow: UnitOfWork, ledger: Ledger, specs: Sequence[NodeSpec],
        reason: str,
    ) -> NodeReply:  # fmt: skip
        known = set(ledger.nodes)
        for spec in specs:
            _check_announceable(spec)
            if spec.name in known:
                raise NodeRefused(NodeErrorCode.DUPLICATE_NODE, f"node {spec.name} already exists")
        now = self._clock()
        for spec in specs:
            ledger.add_node(spec)
            await store.insert_node(uow, spec, now)
            self._set_inventory(Inventory((*self._keeper.inventory.nodes, spec)))
            await self._announce(uow, NodeChange.ADDED, spec, NodeState.UP, reason)
        notes = [untelemetered_note(spec.name) for spec in specs if not has_node_token(spec.name)]
        return NodeReply(ok=True, nodes=[_view(ledger, spec) for spec in specs], notes=notes)

    async def _announce(
        self,
        uow: UnitOfWork,
        change: NodeChange,
        spec: NodeSpec,
        state: NodeState | None,
        reason: str,
        causation_id: str | None = None,
        failure: FailureOutcome | None = None,
    ) -> None:
        await uow.emit(
            uow.subjects.event(uow.source, T.INVENTORY_CHANGED),
            T.INVENTORY_CHANGED,
            InventoryChanged(
                change=change, node=wire.inventory_node(spec), state=state, reason=reason
            ),
            correlation_id=spec.name,
            causation_id=causation_id,
        )
        details: dict[str, Any] = {
            "pool": spec.pool,
            "gpus": len(spec.gpus),
            "gpu_model": spec.gpus[0].model,
            "state": state,
        }
        text = reason
        if failure is not None:
            details |= {
                "allocations_ended": list(failure.ended),
                "lost_gpu_seconds": round(failure.lost_gpu_seconds, 3),
                "unreserved_gpus": failure.unreserved,
            }
            text += f"; ended {len(failure.ended)} allocation(s)"
        await uow.audit(
            f"node.{change}", entity=spec.name, reason=text, details=details,
            causation_id=causation_id,
        )  # fmt: skip

    async def _decide(
        self,
        operator: str,
        action: str,
        apply: Callable[[UnitOfWork, Ledger], Awaitable[NodeReply]],
    ) -> NodeReply:
        """Run one operator change under the ledger lock: committed whole, or refused
        with nothing changed but the audit record of the refusal."""
        async with self._uow() as uow:
            ledger = await self._keeper.hold(uow)
            inventory = self._keeper.inventory
            try:
                reply = await apply(uow, ledger)
            except NodeRefused as exc:
                # Checked before any change, so the ledger in memory is as committed.
                assert self._keeper.inventory is inventory
                await uow.audit(
                    f"{action}.refused",
                    entity=operator,
                    reason=f"{exc.error.code}: {exc.error.message}",
                )
                await uow.commit()
                return NodeReply(ok=False, error=exc.error)
            await uow.commit()
        self._catalog.follow(self._keeper.inventory)
        self._kick()
        return reply

    def _spec(self, ledger: Ledger, name: str) -> NodeSpec:
        if name not in ledger.nodes:
            raise NodeRefused(NodeErrorCode.UNKNOWN_NODE, f"no node {name!r} in the inventory")
        return self._keeper.inventory.node(name)

    def _set_inventory(self, inventory: Inventory) -> None:
        self._keeper.set_inventory(inventory)


def _view(ledger: Ledger, spec: NodeSpec) -> NodeView:
    present = spec.name in ledger.nodes
    return NodeView(
        name=spec.name,
        pool=spec.pool,
        gpu_model=spec.gpus[0].model,
        gpus=len(spec.gpus),
        cpu_milli=spec.cpu_milli,
        memory_mib=spec.memory_mib,
        disk_gib=spec.disk_gib,
        state=_STATE[ledger.node_condition(spec.name)] if present else NodeState.UP,
        allocations=[a.allocation_id for a in ledger.allocations_on_node(spec.name)]
        if present
        else [],
    )


def _check_announceable(spec: NodeSpec) -> None:
    """Refuse a node its own inventory.changed event could not name, before anything
    changes: the request's spec is a free document, and the event's rules (its name
    an id, its GPU model a name: no control characters, at most 200 characters) are
    stricter than the inventory parser's."""
    try:
        wire.inventory_node(spec)
    except ValidationError as exc:
        where, message = first_error(exc)
        # The message names the rule, never the value (which may be anything).
        raise NodeRefused(
            NodeErrorCode.INVALID_SPEC, f"invalid node spec: {where}: {message}", f"spec.{where}"
        ) from None


def _why(operator: str, reason: str, what: str) -> str:
    return f"{operator}: {what}" + (f" ({reason})" if reason else "")


def _parse(model: type[M], raw: bytes) -> M | NodeReply:
    request = parse_request(model, raw)
    if isinstance(request, Invalid):
        return NodeReply(ok=False, error=request.error())
    return request


def _refused(code: StrEnum, message: str) -> NodeReply:
    return NodeReply(ok=False, error=ApiError(code=code, message=message))


async def requeue_lost(
    uow: UnitOfWork,
    allocation: d.Allocation,
    node: str,
    now: datetime,
    causation_id: str | None,
    cause: str | None = None,
) -> float:
    """The allocation (released already) ended with its node, or its workload was
    interrupted (``cause``): a training job is requeued from its newest checkpoint (the
    work since is lost), an inference replica is placed again. The GPU-seconds lost."""
    cause = cause or f"node {node} failed"
    job = await store.job(uow, allocation.job_id)
    if job is not None and job.replicas is not None:
        await replicas.after_loss(
            uow, job, allocation.allocation_id, node, now, causation_id, cause=cause
        )
        return 0.0
    if job is None or job.allocation_id != allocation.allocation_id:
        return 0.0  # an older attempt's allocation; the job has moved on
    lost = 0.0
    details: dict[str, Any] = {"allocation_id": allocation.allocation_id, "node": node}
    if job.kind is d.JobKind.TRAINING:
        resume_from = newest_checkpoint(job.resume_from, job.latest_checkpoint)
        if resume_from is not None and resume_from != job.resume_from:
            await store.set_resume_from(uow, job.job_id, resume_from, now)
        checkpoint_at = (
            job.latest_checkpoint_at
            if resume_from is not None and resume_from == job.latest_checkpoint
            else None
        )
        lost = lost_gpu_seconds(len(allocation.gpus), allocation.granted_at, checkpoint_at, now)
        await store.record_lost_work(uow, allocation.allocation_id, lost)
        resumes = "the start (no checkpoint)"
        if resume_from is not None:
            resumes = f"checkpoint {resume_from.checkpoint_id} (step {resume_from.step})"
        details |= {
            "resume_from": None if resume_from is None else resume_from.checkpoint_id,
            "lost_gpu_seconds": round(lost, 3),
            "gpus": len(allocation.gpus),
        }
        await uow.audit(
            "work.lost",
            entity=job.job_id,
            reason=f"{cause}: {lost:.0f} GPU-seconds since the last confirmed checkpoint are lost",
            details=details,
            causation_id=causation_id,
        )
        reason = f"{cause}; requeued to resume from {resumes}"
    else:
        reason = f"{cause}; requeued to be placed again"
    await store.set_job_state(uow, job.job_id, JobState.QUEUED, now)
    await uow.audit(
        "job.requeued", entity=job.job_id, reason=reason, details=details,
        causation_id=causation_id,
    )  # fmt: skip
    return lost


async def requeue_or_park(
    uow: UnitOfWork, job_id: str, now: datetime, settle: Callable[[], Awaitable[float]]
) -> float:
    """Run ``settle`` for one ended allocation of ``job_id`` in a savepoint: if it fails
    for a reason of the job's own (its row does not parse, a bug on its path; never an
    outage) its writes are undone, the job is parked, and the caller's loop goes on
    with the next allocation. The allocation itself stays released: it did end."""
    try:
        async with uow.conn.begin_nested():
            return await settle()
    except Exception as exc:
        if is_outage(exc):
            raise
        log.exception("settling an ended allocation of job %s failed", job_id)
        reason = parking.reason_for(exc, "settling its ended workload")
        await parking.park(uow, job_id, reason, parking.Where.SETTLE, now)
        return 0.0
