"""Composition root of the admission service: the ledger, the queue and every placement.

Single writer: every transaction that touches the ledger holds the row lock of
`ledger_state` (see keeper), whichever replica runs it, so consumers may run on every
replica; the scheduling loop is a singleton only so replicas do not race for that lock.
The jobs API never touches the ledger: it validates against the static inventory and
queues, then kicks the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import yaml

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import NodeReply, NodeVerb, T
from gpusched.contracts.permissions import AGENT_NODE_VERBS
from gpusched.domain.inventory import Inventory, InventoryError, parse_inventory
from gpusched.domain.quota import QuotaBook, QuotaError, parse_quotas
from gpusched.domain.sharing import ModeSchedule, Overcommit
from gpusched.infra import access, bus, metrics
from gpusched.infra.migrations import migrations_dir
from gpusched.infra.runtime import ServiceRuntime, run_service
from gpusched.infra.settings import Settings
from gpusched.infra.textfiles import FileRefused, read_small_text

from . import parking
from .cancel import CancelOps
from .catalog import Catalog
from .commands import LedgerCommands
from .credentials import JobCredentials
from .handlers import load_inventory_once
from .jobs import JobListing, JobsApi
from .keeper import LedgerKeeper
from .mig import MigDeadlines, MigModes
from .nodes import NodeOps
from .outcomes import Outcomes
from .queue import Clock
from .replicas import Backoff, ReplicaOps
from .scheduler import Scheduler

NAME = "admission"
SCHEMA = "admission"
# How often a replica that is not the leader asks for the scheduling lease, and the
# longest a kick waits between two scheduling ticks.
LEASE_POLL_S = 0.2


class InventoryUnavailable(RuntimeError):
    """The GPU inventory file is missing or invalid; the service cannot start."""


def _read_mapping(path: Path, what: str, setting: str, holds: str) -> Mapping[str, Any]:
    """A YAML file that must hold a mapping; every failure names the file and the fix."""
    try:
        data = yaml.safe_load(read_small_text(path))
    except OSError as exc:
        raise InventoryUnavailable(
            f"admission: cannot read the {what} {path} ({exc.strerror}); set {setting}"
        ) from exc
    except (FileRefused, UnicodeDecodeError) as exc:
        raise InventoryUnavailable(f"admission: the {what}: {exc}; set {setting}") from exc
    except yaml.YAMLError as exc:
        raise InventoryUnavailable(f"admission: {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, Mapping):
        raise InventoryUnavailable(f"admission: {path} must hold a mapping with {holds}")
    return data


def read_inventory(path: Path) -> Inventory:
    data = _read_mapping(
        path, "GPU inventory", "GPUSCHED_ADMISSION__INVENTORY_PATH", "a 'nodes' list"
    )
    try:
        return parse_inventory(data)
    except InventoryError as exc:
        raise InventoryUnavailable(f"admission: invalid GPU inventory {path}: {exc}") from exc


def inventory_reader(source: str, path: Path) -> Callable[[], Inventory]:
    """How admission reads its inventory file; with the `agent` source there is none."""
    if source == "agent":

        def none() -> Inventory:
            raise InventoryUnavailable(
                "admission: the inventory comes from the cluster agent "
                "(GPUSCHED_ADMISSION__INVENTORY_SOURCE=agent): there is no file to read"
            )

        return none
    return lambda: read_inventory(path)


def read_quotas(path: Path | None) -> QuotaBook | None:
    """The teams' quotas and priority limits, or None when no file is configured."""
    if path is None:
        return None
    data = _read_mapping(
        path,
        "quotas",
        "GPUSCHED_ADMISSION__QUOTAS_PATH or unset it to run without quotas",
        "'teams'",
    )
    try:
        return parse_quotas(data)
    except QuotaError as exc:
        raise InventoryUnavailable(f"admission: invalid quotas {path}: {exc}") from exc


@dataclass(frozen=True)
class AdmissionService:
    jobs: JobsApi
    scheduler: Scheduler
    keeper: LedgerKeeper
    nodes: NodeOps


