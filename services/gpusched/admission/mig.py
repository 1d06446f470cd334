"""MIG layout changes: the cluster agent's command and the audit record of each, and the
time-of-day modes that move empty GPUs toward the layout of the current mode.

A layout change resets the GPU, so the ledger allows one only on an empty GPU and at
most once per interval (``Ledger.change_layout``); everything here goes through it.

A change stays pending until the agent reports it applied (``mig.configured``) or failed
(``mig.configure_failed``); one without either report within the apply timeout is failed
by ``MigDeadlines``. A failed change gives the GPU back its previous layout.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from enum import StrEnum

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import MigConfigure, T
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import GpuStatus, LayoutChanged, LayoutFailed, Ledger
from gpusched.domain.sharing import (
    GpuShare,
    MigMode,
    ModeSchedule,
    can_change_layout,
    target_layout,
)
from gpusched.infra.db import Outgoing, UnitOfWork, UnitOfWorkFactory
from gpusched.infra.errors import is_outage

from .keeper import LedgerKeeper
from .parking import SKIPPED
from .queue import Clock

log = logging.getLogger(__name__)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


class FailCause(StrEnum):
    """Why a pending layout change was given up."""

    REPORTED = "reported"  # the agent said it could not apply it
    TIMEOUT = "timeout"  # no report within the apply timeout


def change_id_of(ref: GpuRef, at: datetime) -> str:
    """The id of the layout change of ``ref`` made at ``at``. Derived from what is stored
    (the GPU and its change time), so after a restart a report still finds its change,
    and a report of an older change of the same GPU does not."""
    micros = (at - _EPOCH) // timedelta(microseconds=1)
    return f"mig-{hashlib.sha256(f'{ref}@{micros}'.encode()).hexdigest()[:12]}"


def pending_change_id(ledger: Ledger, ref: GpuRef) -> str | None:
    """The id of the change of ``ref`` awaiting the agent's report, if any."""
    changed_at = ledger.layout_changed_at(ref)
    if not ledger.layout_pending(ref) or changed_at is None:
        return None
    return change_id_of(ref, changed_at)


def overdue(ledger: Ledger, now: datetime, timeout: timedelta) -> list[GpuRef]:
    """GPUs whose pending layout change has had no report for ``timeout``."""
    due: list[GpuRef] = []
    for ref in ledger.shared:
        changed_at = ledger.layout_changed_at(ref)
        if ledger.layout_pending(ref) and changed_at is not None and changed_at + timeout <= now:
            due.append(ref)
    return sorted(due)


def layout_words(layout: tuple[str, ...]) -> str:
    return "+".join(layout) or "none (whole GPU)"


async def fail_change(
    uow: UnitOfWork,
    ledger: Ledger,
    ref: GpuRef,
    cause: FailCause,
    error: str,
    causation_id: str | None = None,
) -> LayoutFailed:
    """Give up the pending change of ``ref``: the GPU has its previous layout again (as
    the agent still has it); audited. The caller saves the GPU and kicks a pass, which
    places the jobs that waited for the new slices elsewhere or tells them why not."""
    change_id = pending_change_id(ledger, ref)
    assert change_id is not None  # callers check that a change is pending
    changed_at = ledger.layout_changed_at(ref)
    failed = ledger.fail_layout(ref)
    await uow.audit(
        "mig.layout_failed",
        entity=str(ref),
        reason=(
            f"MIG layout {layout_words(failed.failed)} was not applied ({cause}: {error}); "
            f"the GPU keeps {layout_words(failed.restored)}. The attempt counts as a change "
            f"(it may have reset the GPU): the next change is allowed one interval after "
            f"{changed_at.isoformat() if changed_at else 'it'}"
        ),
        details={
            "change_id": change_id,
            "cause": cause,
            "error": error,
            "failed": list(failed.failed),
            "restored": list(failed.restored),
        },
        correlation_id=change_id,
        causation_id=causation_id,
    )
    return failed


