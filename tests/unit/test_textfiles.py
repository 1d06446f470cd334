"""Files a person names are read only if they are files, and only up to their bound."""

from __future__ import annotations

import io
import os
import stat
import threading
from pathlib import Path

import pytest

from gpusched.infra import natsauth
from gpusched.infra.textfiles import FileRefused, bounded_lines, read_small_text


def test_a_small_file_is_read_whole(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: llm\ngpus: 8\n", encoding="utf-8")

    assert read_small_text(job) == "name: llm\ngpus: 8\n"


def test_a_device_is_refused_before_it_is_read() -> None:
    # /dev/zero would be read forever; /dev/null is read as empty by anything unchecked.
    for device in ("/dev/zero", "/dev/null"):
        with pytest.raises(FileRefused, match="is not a regular file"):
            read_small_text(Path(device))


def test_a_directory_and_a_missing_file_are_said_as_such(tmp_path: Path) -> None:
    with pytest.raises(FileRefused, match="is a directory"):
        read_small_text(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_small_text(tmp_path / "none.yaml")


def test_a_file_over_its_bound_is_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_bytes(b"x" * 101)

    with pytest.raises(FileRefused, match="101 bytes, over the 100 allowed"):
        read_small_text(big, limit=100)
    assert read_small_text(big, limit=101) == "x" * 101


def test_a_pipe_is_read_but_only_up_to_the_bound(tmp_path: Path) -> None:
    fifo = tmp_path / "job.fifo"
    os.mkfifo(fifo)

    def feed(data: bytes) -> threading.Thread:
        def write() -> None:
            with fifo.open("wb") as out:
                out.write(data)

        thread = threading.Thread(target=write, daemon=True)
        thread.start()
        return thread

    writer = feed(b"gpus: 1\n")
    assert read_small_text(fifo) == "gpus: 1\n"
    writer.join(5)

    writer = feed(b"y" * 5000)
    with pytest.raises(FileRefused, match="holds more than the 4,096 bytes allowed"):
        read_small_text(fifo, limit=4096)
    writer.join(5)


def test_not_utf8_is_a_decode_error_for_the_caller_to_word(tmp_path: Path) -> None:
    binary = tmp_path / "job.yaml"
    binary.write_bytes(b"\xff\xfe\x00")

    with pytest.raises(UnicodeDecodeError):
        read_small_text(binary)


def test_lines_have_a_bound_so_a_file_without_line_breaks_is_not_read_whole() -> None:
    path = Path("month.csv")
    assert list(bounded_lines(io.StringIO("a,b\n1,2\n3,4"), path, limit=10)) == [
        "a,b\n", "1,2\n", "3,4"
    ]  # fmt: skip
    endless = io.StringIO("a,b\n" + "z" * 50)
    with pytest.raises(FileRefused, match=r"month\.csv line 2 is over 10 characters"):
        list(bounded_lines(endless, path, limit=10))


def test_a_secret_never_replaces_a_device_or_a_directory(tmp_path: Path) -> None:
    with pytest.raises(natsauth.AuthError, match="is not a regular file"):
        natsauth.write_secret(Path("/dev/null"), "seed")
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode)
    with pytest.raises(natsauth.AuthError, match="is not a regular file"):
        natsauth.write_secret(tmp_path, "seed")

    target = tmp_path / "team.creds"
    target.write_text("old")
    natsauth.write_secret(target, "new")
    assert target.read_text() == "new"
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
