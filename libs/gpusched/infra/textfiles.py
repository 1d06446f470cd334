"""Reading the small text files a person names (a job file, an inventory, a price book,
a CSV to replay) without trusting the name: a device or a directory is refused before
it is read (``/dev/zero`` would be read forever), a file over its bound is refused
instead of filling memory, and a line of a streamed file has a bound too (a pipe, as
``--csv <(zcat month.csv.gz)``, is read: it has an end).

A refusal is `FileRefused` (a ValueError), one line naming the file; a file that is
missing or unreadable raises OSError and one that is not UTF-8 UnicodeDecodeError, as
reading it any other way would, so callers keep their own words for those.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Final

# A configuration or job file is kilobytes; a whole cluster's inventory a few MB.
SMALL_FILE_BYTES: Final = 16 * 1024 * 1024
# A CSV row of a trace is about a hundred characters.
MAX_LINE_CHARS: Final = 1024 * 1024


class FileRefused(ValueError):
    """The file cannot be what its reader expects; the message says why, in one line."""


def check_readable(path: Path) -> os.stat_result:
    """The file's status, if it is a regular file or a pipe; FileRefused otherwise (and
    OSError, as from open(), if there is none or it may not be read)."""
    status = path.stat()
    if stat.S_ISDIR(status.st_mode):
        raise FileRefused(f"{path} is a directory: give a file")
    if not (stat.S_ISREG(status.st_mode) or stat.S_ISFIFO(status.st_mode)):
        raise FileRefused(f"{path} is not a regular file (a device?): give a file")
    return status


def read_small_text(path: Path, limit: int = SMALL_FILE_BYTES) -> str:
    """The whole of a small UTF-8 file; FileRefused if it is no file or over `limit`."""
    status = check_readable(path)
    if status.st_size > limit:
        raise FileRefused(f"{path} is {status.st_size:,} bytes, over the {limit:,} allowed")
    with path.open("rb") as handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:
        # A pipe, or a file that grew while being read.
        raise FileRefused(f"{path} holds more than the {limit:,} bytes allowed")
    return raw.decode("utf-8")


def bounded_lines(handle: IO[str], path: Path, limit: int = MAX_LINE_CHARS) -> Iterator[str]:
    """The lines of an open text file, each at most `limit` characters (FileRefused on
    a longer one: a file without line breaks would otherwise be read whole)."""
    number = 0
    while line := handle.readline(limit + 1):
        number += 1
        if len(line) > limit:
            raise FileRefused(f"{path.name} line {number} is over {limit:,} characters")
        yield line
