"""Ledger commands from preemption: lend shared GPUs to inference, and take them back.

Each command carries a decision id, claimed once, so a redelivered command is audited
as a repeat and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import (
    GpusReserved,
    GpusReturned,
    ReserveForInference,
    ReturnToShared,
    T,
)
from gpusched.domain import ledger as d
from gpusched.infra.db import UnitOfWork

from . import lending, store, wire
from .keeper import LedgerKeeper
from .words import some_of


class LedgerCommands:
    def __init__(self, keeper: LedgerKeeper, kick: Callable[[], None]) -> None:
        self._keeper = keeper
        self._kick = kick

    async def on_reserve_for_inference(self, envelope: Envelope, uow: UnitOfWork) -> None:
        command = envelope.payload(ReserveForInference)
        ledger = await self._keeper.hold(uow)
        if not await store.claim_decision(
            uow, command.decision_id, T.RESERVE_FOR_INFERENCE, command.reservation_id
        ):
            await _audit_repeat(uow, envelope, command.decision_id, command.reservation_id)
            return
        plan = lending.to_reserve(
            ledger, command.reservation_id, command.allocation_ids, command.free_gpus
        )
        chosen, free = plan.gpus, plan.free
        unknown, not_lendable = list(plan.unknown), plan.not_lendable
        reserved = (
            ledger.reserve_for_inference(command.reservation_id, chosen)
            if chosen
            else d.GpusReserved(command.reservation_id, ())
        )
        # Always answered, even when nothing could be reserved, so preemption learns the
        # outcome of its decision and can act on the shortfall.
        await uow.emit(
            uow.subjects.event(uow.source, T.GPUS_RESERVED),
            T.GPUS_RESERVED,
            GpusReserved(
                reservation_id=command.reservation_id,
                gpus=wire.gpus(reserved.gpus, ledger),
                pending=wire.gpus(reserved.pending, ledger),
            ),
            correlation_id=command.decision_id,
            causation_id=envelope.id,
        )
        short = command.free_gpus - len(free)
        await uow.audit(
            "gpus.reserved",
            entity=command.reservation_id,
            reason=(
                f"lent {len(reserved.gpus)} shared GPUs to inference "
                f"({len(reserved.pending)} on release of their training jobs)"
                + (f"; {short} fewer idle GPUs than asked" if short > 0 else "")
                + (f"; unknown allocations {some_of(unknown)}" if unknown else "")
            ),
            details={
                "decision_id": command.decision_id,
                "gpus": [str(ref) for ref in reserved.gpus],
                "pending": [str(ref) for ref in reserved.pending],
                "free_asked": command.free_gpus,
                "free_given": len(free),
                "unknown_allocations": unknown,
                "not_lendable": not_lendable,
            },
            causation_id=envelope.id,
        )
        if len(reserved.gpus) > len(reserved.pending):
            # Idle GPUs serve inference now: a service below its replica target takes them.
            self._kick()

    async def on_return_to_shared(self, envelope: Envelope, uow: UnitOfWork) -> None:
        command = envelope.payload(ReturnToShared)
        ledger = await self._keeper.hold(uow)
        if not await store.claim_decision(
            uow, command.decision_id, T.RETURN_TO_SHARED, command.reservation_id
        ):
            await _audit_repeat(uow, envelope, command.decision_id, command.reservation_id)
            return
        chosen = lending.lent_to_return(ledger, command.reservation_id, command.gpus)
        returned = ledger.return_to_shared(gpus=chosen) if chosen else d.GpusReturned((), (), ())
        await uow.emit(
            uow.subjects.event(uow.source, T.GPUS_RETURNED),
            T.GPUS_RETURNED,
            GpusReturned(
                reservation_id=command.reservation_id, gpus=wire.gpus(returned.gpus, ledger)
            ),
            correlation_id=command.decision_id,
            causation_id=envelope.id,
        )
        short = command.gpus - len(returned.gpus)
        await uow.audit(
            "gpus.returned",
            entity=command.reservation_id,
            reason=(
                f"returned {len(returned.gpus)} GPUs to the shared pool "
                f"({len(returned.freed)} free at once)"
                + (f"; the reservation held {short} fewer than asked" if short > 0 else "")
            ),
            details={
                "decision_id": command.decision_id,
                "gpus": [str(ref) for ref in returned.gpus],
                "freed": [str(ref) for ref in returned.freed],
                "asked": command.gpus,
            },
            causation_id=envelope.id,
        )
        if returned.freed:
            self._kick()


async def _audit_repeat(
    uow: UnitOfWork, envelope: Envelope, decision_id: str, reservation_id: str
) -> None:
    await uow.audit(
        "ledger.command_ignored",
        entity=reservation_id,
        reason=f"decision {decision_id} was already applied",
        details={"type": envelope.type, "decision_id": decision_id},
        causation_id=envelope.id,
    )
