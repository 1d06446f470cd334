"""The in-memory capacity ledger, kept in step with the committed tables.

Concurrency (one writer at a time, any number of replicas):
- Every transaction that reads or changes the ledger begins with ``hold`` (or ``read``),
  which takes the row lock on ``ledger_state`` until that transaction commits or rolls
  back. That lock is the single-writer rule: consumers on any replica and the
  scheduling pass queue on it, so decisions never interleave.
- ``hold`` also bumps the stored version in the same transaction and remembers the new
  number. The holder changes the in-memory ledger while it holds the lock; the
  runtime commits afterwards (consumers never see the commit themselves). If that
  commit happens, the next holder finds the version it expects and uses the memory
  as is; if the transaction rolled back, or another replica wrote meanwhile, the
  versions differ and the next holder rebuilds the ledger from the tables. So the
  memory is never trusted beyond what was committed, without a hook on commit.

Writing: the holder only changes the ledger. What the ledger's events changed since
``hold`` (``Ledger.take_changed``) is written in the same transaction just before it
commits, so no change can be left out of the rows, whatever the handler did.
"""

from __future__ import annotations

from collections.abc import Sequence

from gpusched.contracts.messages import GpusReturned, T
from gpusched.domain.inventory import GpuRef, Inventory
from gpusched.domain.ledger import Ledger
from gpusched.infra.db import UnitOfWork

from . import store, wire


class LedgerKeeper:
    def __init__(self) -> None:
        self._ledger: Ledger | None = None
        self._inventory: Inventory | None = None
        self._version = -1  # matches no stored version, so the first holder loads
        self.rebuilds = 0
        # The transaction whose commit writes the ledger's changes (one per holder).
        self._writing: UnitOfWork | None = None

    @property
    def version(self) -> int:
        """The version the in-memory ledger is at (tentative until its holder commits)."""
        return self._version

    @property
    def inventory(self) -> Inventory:
        if self._inventory is None:
            raise RuntimeError("the ledger has not been loaded yet")
        return self._inventory

    def set_inventory(self, inventory: Inventory) -> None:
        """The holder added or removed a node in the held ledger: the node set it has now."""
        self._inventory = inventory

    async def hold(self, uow: UnitOfWork) -> Ledger:
        """The current ledger, locked for this transaction, which may change it."""
        ledger = await self._sync(uow)
        self._version += 1
        await store.set_ledger_version(uow, self._version)
        if self._writing is not uow:
            # Changes an earlier holder made were written by its commit, or rolled back
            # with it (then the version differs and _sync rebuilt from the tables).
            ledger.take_changed()
            self._writing = uow
            uow.before_commit(lambda: self._write_changes(uow))
        return ledger

    async def read(self, uow: UnitOfWork) -> Ledger:
        """The current ledger, locked for this transaction, which must not change it."""
        return await self._sync(uow)

    async def _write_changes(self, uow: UnitOfWork) -> None:
        """Write the slots the held ledger's events changed, as it has them now."""
        self._writing = None
        ledger = self._require()
        gpus = ledger.take_changed()
        if not gpus:
            return
        await store.save_gpus(
            uow,
            [
                (
                    ledger.gpu(ref),
                    ledger.layout_of(ref),
                    ledger.layout_changed_at(ref),
                    ledger.layout_pending(ref),
                    ledger.layout_before(ref),
                )
                for ref in gpus
            ],
        )

    async def return_lent(
        self,
        uow: UnitOfWork,
        gpus: Sequence[GpuRef],
        *,
        causation_id: str | None,
        correlation_id: str | None = None,
    ) -> None:
        """Give lent ``gpus`` back to the shared pool whatever holds them now: write
        the slots and tell each reservation which of its GPUs it lost."""
        ledger = self._require()
        by_reservation: dict[str, list[GpuRef]] = {}
        for ref in gpus:
            by_reservation.setdefault(str(ledger.gpu(ref).reserved_for), []).append(ref)
        ledger.return_to_shared(gpus=gpus)
        for reservation_id, refs in sorted(by_reservation.items()):
            await uow.emit(
                uow.subjects.event(uow.source, T.GPUS_RETURNED),
                T.GPUS_RETURNED,
                GpusReturned(reservation_id=reservation_id, gpus=wire.gpus(refs, ledger)),
                correlation_id=correlation_id,
                causation_id=causation_id,
            )

    async def _sync(self, uow: UnitOfWork) -> Ledger:
        committed = await store.lock_ledger(uow)
        if self._ledger is None or committed != self._version:
            self._inventory, self._ledger = await store.load_ledger(uow)
            self.rebuilds += 1
        self._version = committed
        return self._ledger

    def _require(self) -> Ledger:
        if self._ledger is None:
            raise RuntimeError("the ledger has not been loaded yet")
        return self._ledger
