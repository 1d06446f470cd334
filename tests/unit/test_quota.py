"""Quotas with borrowing, priority governance and DRF ordering, without I/O."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from gpusched.admission.explain import fair_order
from gpusched.admission.queue import JobState
from gpusched.admission.store import JobRecord
from gpusched.contracts.messages import GpuRequest, PriorityClassName, SubmitJob
from gpusched.domain.inventory import GpuRef, Pool
from gpusched.domain.ledger import Allocation, GpuSlot, JobKind, Ledger, PriorityClass
from gpusched.domain.quota import (
    AboveMax,
    ModelQuota,
    QuotaError,
    QuotaVerdict,
    dominant_shares,
    parse_quotas,
    usage_of,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2025, 3, 1, 9, 0, tzinfo=UTC)
BOOK = parse_quotas(
    {
        "teams": {
            "vision": {"gpus": {"A100-80GB": {"guaranteed": 4, "max": 8}}},
            "research": {
                "max_priority": "p2-offline",
                "above_max": "hold",
                "gpus": {"*": {"guaranteed": 1}},
            },
        }
    }
)


def test_within_the_guarantee_is_not_borrowed_beyond_it_is_and_past_max_waits() -> None:
    usage = {("vision", "A100-80GB"): 3}

    assert BOOK.decide("vision", "A100-80GB", 1, usage).verdict is QuotaVerdict.GUARANTEED
    assert BOOK.decide("vision", "A100-80GB", 2, usage).borrowed
    assert BOOK.decide("vision", "A100-80GB", 6, usage).verdict is QuotaVerdict.OVER_MAX
    assert not BOOK.decide("vision", "T4", 1, {}).allowed  # no quota for that model


def test_the_star_entry_covers_every_model_and_max_defaults_to_the_guarantee() -> None:
    research = BOOK.team("research")

    assert research is not None
    assert research.quota("T4") == research.quota("H100-80GB") == ModelQuota(1, 1)
    assert research.above_max is AboveMax.HOLD


def test_a_team_may_use_classes_up_to_its_max_priority_only() -> None:
    research = BOOK.team("research")
    vision = BOOK.team("vision")

    assert research is not None and vision is not None
    assert research.allows(PriorityClass.P2_OFFLINE)
    assert not research.allows(PriorityClass.P1_NORMAL)
    assert vision.allows(PriorityClass.P1_NORMAL) and not vision.allows(PriorityClass.P0_URGENT)


@pytest.mark.parametrize(
    ("teams", "message"),
    [
        ({}, "non-empty 'teams'"),
        ({"a": {"gpus": {"T4": {"guaranteed": 4, "max": 2}}}}, "max 2 is below guaranteed 4"),
        ({"a": {"gpus": {"T4": {"guaranteed": -1}}}}, "whole number"),
        ({"a": {"max_priority": "p9"}}, "is not one of"),
        ({"a": {"max_priority": "inference"}}, "training class"),
        ({"a": {"quota": 1}}, "unknown field"),
        ({"a": {"allow_process": "yes"}}, r"teams\.a\.allow_process: expected true or false"),
        ({"a": {"inference": 1}}, r"teams\.a\.inference: expected true or false"),
    ],
)
def test_a_malformed_quota_file_is_refused_with_the_entry_named(
    teams: dict[str, Any], message: str
) -> None:
    with pytest.raises(QuotaError, match=message):
        parse_quotas({"teams": teams})


def test_process_workloads_are_a_capability_an_operator_gives_a_team() -> None:
    book = parse_quotas(
        {
            "teams": {
                "vision": {"gpus": {"*": {"guaranteed": 1}}},
                "research": {"allow_process": True, "gpus": {"*": {"guaranteed": 1}}},
                "nlp": {"allow_process": False},
            }
        }
    )

    assert {name: team.allow_process for name, team in book.teams.items()} == {
        "vision": False,  # the default
        "research": True,
        "nlp": False,
    }


def test_the_example_quota_file_parses() -> None:
    data = yaml.safe_load((REPO_ROOT / "deploy" / "inventory" / "quotas.yaml").read_text())

    book = parse_quotas(data)

    assert set(book.teams) == {"vision", "nlp", "research"}


def allocation(team: str, gpus: int, model: str = "A100-80GB") -> Allocation:
    refs = tuple(GpuRef(f"{team}-node", index) for index in range(gpus))
    return Allocation(
        f"a-{team}", f"j-{team}", team, JobKind.TRAINING, PriorityClass.P1_NORMAL, refs, T0,
        model, Pool.SHARED,
    )  # fmt: skip


def test_dominant_share_is_a_teams_largest_share_of_any_model() -> None:
    usage = usage_of([allocation("vision", 4), allocation("vision", 1, "T4"), allocation("nlp", 2)])

    shares = dominant_shares(usage, {"A100-80GB": 8, "T4": 2})

    assert shares == {"vision": 0.5, "nlp": 0.25}


def job(job_id: str, team: str, minutes: int, priority: str = "p1-normal") -> JobRecord:
    spec = SubmitJob(
        name=job_id, team=team, priority_class=PriorityClassName(priority),
        gpus=GpuRequest(count=1),
    )  # fmt: skip
    return JobRecord.of(
        job_id, spec, JobState.QUEUED, 0, None, None, T0 + timedelta(minutes=minutes), (), False,
        {},
    )  # fmt: skip


LEDGER = Ledger(GpuSlot(GpuRef("n", index), "A100-80GB", 81920, Pool.SHARED) for index in range(8))


def test_equally_urgent_jobs_go_to_the_team_with_the_smaller_dominant_share_first() -> None:
    queued = [job("v1", "vision", 0), job("v2", "vision", 1), job("n1", "nlp", 2)]
    usage = {("vision", "A100-80GB"): 4}

    order = [queued_job.job_id for queued_job in fair_order(queued, LEDGER, usage)]

    assert order == ["n1", "v1", "v2"]


def test_a_more_urgent_class_goes_first_whatever_the_share() -> None:
    queued = [job("v1", "vision", 0, "p0-urgent"), job("n1", "nlp", 1, "p2-offline")]

    order = [queued_job.job_id for queued_job in fair_order(queued, LEDGER, {})]

    assert order == ["v1", "n1"]


@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=12))
def test_fair_order_lists_every_job_once_and_keeps_each_teams_fifo(teams: list[str]) -> None:
    queued = [job(f"j{number}", team, number) for number, team in enumerate(teams)]
    usage: dict[tuple[str, str], int] = {}

    order = []
    for picked in fair_order(queued, LEDGER, usage):
        order.append(picked)
        key = (picked.spec.team, "A100-80GB")
        usage[key] = usage.get(key, 0) + 1  # as the scheduler does after a placement

    assert sorted(j.job_id for j in order) == sorted(j.job_id for j in queued)
    for team in set(teams):
        mine = [j.submitted_at for j in order if j.spec.team == team]
        assert mine == sorted(mine)
