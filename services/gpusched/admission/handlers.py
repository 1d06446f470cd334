"""Loading the inventory of record once, at the first start of any replica.

The service's endpoints and handlers live in jobs.py (the jobs API), commands.py
(ledger commands from preemption) and outcomes.py (what the agent and the eviction
sagas report); app.py wires them.
"""

from __future__ import annotations

from collections.abc import Callable

from gpusched.contracts.messages import (
    T,
)
from gpusched.domain.inventory import Inventory, Pool
from gpusched.infra.db import UnitOfWorkFactory

from . import store, wire


async def load_inventory_once(
    uow_factory: UnitOfWorkFactory, read_inventory: Callable[[], Inventory]
) -> bool:
    """Store the inventory if the ledger has none yet; True if this call loaded it.

    Under the ledger lock, so replicas starting together load it exactly once. The file
    is read only when needed: afterwards the tables are the inventory of record.
    """
    async with uow_factory() as uow:
        await store.lock_ledger(uow)
        if await store.has_inventory(uow):
            return False
        inventory = read_inventory()
        await store.save_inventory(uow, inventory)
        await uow.emit(
            uow.subjects.event(uow.source, T.INVENTORY_LOADED),
            T.INVENTORY_LOADED,
            wire.inventory_loaded(inventory),
        )
        await uow.audit(
            "inventory.loaded",
            entity="inventory",
            reason=f"first start: {inventory.total_gpus} GPUs on {len(inventory.nodes)} nodes",
            details={str(pool): inventory.gpus_in(pool) for pool in Pool},
        )
        await uow.commit()
        return True
