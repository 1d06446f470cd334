"""Placing an inference service's replicas: min all or nothing, then up to the target;
a failed replica's restart back-off."""

from __future__ import annotations

from datetime import timedelta

from hypothesis import given
from hypothesis import strategies as st

from gpusched.admission.replicas import (
    Backoff,
    newest_first,
    place_replicas,
    replica_id,
    replica_number,
)


def run(at_least: int, up_to: int, room: int) -> tuple[list[int], list[int], list[int]]:
    """Place into `room` slots; returns (placed, undone, slots taken afterwards)."""
    taken: list[int] = []

    def place_one() -> int | None:
        if len(taken) >= room:
            return None
        taken.append(len(taken))
        return taken[-1]

    def undo(one: int) -> None:
        taken.remove(one)

    placed, undone = place_replicas(at_least, up_to, place_one, undo)
    return placed, undone, taken


@given(at_least=st.integers(0, 8), extra=st.integers(0, 8), room=st.integers(0, 20))
def test_min_is_all_or_nothing_and_the_rest_as_room_allows(
    at_least: int, extra: int, room: int
) -> None:
    up_to = at_least + extra
    placed, undone, taken = run(at_least, up_to, room)

    assert placed == taken  # what was undone left nothing behind
    if room < at_least:
        assert placed == [] and len(undone) == room
    else:
        assert undone == [] and len(placed) == min(up_to, room)


def test_nothing_is_placed_when_the_target_is_met() -> None:
    assert run(0, 0, 5) == ([], [], [])


def test_replica_ids_number_the_replicas_and_the_newest_go_first() -> None:
    ids = [replica_id("job-abc", n) for n in (1, 2, 10)]
    assert ids == ["job-abc-r1", "job-abc-r2", "job-abc-r10"]
    assert [replica_number(i) for i in ids] == [1, 2, 10]
    assert replica_number("alloc-123") == 0
    assert newest_first(ids) == ["job-abc-r10", "job-abc-r2", "job-abc-r1"]


BACKOFF = Backoff(first=timedelta(seconds=10), longest=timedelta(minutes=5))
BRIEF = timedelta(seconds=3)


def test_the_back_off_doubles_with_each_failure_in_a_row_up_to_five_minutes() -> None:
    failures, waits = 0, []
    for _ in range(8):
        failures, wait = BACKOFF.after(failures, BRIEF)
        waits.append(wait.total_seconds())
    assert waits == [10, 20, 40, 80, 160, 300, 300, 300]
    assert failures == 8


def test_a_replica_that_ran_as_long_as_the_longest_back_off_starts_the_count_over() -> None:
    assert BACKOFF.after(6, timedelta(minutes=5)) == (1, timedelta(seconds=10))
    assert BACKOFF.after(6, timedelta(minutes=5) - timedelta(seconds=1)) == (
        7,
        timedelta(minutes=5),
    )


@given(
    failures=st.integers(0, 10_000),
    ran_s=st.integers(0, 10_000),
    first_s=st.integers(1, 600),
    longest_s=st.integers(1, 3600),
)
def test_the_back_off_never_exceeds_the_longest_and_never_shrinks_within_a_crash_loop(
    failures: int, ran_s: int, first_s: int, longest_s: int
) -> None:
    backoff = Backoff(timedelta(seconds=first_s), timedelta(seconds=longest_s))
    ran_for = timedelta(seconds=ran_s)
    count, wait = backoff.after(failures, ran_for)
    assert timedelta() < wait <= backoff.longest
    if ran_for < backoff.longest:
        assert count == failures + 1
        _, later = backoff.after(count, ran_for)
        assert later >= wait
    else:
        assert count == 1