def layout_outgoing(
    uow: UnitOfWork, changed: LayoutChanged, reason: str, interval: timedelta
) -> list[Outgoing]:
    """The agent's mig.configure command and the audit record of one layout change."""
    change_id = change_id_of(changed.gpu, changed.at)
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
        clock: Clock = utcnow,
    ) -> None:
        self._clock = clock
        self._uow = uow
        self._keeper = keeper
        self._schedule = schedule
        self._interval = interval
        self._kick = kick

    async def tick(self) -> None:
        await self.reconcile()

    async def reconcile(self) -> int:
        """One reconciliation; returns how many layouts changed. Each GPU is changed in
        a transaction of its own: one that fails is skipped (audited, counted) and the
        others still change."""
        now = self._clock()
        mode = self._schedule.mode_at(now)
        async with self._uow() as uow:
            due = due_changes(await self._keeper.read(uow), mode, now, self._interval)
        changed = 0
        for ref, layout in due:
            try:
                changed += await self._change(ref, layout, mode, now)
            except Exception as exc:
                if is_outage(exc):
                    raise
                await skipped(self._uow, "mig_modes", ref, f"{mode} mode layout change", exc)
        if changed:
            log.info("%s mode: changed the MIG layout of %d GPU(s)", mode, changed)
            self._kick()  # new slices (or whole GPUs) may place waiting jobs
        return changed

    async def _change(
        self, ref: GpuRef, layout: tuple[str, ...], mode: MigMode, now: datetime
    ) -> int:
        async with self._uow() as uow:
            ledger = await self._keeper.hold(uow)
            if (ref, layout) not in due_changes(ledger, mode, now, self._interval):
                return 0  # another replica changed it meanwhile
            event = ledger.change_layout(ref, layout, now, self._interval)
            await uow.emit_many(layout_outgoing(uow, event, f"{mode} mode", self._interval))
            await uow.commit()
        return 1


class MigDeadlines:
    """A singleton loop: a layout change without the agent's report within ``timeout``
    of its change time (stored with the GPU) is failed, so the GPU is not lost."""

    def __init__(
        self,
        uow: UnitOfWorkFactory,
        keeper: LedgerKeeper,
        timeout: timedelta,
        kick: Callable[[], None],
        clock: Clock = utcnow,
    ) -> None:
        self._clock = clock
        self._uow = uow
        self._keeper = keeper
        self._timeout = timeout
        self._kick = kick

    async def tick(self) -> None:
        await self.expire()

    async def expire(self) -> int:
        """Fail the overdue changes; returns how many. Each GPU in a transaction of its
        own: one that fails is skipped (audited, counted), the others still expire."""
        now = self._clock()
        async with self._uow() as uow:
            refs = overdue(await self._keeper.read(uow), now, self._timeout)
        error = f"no report from the cluster agent within {self._timeout.total_seconds():g} s"
        failed = 0
        for ref in refs:
            try:
                failed += await self._expire_one(ref, now, error)
            except Exception as exc:
                if is_outage(exc):
                    raise
                await skipped(self._uow, "mig_deadlines", ref, "expiring its layout change", exc)
        if failed:
            log.warning("failed %d MIG layout change(s) without a report in time", failed)
            self._kick()  # the jobs that waited for those slices
        return failed

    async def _expire_one(self, ref: GpuRef, now: datetime, error: str) -> int:
        async with self._uow() as uow:
            ledger = await self._keeper.hold(uow)
            if ref not in overdue(ledger, now, self._timeout):
                return 0  # reported meanwhile
            await fail_change(uow, ledger, ref, FailCause.TIMEOUT, error)
            await uow.commit()
        return 1


async def skipped(
    uow_factory: UnitOfWorkFactory, loop: str, ref: GpuRef, what: str, exc: Exception
) -> None:
    """A loop failed on one GPU: its transaction is rolled back (the next holder of the
    ledger reloads it), the failure audited and counted, and the loop goes on."""
    log.exception("%s: %s of GPU %s failed; skipped", loop, what, ref)
    SKIPPED.labels(loop).inc()
    async with uow_factory() as uow:
        await uow.audit(
            "mig.change_skipped",
            entity=str(ref),
            reason=f"{what} failed and was skipped: {type(exc).__name__}: "
            + " ".join(str(exc).split())[:500],
            details={"loop": loop},
        )
        await uow.commit()


def share_words(share: GpuShare | None) -> str:
    """How a placement's audit reason names a part of a GPU ('' for whole GPUs)."""
    if share is None:
        return ""
    if share.profile is not None:
        return f": MIG slice {share.slice} ({share.profile})"
    return f": a {share.milli}/1000 share with a {share.memory_mib} MiB memory cap"
