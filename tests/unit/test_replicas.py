"""Placing an inference service's replicas: min all or nothing, then up to the target."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from gpusched.admission.replicas import newest_first, place_replicas, replica_id, replica_number


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