async def assemble(rt: ServiceRuntime, clock: Clock = utcnow) -> AdmissionService:
    """Load (or restore) the ledger and register the service's endpoints, consumers, loop.

    ``clock``: where every part of the service reads the time."""
    settings = rt.settings.admission
    inventory_file = inventory_reader(settings.inventory_source, settings.inventory_path)
    if settings.inventory_source == "file":
        await load_inventory_once(rt.uow, inventory_file)
    keeper = LedgerKeeper()
    async with rt.uow() as uow:
        await keeper.read(uow)
        await parking.recount(uow)
    # Read at start: a quota change takes effect on restart (and is in the file's history).
    catalog = Catalog(
        keeper.inventory,
        read_quotas(settings.quotas_path),
        Overcommit(settings.overcommit_inference, settings.overcommit_training),
        timedelta(seconds=settings.mig_change_interval_s),
        process_without_quotas=settings.allow_process_workloads_without_quotas,
    )
    credentials = JobCredentials.from_settings(rt.settings, clock)
    scheduler = Scheduler(
        rt.uow,
        keeper,
        catalog,
        settings.schedule_interval_s,
        reserve_after=timedelta(seconds=settings.reserve_after_s),
        starve_after=timedelta(seconds=settings.starve_after_s),
        credentials=credentials,
        clock=clock,
    )
    backoff = Backoff(
        timedelta(seconds=settings.replica_restart_first_s),
        timedelta(seconds=settings.replica_restart_longest_s),
    )
    jobs = JobsApi(rt.uow, keeper, catalog, scheduler.kick, clock)
    commands = LedgerCommands(keeper, scheduler.kick)
    outcomes = Outcomes(keeper, scheduler.kick, backoff, clock)
    nodes = NodeOps(
        rt.uow,
        keeper,
        catalog,
        scheduler.kick,
        inventory_file,
        clock,
    )

    s = rt.subjects
    rt.serve(s.api_jobs_submit, jobs.submit)
    rt.serve(s.api_jobs_get, jobs.get)
    rt.serve(s.api_jobs_approve, jobs.approve)
    rt.serve(s.api_jobs_why, jobs.why)
    rt.serve(s.api_jobs_list, JobListing(rt.uow))
    rt.serve(s.api_jobs_scale, ReplicaOps(rt.uow, keeper, scheduler.kick, clock).scale)
    rt.serve(s.api_jobs_cancel, CancelOps(rt.uow, keeper, scheduler.kick, clock).cancel)
    for verb, endpoint in {
        NodeVerb.ADD: nodes.add,
        NodeVerb.RELOAD: nodes.reload,
        NodeVerb.DRAIN: nodes.drain,
        NodeVerb.UNDRAIN: nodes.undrain,
        NodeVerb.FAIL: nodes.fail,
        NodeVerb.RECOVER: nodes.recover,
        NodeVerb.REMOVE: nodes.remove,
        NodeVerb.LIST: nodes.list_nodes,
    }.items():
        rt.serve(
            s.api_nodes(verb),
            access.operators_only(
                rt.uow,
                f"nodes.{verb}",
                endpoint,
                lambda e: NodeReply(ok=False, error=e),
                # A cluster agent keeps the inventory to its cluster's nodes.
                agents=verb in AGENT_NODE_VERBS,
            ),
        )
    rt.consume(
        bus.Consumer(
            durable="admission-commands",
            stream=s.stream("COMMANDS"),
            subjects=[s.commands_for(NAME)],
            handlers={
                T.RESERVE_FOR_INFERENCE: commands.on_reserve_for_inference,
                T.RETURN_TO_SHARED: commands.on_return_to_shared,
            },
        )
    )
    rt.consume(
        bus.Consumer(
            durable="admission-results",
            stream=s.stream("EVENTS"),
            subjects=[s.events_of("agent"), s.events_of("checkpoint")],
            handlers={
                T.WORKLOAD_STARTED: outcomes.on_workload_started,
                T.WORKLOAD_STOPPED: outcomes.on_workload_stopped,
                T.AGENT_READY: outcomes.on_agent_ready,
                T.EVICTION_COMPLETED: outcomes.on_eviction_completed,
                T.EVICTION_FORCED: outcomes.on_eviction_forced,
                T.EVICTION_ABORTED: outcomes.on_eviction_aborted,
                T.EVICTION_CANCELLED: outcomes.on_eviction_cancelled,
                T.MIG_CONFIGURED: outcomes.on_mig_configured,
                T.MIG_CONFIGURE_FAILED: outcomes.on_mig_configure_failed,
                T.NODE_HEALTH: nodes.on_node_health,
                # Verified checkpoints only, never the jobs' raw claims (DESIGN §5).
                T.CHECKPOINT_VERIFIED: nodes.on_checkpoint_verified,
            },
        )
    )
    # The tick itself waits up to the schedule interval for a kick, so the loop's own
    # pause is short: a kick during it is served within LEASE_POLL_S.
    rt.every("schedule", LEASE_POLL_S, scheduler.tick, singleton=True)
    if credentials.enabled:
        rt.every(
            "job-credentials",
            credentials.renew_every_s,
            lambda: credentials.renew(rt.uow, keeper),
            singleton=True,
        )
    if settings.mig_modes:
        modes = MigModes(
            rt.uow,
            keeper,
            ModeSchedule(settings.mig_day_start, settings.mig_day_end),
            timedelta(seconds=settings.mig_change_interval_s),
            scheduler.kick,
            clock,
        )
        rt.every("mig-modes", settings.mig_reconcile_interval_s, modes.tick, singleton=True)
    deadlines = MigDeadlines(
        rt.uow, keeper, timedelta(seconds=settings.mig_apply_timeout_s), scheduler.kick, clock
    )
    # Looks a few times per timeout, so a change is failed soon after its deadline.
    every = min(settings.mig_apply_timeout_s / 4, settings.mig_reconcile_interval_s)
    rt.every("mig-deadlines", every, deadlines.tick, singleton=True)
    # The queue and GPU gauges, counted from the scheduler's memory when scraped.
    metrics.on_scrape(NAME, scheduler.view.scrape)
    scheduler.kick()  # jobs queued before this start are placed at once
    return AdmissionService(jobs, scheduler, keeper, nodes)


async def build(rt: ServiceRuntime) -> None:
    await assemble(rt)


def main() -> None:
    run_service(ServiceRuntime(NAME, SCHEMA, Settings(), migrations_dir(__file__)), build)
