"""MIG layout changes: the cluster agent's command and the audit record of each, and the
time-of-day modes that move empty GPUs toward the layout of the current mode.

A layout change resets the GPU, so the ledger allows one only on an empty GPU and at
most once per interval (``Ledger.change_layout``); everything here goes through it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from datetime import datetime, timedelta

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import MigConfigure, T
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import GpuStatus, LayoutChanged, Ledger
from gpusched.domain.sharing import (
    GpuShare,
    MigMode,
    ModeSchedule,
    can_change_layout,
    target_layout,
)
from gpusched.infra.db import Outgoing, UnitOfWork, UnitOfWorkFactory

from .keeper import LedgerKeeper

log = logging.getLogger(__name__)


def layout_outgoing(
    uow: UnitOfWork, changed: LayoutChanged, reason: str, interval: timedelta
) -> list[Outgoing]:
    """The agent's mig.configure command and the audit record of one layout change."""
    change_id = f"mig-{uuid.uuid4().hex[:12]}"
    ref = changed.gpu
    return [
        Outgoing(
            uow.subjects.command("agent", T.MIG_CONFIGURE),
            T.MIG_CONFIGURE,
            MigConfigure(
                change_id=change_id,
                node=ref.node,
                gpu=ref.index,
                model=changed.model,
                profiles=list(changed.layout),
                previous=list(changed.before),
            ),
            correlation_id=change_id,
        ),
        uow.audit_event(
            "mig.layout_changed",
            entity=str(ref),
            reason=(
                f"{reason}: MIG layout {'+'.join(changed.before) or 'none (whole GPU)'} -> "
                f"{'+'.join(changed.layout) or 'none (whole GPU)'}; next change allowed from "
                f"{(changed.at + interval).isoformat()}"
            ),
            details={
                "change_id": change_id,
                "model": changed.model,
                "before": list(changed.before),
                "layout": list(changed.layout),
                "at": changed.at.isoformat(),
            },
            correlation_id=change_id,
        ),
    ]


def due_changes(
    ledger: Ledger, mode: MigMode, now: datetime, interval: timedelta
) -> list[tuple[GpuRef, tuple[str, ...]]]:
    """Empty MIG GPUs whose layout differs from the mode's and that may change now.

    By day only GPUs of the inference pool are sliced (training keeps whole GPUs); by
    night every MIG GPU goes back to whole.
    """
    due: list[tuple[GpuRef, tuple[str, ...]]] = []
    for slot in ledger.gpus:
        if not slot.mig_enabled or slot.reserved_for is not None:
            continue
        if slot.status is GpuStatus.ALLOCATED:
            continue
        shared = ledger.shared.get(slot.ref)
        if shared is not None and not shared.empty:
            continue
        target = target_layout(slot.model, mode) if slot.pool is Pool.INFERENCE else ()
        if ledger.layout_of(slot.ref) == target:
            continue
        if can_change_layout(ledger.layout_changed_at(slot.ref), now, interval):
            due.append((slot.ref, target))
    return due


class MigModes:
    """The reconciler: a singleton loop (leader lease) like the scheduling pass."""

    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        schedule: ModeSchedule,
        interval: timedelta,
        kick: Callable[[], None],
    ) -> None:
        self._uow = uow
        self._keeper = keeper
        self._schedule = schedule
        self._interval = interval
        self._kick = kick

    async def tick(self) -> None:
        await self.reconcile()

    async def reconcile(self) -> int:
        """One reconciliation; returns how many layouts changed."""
        now = utcnow()
        mode = self._schedule.mode_at(now)
        async with self._uow() as uow:
            if not due_changes(await self._keeper.read(uow), mode, now, self._interval):
                return 0
            ledger = await self._keeper.hold(uow)
            outgoing: list[Outgoing] = []
            changed: list[GpuRef] = []
            for ref, layout in due_changes(ledger, mode, now, self._interval):
                event = ledger.change_layout(ref, layout, now, self._interval)
                outgoing += layout_outgoing(uow, event, f"{mode} mode", self._interval)
                changed.append(ref)
            await self._keeper.save(uow, changed)
            await uow.emit_many(outgoing)
            await uow.commit()
        log.info("%s mode: changed the MIG layout of %d GPU(s)", mode, len(changed))
        self._kick()  # new slices (or whole GPUs) may place waiting jobs
        return len(changed)


def share_words(share: GpuShare | None) -> str:
    """How a placement's audit reason names a part of a GPU ('' for whole GPUs)."""
    if share is None:
        return ""
    if share.profile is not None:
        return f": MIG slice {share.slice} ({share.profile})"
    return f": a {share.milli}/1000 share with a {share.memory_mib} MiB memory cap"
