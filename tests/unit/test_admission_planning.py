"""The scheduling pass's pure core (planning.plan) and the in-memory queue, without I/O."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.admission import planning
from gpusched.admission.catalog import Catalog
from gpusched.admission.index import QueueIndex
from gpusched.admission.parking import Where
from gpusched.admission.planning import JobFailed, Plan, Rules, plan
from gpusched.admission.queue import JobState
from gpusched.admission.reservations import Reservation
from gpusched.admission.store import JobRecord
from gpusched.contracts.messages import GpuRequest, PriorityClassName, SubmitJob
from gpusched.domain.inventory import Inventory, parse_inventory
from gpusched.domain.ledger import Ledger
from gpusched.domain.quota import usage_of

T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
NOW = T0 + timedelta(minutes=1)
# Two shared nodes of 4 GPUs: 8 GPUs for training.
INVENTORY: Inventory = parse_inventory(
    {
        "nodes": [
            {"name_prefix": "shared", "count": 2, "pool": "shared", "gpu_model": "A100-80GB",
             "gpus": 4, "cpu_milli": 64000, "memory_mib": 524288},
        ]
    }
)  # fmt: skip
RULES = Rules(Catalog(INVENTORY), reserve_after=timedelta(hours=1), starve_after=timedelta(hours=2))
TEAMS = ("vision", "nlp", "speech")
CLASSES = ("p0-urgent", "p1-normal", "p2-offline")


def job(
    job_id: str, gpus: int, seconds: int, team: str = "vision", priority: str = "p1-normal"
) -> JobRecord:
    spec = SubmitJob(
        name=job_id, team=team, priority_class=PriorityClassName(priority),
        gpus=GpuRequest(count=gpus),
    )  # fmt: skip
    return JobRecord.of(
        job_id, spec, JobState.QUEUED, 0, None, None, T0 + timedelta(seconds=seconds), (), False,
        {},
    )  # fmt: skip


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"alloc-{next(counter)}"


def run(
    jobs: Sequence[JobRecord],
    ledger: Ledger | None = None,
    *,
    only: Sequence[str] | None = None,
    reservations: dict[str, Reservation] | None = None,
    make_ids: Callable[[], str] | None = None,
) -> Plan:
    ledger = ledger or Ledger.from_inventory(INVENTORY)
    return plan(
        QueueIndex(jobs), ledger, usage_of(ledger.allocations.values()), reservations or {},
        NOW, RULES, only=only, allocation_ids=make_ids or ids(),
    )  # fmt: skip


def granted(outcome: Plan) -> list[str]:
    return [grant.job.job_id for grant in outcome.grants]


def test_a_more_urgent_class_is_placed_first_then_first_in_first_out() -> None:
    jobs = [
        job("offline", 4, 0, priority="p2-offline"),
        job("normal-1", 4, 1),
        job("urgent", 4, 2, priority="p0-urgent"),
        job("normal-2", 4, 3),
    ]

    outcome = run(jobs)

    assert granted(outcome) == ["urgent", "normal-1"]
    assert [waiting.job_id for waiting, _ in outcome.waiting] == ["normal-2", "offline"]
    assert all(attempt.reasons for _, attempt in outcome.waiting)
    assert outcome.placed == 2 and outcome.examined == 4


def test_the_plan_allocates_into_the_ledger_it_is_given() -> None:
    ledger = Ledger.from_inventory(INVENTORY)

    outcome = run([job("a", 3, 0), job("b", 2, 1)], ledger)

    assert sorted(ledger.allocations) == sorted(g.granted.allocation_id for g in outcome.grants)
    assert sum(len(a.gpus) for a in ledger.allocations.values()) == 5


def test_the_same_inputs_give_the_same_plan() -> None:
    jobs = [job(f"j{n}", 1 + n % 4, n, TEAMS[n % 3]) for n in range(12)]

    first, second = run(jobs), run(jobs)

    assert [(g.job.job_id, g.granted.gpus) for g in first.grants] == [
        (g.job.job_id, g.granted.gpus) for g in second.grants
    ]
    oldest_waiting = min(waiting.submitted_at for waiting, _ in first.waiting)
    assert first.next_deadline == second.next_deadline == oldest_waiting + RULES.reserve_after


def test_an_already_audited_waiting_job_is_not_audited_again() -> None:
    seen = dataclasses.replace(job("seen", 8, 0), wait_audited=True)

    outcome = run([job("blocker", 1, -1), seen])

    assert granted(outcome) == ["blocker"] and outcome.waiting == []


def test_an_incremental_plan_looks_at_the_named_jobs_only() -> None:
    ledger = Ledger.from_inventory(INVENTORY)
    run([job("big", 8, 0)], ledger)
    waiting = job("waits", 8, 1)

    outcome = run([waiting, job("new", 1, 2)], ledger, only=["new"])

    assert outcome.examined == 1 and outcome.waiting[0][0].job_id == "new"


def test_an_incremental_plan_keeps_off_every_node_reserved_for_another_job() -> None:
    ledger = Ledger.from_inventory(INVENTORY)
    node = ledger.gpus[0].ref.node
    # The gang holding the node comes after the new job in the order: a full plan would
    # let the new job use the node, an incremental one does not.
    held = Reservation("gang", (node,), T0, "waited")
    jobs = [job("new", 4, 0, priority="p0-urgent"), job("gang", 8, 1)]

    incremental = run(jobs, ledger, only=["new"], reservations={"gang": held})

    [grant] = incremental.grants
    assert {ref.node for ref in grant.granted.gpus} != {node}


def test_a_job_whose_decision_raises_is_named_with_the_cause_chained(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_find = planning.find

    def find(*args: Any, **kwargs: Any) -> Any:
        if args[2].job_id == "bad":
            raise ZeroDivisionError("a bug")
        return real_find(*args, **kwargs)

    monkeypatch.setattr(planning, "find", find)

    with pytest.raises(JobFailed) as failed:
        run([job("good", 1, 0), job("bad", 1, 1)])

    assert (failed.value.job_id, failed.value.where) == ("bad", Where.PLACEMENT)
    assert isinstance(failed.value.__cause__, ZeroDivisionError)


def test_alike_waiting_jobs_cost_one_search_per_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    searched: list[str] = []
    real_find = planning.find

    def find(*args: Any, **kwargs: Any) -> Any:
        searched.append(args[2].job_id)
        return real_find(*args, **kwargs)

    monkeypatch.setattr(planning, "find", find)
    jobs = [job("fills", 8, 0)] + [job(f"w{n}", 1 + n % 2, n + 1) for n in range(100)]

    outcome = run(jobs)

    assert granted(outcome) == ["fills"] and len(outcome.waiting) == 100
    assert searched == ["fills", "w0", "w1"]


gangs = st.lists(
    st.tuples(st.integers(1, 8), st.sampled_from(TEAMS), st.sampled_from(CLASSES)),
    min_size=1,
    max_size=14,
)


@settings(max_examples=60, deadline=None)
@given(first=gangs, later=gangs)
def test_with_no_capacity_freed_planning_the_new_jobs_alone_places_what_a_full_plan_would(
    first: list[tuple[int, str, str]], later: list[tuple[int, str, str]]
) -> None:
    """What the scheduler's incremental pass rests on: after a pass, jobs that did not fit
    still do not while nothing is freed, so planning only the new ones is the same."""
    old = [job(f"a{n}", g, n, team, p) for n, (g, team, p) in enumerate(first)]
    new = [job(f"b{n}", g, 100 + n, team, p) for n, (g, team, p) in enumerate(later)]

    def after_first() -> tuple[Ledger, list[JobRecord]]:
        ledger = Ledger.from_inventory(INVENTORY)
        outcome = run(old, ledger, make_ids=lambda: f"first-{len(ledger.allocations)}")
        placed = set(granted(outcome))
        return ledger, [j for j in old if j.job_id not in placed]

    ledger_full, left = after_first()
    ledger_incremental, _ = after_first()

    full = run([*left, *new], ledger_full)
    incremental = run([*left, *new], ledger_incremental, only=[j.job_id for j in new])

    assert granted(incremental) == granted(full)
    assert set(granted(full)) <= {j.job_id for j in new}


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(st.booleans(), st.integers(0, 30), st.sampled_from(TEAMS),
                  st.sampled_from(CLASSES), st.integers(0, 50)),
        max_size=60,
    )
)  # fmt: skip
def test_the_queue_index_holds_what_was_put_and_not_dropped_each_team_in_order(
    operations: list[tuple[bool, int, str, str, int]],
) -> None:
    index = QueueIndex()
    model: dict[str, JobRecord] = {}
    for put, number, team, priority, seconds in operations:
        job_id = f"j{number}"
        if put:
            record = job(job_id, 1, seconds, team, priority)
            index.put(record)
            model[job_id] = record
        else:
            index.drop(job_id)
            model.pop(job_id, None)

    assert len(index) == len(model)
    assert sorted(r.job_id for r in index.records()) == sorted(model)
    for teams in index.lines().values():
        for line in teams.values():
            keys = [(r.submitted_at, r.job_id) for r in line]
            assert keys == sorted(keys)
            assert all(model[r.job_id] == r for r in line)
