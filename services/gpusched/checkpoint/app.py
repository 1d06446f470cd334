"""Composition root of the checkpoint service: the eviction saga (DESIGN §3.4)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from gpusched.checkpoint.api import (
    GetSagaReply,
    LatestCheckpointReply,
    get_saga_subject,
    job_history_subject,
    latest_checkpoint_subject,
)
from gpusched.checkpoint.handlers import SagaHandlers
from gpusched.checkpoint.policy import EvictionPolicies, TrustPolicy
from gpusched.checkpoint.queries import Queries
from gpusched.checkpoint.storage import Budget, FsspecStorage, NoStorage
from gpusched.contracts.envelope import Envelope
from gpusched.contracts.messages import T
from gpusched.contracts.uris import FILE_SCHEME
from gpusched.infra import access, bus
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import Settings

log = logging.getLogger(__name__)

NAME = "checkpoint"
SCHEMA = "checkpoint"
SWEEP_BATCH = 100
SWEEP_BATCHES_PER_TICK = 10
# Messages of different sagas waiting at once share one transaction, up to this many
# (bus.Consumer.batch): a mass eviction costs a transaction, an outbox write and a
# relay wake-up per batch rather than per message.
BATCH = 16


# Partition keys: each consumer applies the messages of one key in stream order and
# different keys at once. The unit of order is what the handlers lock: a request's saga
# (its eviction.requested before its eviction.withdrawn), a job's live sagas, an
# allocation's live saga. Two requests for one allocation may then race: the partial
# unique index lets exactly one of them open a saga.
def by_request(envelope: Envelope) -> str | None:
    return _field(envelope, "request_id")


def by_job(envelope: Envelope) -> str | None:
    # The handlers name the job by the correlation id, else by the payload's job_id.
    return envelope.correlation_id or _field(envelope, "job_id")


def by_allocation(envelope: Envelope) -> str | None:
    return _field(envelope, "allocation_id")


def _field(envelope: Envelope, name: str) -> str | None:
    value = envelope.data.get(name)
    return value if isinstance(value, str) else None


async def build(rt: ServiceRuntime) -> None:
    settings = rt.settings.checkpoint
    storage: FsspecStorage | NoStorage = NoStorage()
    if settings.verify_uris:
        storage = FsspecStorage(
            settings.verify_schemes,
            budget=Budget(settings.verify_budget_s, settings.verify_budget_s_per_gb),
            parallelism=settings.verify_parallelism,
            # Enough for every claim the job-events consumer verifies at once to read
            # `verify_parallelism` files: a claim waits for another's thread only when
            # threads are stuck in I/O that does not return.
            threads=settings.verify_parallelism * rt.settings.bus.consumer_concurrency,
            file_roots=settings.file_roots,
        )
        rt.on_close(_closing(storage))
        if FILE_SCHEME in settings.verify_schemes and not settings.file_roots:
            log.warning(
                "file:// checkpoint claims are read wherever they point: set "
                "GPUSCHED_CHECKPOINT__FILE_ROOTS to the jobs' checkpoint directories"
            )
    handlers = SagaHandlers(
        EvictionPolicies.from_settings(settings),
        storage=storage,
        trust=TrustPolicy.from_settings(settings),
        retention_per_job=settings.retention_per_job,
    )
    s = rt.subjects
    rt.consume(
        bus.Consumer(
            durable="checkpoint-commands",
            stream=s.stream("COMMANDS"),
            subjects=[s.commands_for(NAME)],
            handlers={
                T.EVICTION_REQUESTED: handlers.on_eviction_requested,
                T.EVICTION_WITHDRAWN: handlers.on_eviction_withdrawn,
            },
            key=by_request,
            batch=BATCH,
            prepare=handlers.prepare,
        )
    )
    rt.consume(
        bus.Consumer(
            durable="checkpoint-job-events",
            stream=s.stream("JOBS"),
            subjects=[s.all_job_events],
            handlers={
                T.CHECKPOINT_CONFIRMED: handlers.on_checkpoint_confirmed,
                T.CHECKPOINT_FAILED: handlers.on_checkpoint_failed,
                T.JOB_COMPLETED: handlers.on_job_completed,
                T.JOB_FAILED: handlers.on_job_failed,
            },
            key=by_job,
            # A claim on storage that hangs holds its batch (and the batch's transaction)
            # for at most its verification budget: the read is given up then
            # (FsspecStorage). Reading storage before the transaction opens, one claim at
            # a time, cost a third of the sagas per second (bench sagas).
            batch=BATCH,
            prepare=handlers.prepare,
        )
    )
    rt.consume(
        bus.Consumer(
            # Only the grants: they say each job's priority class, which decides the URI
            # schemes its claims may use unverified.
            durable="checkpoint-admission-events",
            stream=s.stream("EVENTS"),
            subjects=[s.event("admission", T.ALLOCATION_GRANTED)],
            handlers={T.ALLOCATION_GRANTED: handlers.on_allocation_granted},
            key=by_job,
            batch=BATCH,
        )
    )
    rt.consume(
        bus.Consumer(
            durable="checkpoint-agent-events",
            stream=s.stream("EVENTS"),
            subjects=[s.events_of("agent")],
            handlers={
                T.WORKLOAD_STOPPED: handlers.on_workload_stopped,
                T.EVICT_FAILED: handlers.on_evict_failed,
            },
            key=by_allocation,
            batch=BATCH,
            prepare=handlers.prepare,
        )
    )
    queries = Queries(rt.uow)
    # The catalogue and the sagas name every team's jobs: operators (and services) only.
    rt.serve(
        latest_checkpoint_subject(s),
        access.operators_only(
            rt.uow,
            "checkpoints.latest",
            queries.latest_checkpoint,
            lambda e: LatestCheckpointReply(ok=False, error=e),
        ),
    )
    rt.serve(
        get_saga_subject(s),
        access.operators_only(
            rt.uow, "sagas.get", queries.get_saga, lambda e: GetSagaReply(ok=False, error=e)
        ),
    )

    # A job's own history: the endpoint itself lets a team read its own jobs' only.
    rt.serve(job_history_subject(s), queries.job_history)

    async def sweep_deadlines() -> None:
        # Deadlines live in the database: whichever replica runs this (and a restarted
        # one) enforces them; SKIP LOCKED keeps two sweepers off the same saga. A bounded
        # number of batches per tick, so a backlog cannot starve the loop's stop check.
        for _ in range(SWEEP_BATCHES_PER_TICK):
            async with rt.uow() as uow:
                due = await handlers.sweep(uow, SWEEP_BATCH)
                await uow.commit()
            if due < SWEEP_BATCH:
                return

    rt.every("deadline-sweeper", rt.settings.checkpoint.sweep_interval_s, sweep_deadlines)


def _closing(storage: FsspecStorage) -> Callable[[], Awaitable[None]]:
    async def close() -> None:
        storage.close()

    return close


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), migrations_dir(__file__)), build)
