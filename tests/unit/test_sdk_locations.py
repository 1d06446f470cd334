"""Where the SDK writes checkpoints (sdk.storage.Location) and reads a resume URI
(sdk.checkpoints.checkpoint_path): what a clumsy URI gets instead of a wrong file."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpusched.sdk.checkpoints import checkpoint_path
from gpusched.sdk.errors import CheckpointError
from gpusched.sdk.storage import Location


@pytest.mark.parametrize(
    "where",
    ["file:///srv/ckpt/job-1", "file://localhost/srv/ckpt/job-1", "/srv/ckpt/job-1"],
)
def test_a_local_location_is_this_hosts_absolute_path(where: str) -> None:
    location = Location.of(where)
    assert location.is_local
    assert (location.path, location.uri) == ("/srv/ckpt/job-1", "file:///srv/ckpt/job-1")


def test_a_relative_path_is_resolved_where_the_job_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    # A directory whose name has a colon but no store's scheme is a plain path.
    for name in ("ckpt", "run:1/ckpt"):
        assert Location.of(name).path == str(tmp_path / name)


@pytest.mark.parametrize(
    ("where", "says"),
    [
        ("file://node-7/srv/ckpt", "names the host 'node-7'"),
        ("file:srv/ckpt", "no absolute path"),
        ("s3:/bucket/job", "is no URI: write s3://"),
        ("gs:bucket/job", "is no URI: write gs://"),
    ],
)
def test_a_mistyped_uri_is_refused_in_one_line_instead_of_writing_elsewhere(
    where: str, says: str
) -> None:
    with pytest.raises(CheckpointError, match=says) as refused:
        Location.of(where)
    assert "\n" not in str(refused.value)


def test_a_resume_uri_is_read_on_this_host_only() -> None:
    assert checkpoint_path("file:///srv/ckpt/a%20b.pt") == Path("/srv/ckpt/a b.pt")
    assert checkpoint_path("file://localhost/srv/x.pt") == Path("/srv/x.pt")
    for uri, says in (
        ("file://node-7/srv/x.pt", "names the host"),
        ("s3://bucket/x.pt", "not a file:// URI"),
    ):
        with pytest.raises(ValueError, match=says):
            checkpoint_path(uri)


def test_a_local_directory_named_like_a_scheme_is_written_with_dot_slash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match=r"\./s3:/bucket"):
        Location.of("s3:/bucket")
    assert Location.of("./s3:/bucket").path == str(tmp_path / "s3:" / "bucket")
