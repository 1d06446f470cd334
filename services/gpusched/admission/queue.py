"""The job queue's vocabulary: job states, the order queued jobs are placed in, ids, and
what scheduling reads of a request (``Ask``). The queue held in memory is index.py's."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import TYPE_CHECKING

from gpusched.contracts import messages
from gpusched.contracts.messages import (
    GpuRequest,
    HostRequest,
    PriorityClassName,
    Replicas,
    SubmitJob,
)
from gpusched.domain.ledger import PriorityClass

if TYPE_CHECKING:
    from .store import JobRecord


# Where the admission service reads the time: passed in, so tests and a replay choose it.
Clock = Callable[[], datetime]


class JobState(StrEnum):
    # Above its team's max priority class: waits for an operator's approval.
    HELD = "held"
    QUEUED = "queued"
    RUNNING = "running"
    # Evicted by a saga whose outcome (the checkpoint to resume from) has not arrived.
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    FAILED = "failed"
    # Set aside by the scheduler for a reason of its own (an unreadable row, a placement
    # that raised): not placed until an operator approves it again or cancels it.
    PARKED = "parked"
    # An operator cancelled it while it ran: its workloads are being stopped.
    CANCELLING = "cancelling"
    # Ended by an operator (`gpusched cancel`).
    CANCELLED = "cancelled"


# A job in one of these states is over: it cannot be cancelled or retried.
FINISHED = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})


# Inference first: it is never made to wait behind training (DESIGN §7).
_PLACEMENT_ORDER = (
    PriorityClass.INFERENCE,
    PriorityClass.P0_URGENT,
    PriorityClass.P1_NORMAL,
    PriorityClass.P2_OFFLINE,
)


def placement_rank(priority_class: PriorityClass) -> int:
    """Queued jobs are tried by this rank, then first in, first out."""
    return _PLACEMENT_ORDER.index(priority_class)


def new_job_id() -> str:
    # Hex only, so the id is safe as a subject token (`<p>.jobs.<job_id>.events`).
    return f"job-{uuid.uuid4().hex[:12]}"


def new_allocation_id() -> str:
    return f"alloc-{uuid.uuid4().hex[:12]}"


class EvictionOutcome(StrEnum):
    """How the eviction saga of an allocation ended, when it ended in an eviction."""

    COMPLETED = "completed"
    FORCED = "forced"


@dataclass(frozen=True, slots=True)
class Ask:
    """What scheduling reads of a job's request: team, kind, class, GPUs, replicas and
    host CPU and memory.

    Jobs that ask the same share one (``ask_of``): a deep queue holds one per distinct
    request, not a parsed request per job (see store.JobRecord for why that matters)."""

    team: str
    kind: messages.JobKind
    priority_class: PriorityClassName
    gpus: GpuRequest
    replicas: Replicas | None
    host: HostRequest | None = None


def ask_of(spec: SubmitJob) -> Ask:
    """The shared ``Ask`` of a validated request."""
    gpus, replicas, host = spec.gpus, spec.replicas, spec.host
    return shared_ask(
        spec.team,
        spec.kind.value,
        spec.priority_class.value,
        (
            gpus.count, gpus.model, models_text(gpus.models), gpus.memory_gib, gpus.milli,
            gpus.min_count,
        ),
        None if replicas is None else (replicas.min, replicas.max),
        None if host is None else (host.cpu_milli, host.memory_mib),
    )  # fmt: skip


def models_text(models: Sequence[str] | None) -> str | None:
    """Several accepted models as one string (``a|b``), as a queued job's row keeps them."""
    return None if models is None else "|".join(models)


# Bounded: a stream of ever new requests (say, distinct memory sizes) only stops being
# shared, it never grows this cache without limit.
@functools.lru_cache(maxsize=4096)
def shared_ask(
    team: str,
    kind: str,
    priority_class: str,
    gpus: tuple[int, str | None, str | None, float | None, int | None, int | None],
    replicas: tuple[int, int] | None,
    host: tuple[int, int] | None = None,
) -> Ask:
    """The one ``Ask`` of these values (``kind`` and ``priority_class`` as their names;
    ``gpus``: count, model, models as ``models_text``, memory, milli, min count;
    ``replicas``: min, max; ``host``: CPU milli, memory MiB)."""
    count, model, models, memory_gib, milli, min_count = gpus
    return Ask(
        team,
        messages.JobKind(kind),
        PriorityClassName(priority_class),
        GpuRequest(
            count=count, model=model, models=None if models is None else models.split("|"),
            memory_gib=memory_gib, milli=milli, min_count=min_count,
        ),
        None if replicas is None else Replicas(min=replicas[0], max=replicas[1]),
        None if host is None else HostRequest(cpu_milli=host[0], memory_mib=host[1]),
    )  # fmt: skip


Usage = dict[tuple[str, str], int]
# What ``find`` depends on besides the ledger: kind and GPU request (and team, with quotas).
Shape = tuple[object, ...]


def shape_of(job: JobRecord) -> Shape:
    ask = job.ask
    gpus, host = ask.gpus, ask.host
    return (
        ask.kind, gpus.count, gpus.accepted, gpus.memory_gib, gpus.milli,
        None if host is None else (host.cpu_milli, host.memory_mib),
    )  # fmt: skip
