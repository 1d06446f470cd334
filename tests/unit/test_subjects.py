"""A node's telemetry subject token (contracts/subjects.py), without I/O."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.contracts.subjects import (
    Subjects,
    has_node_token,
    node_token,
    telemetry_partition,
    untelemetered_note,
)

LABEL = st.text("abcdefghijklmnopqrstuvwxyzAZ0123456789-_", min_size=1, max_size=12)
NAMES = st.lists(LABEL, min_size=1, max_size=6).map(".".join).filter(lambda n: len(n) <= 128)


@pytest.mark.parametrize(
    ("name", "token"),
    [
        ("shared-00", "shared-00"),
        ("gpu_node_7", "gpu_node_7"),
        ("ip-10-0-1-23.ec2.internal", "ip-10-0-1-23~ec2~internal"),
        ("ip-192-168-7-9.us-west-2.compute.internal", "ip-192-168-7-9~us-west-2~compute~internal"),
        ("node-a.b", "node-a~b"),
    ],
)
def test_a_node_name_is_its_token_with_each_dot_written_as_a_tilde(name: str, token: str) -> None:
    assert node_token(name) == token
    assert has_node_token(name)
    assert Subjects("p").telemetry_gpu(name) == f"p.telemetry.gpu.{token}"
    assert Subjects("p").stored_telemetry_gpu(name).endswith(f".{token}")


@pytest.mark.parametrize(
    "name",
    ["", "n x", "a..b", ".a", "a.", "a.*", "a.>", "node~1", "a\tb", "é.b", "a." + "b" * 127],
    ids=["empty", "space", "empty-label", "leading-dot", "trailing-dot", "star", "gt",
         "tilde", "tab", "non-ascii", "too-long"],
)  # fmt: skip
def test_a_name_no_token_can_stand_for_is_refused_in_one_line(name: str) -> None:
    assert not has_node_token(name)
    with pytest.raises(ValueError, match="cannot be used in a subject") as refused:
        node_token(name)
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError):
        Subjects("p").telemetry_gpu(name)
    assert "no GPU telemetry" in untelemetered_note(name)


@given(NAMES, NAMES)
def test_two_names_never_share_a_token(first: str, second: str) -> None:
    # `~` is in no name, so the token gives its name back: a node can never speak on
    # another node's subject (its credentials name the token).
    assert node_token(first).replace("~", ".") == first
    assert (node_token(first) == node_token(second)) == (first == second)
    assert "." not in node_token(first)


def test_a_dotted_name_is_partitioned_as_the_server_hashes_its_token() -> None:
    # The stream's transform hashes the subject token the node published on.
    name = "ip-10-0-1-23.ec2.internal"
    assert telemetry_partition(name) == telemetry_partition("ip-10-0-1-23~ec2~internal")
    # A name without a token has no samples, but a partition all the same (no error).
    assert 0 <= telemetry_partition("n x") < 16
