"""Preemption's composition root (DESIGN §3.3, §3.5): pool snapshots and ledger events
in, reservations, returns and eviction requests out."""

from __future__ import annotations

from gpusched.contracts.messages import T
from gpusched.infra import bus
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import Settings
from gpusched.preemption import handlers
from gpusched.preemption.policy import ControllerLimits

NAME = handlers.NAME
SCHEMA = "preemption"


def limits(settings: Settings) -> ControllerLimits:
    return ControllerLimits.from_settings(settings.preemption, settings.ingest.stale_after_s)


async def build(rt: ServiceRuntime) -> None:
    s = rt.subjects
    controller = handlers.Controller(limits(rt.settings))
    # One consumer for all ledger events keeps them in admission's order.
    rt.consume(
        bus.Consumer(
            durable="preemption-admission",
            stream=s.stream("EVENTS"),
            subjects=[s.events_of("admission")],
            handlers={
                T.INVENTORY_LOADED: handlers.on_inventory_loaded,
                T.INVENTORY_CHANGED: handlers.on_inventory_changed,
                T.ALLOCATION_GRANTED: handlers.on_allocation_granted,
                T.ALLOCATION_RELEASED: handlers.on_allocation_released,
                T.GPUS_RESERVED: handlers.on_gpus_reserved,
                T.GPUS_RETURNED: handlers.on_gpus_returned,
            },
        )
    )
    # Only the elected leader decides; a standby takes over within one interval of
    # the leader's database session closing (its lease is a session advisory lock).
    rt.every(
        "decide",
        rt.settings.preemption.decide_interval_s,
        lambda: controller.tick(rt.uow),
        singleton=True,
    )
    rt.consume(
        bus.Consumer(
            durable="preemption-snapshots",
            stream=s.stream("EVENTS"),
            subjects=[s.event("ingest", T.POOL_SNAPSHOT)],
            handlers={T.POOL_SNAPSHOT: controller.on_pool_snapshot},
        )
    )
    rt.consume(
        bus.Consumer(
            durable="preemption-evictions",
            stream=s.stream("EVENTS"),
            subjects=[s.events_of("checkpoint")],
            handlers={
                T.EVICTION_COMPLETED: controller.on_eviction_settled,
                T.EVICTION_FORCED: controller.on_eviction_settled,
                T.EVICTION_CANCELLED: controller.on_eviction_settled,
                T.EVICTION_ABORTED: controller.on_eviction_aborted,
                # Lost work counts from verified checkpoints only (DESIGN §5).
                T.CHECKPOINT_VERIFIED: handlers.on_checkpoint_verified,
            },
        )
    )


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), migrations_dir(__file__)), build)
