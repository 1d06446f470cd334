"""How read commands print: a table (rich, no borders, so `awk` and `grep` still work),
or the reply as JSON or YAML for scripts (`-o json|yaml`).

Rich and yaml are imported when something is printed, not when the CLI starts, so
`gpusched --help` stays fast.
"""

from __future__ import annotations

import enum
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


class Format(enum.StrEnum):
    TABLE = "table"
    JSON = "json"
    YAML = "yaml"


def console(stderr: bool = False) -> Console:
    from rich.console import Console

    # highlight=False: ids and numbers are not recoloured at random; soft_wrap keeps a
    # long reason on its line for grep. Piped into a file or a program, a table is as
    # wide as its content: a row stays one line for grep and awk, not folded at 80.
    stream = sys.stderr if stderr else sys.stdout
    wide = None if stream.isatty() else 4096
    return Console(stderr=stderr, highlight=False, soft_wrap=True, width=wide)


def table(*columns: str) -> Table:
    from rich import box
    from rich.table import Table

    grid = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
    for column in columns:
        grid.add_column(column, overflow="fold")
    return grid


def plain(data: Any) -> Any:
    """A reply (pydantic models, datetimes, Decimals, enums) as JSON-ready data."""
    if hasattr(data, "model_dump"):
        return data.model_dump(mode="json", exclude_none=True)
    if isinstance(data, dict):
        return {str(k): plain(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [plain(v) for v in data]
    if isinstance(data, datetime):
        return data.isoformat()
    if isinstance(data, enum.Enum):
        return data.value
    if isinstance(data, int | float | str | bool) or data is None:
        return data
    return str(data)


def emit(data: Any, fmt: Format, render: Callable[[Console], None]) -> None:
    """Print `data` as JSON or YAML, or call `render` to draw it for people."""
    if fmt is Format.JSON:
        sys.stdout.write(json.dumps(plain(data), indent=2) + "\n")
    elif fmt is Format.YAML:
        import yaml

        sys.stdout.write(yaml.safe_dump(plain(data), sort_keys=False, allow_unicode=True))
    else:
        render(console())
    sys.stdout.flush()


def ago(when: datetime | None, now: datetime | None = None) -> str:
    """`5m ago`, `2h ago`, `3d ago`: how long ago, in the largest unit that fits."""
    if when is None:
        return "-"
    seconds = ((now or datetime.now(UTC)) - when).total_seconds()
    if seconds < 0:
        return "just now"
    for size, unit in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return f"{int(seconds)}s ago"


def clock(when: datetime | None) -> str:
    """A time in the local zone, to the second."""
    return "-" if when is None else when.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def size(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"


def ranges(indexes: Iterable[int]) -> str:
    """`0-3,6` for GPUs 0, 1, 2, 3 and 6."""
    ordered = sorted(set(indexes))
    parts: list[str] = []
    start = prev = None
    for i in ordered:
        if start is None:
            start = prev = i
        elif prev is not None and i == prev + 1:
            prev = i
        else:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def gpus_by_node(refs: Sequence[tuple[str, int]]) -> list[str]:
    """`shared-01: 8 GPUs (0-7)` per node, instead of one line per GPU."""
    nodes: dict[str, list[int]] = {}
    for node, index in refs:
        nodes.setdefault(node, []).append(index)
    return [
        f"{node}: {len(ix)} GPU{'s' if len(ix) != 1 else ''} ({ranges(ix)})"
        for node, ix in sorted(nodes.items())
    ]
