"""Reading the traces and a user's CSV: the only module of the replay that opens files
for its input. Each reader returns plain rows for ``workload``; a missing or malformed
file is a ``TraceError`` whose message says what is wrong and what to do."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterator
from pathlib import Path

import yaml

from gpusched.domain.inventory import (
    Inventory,
    InventoryError,
    parse_inventory,
    parse_openb_node_csv,
)
from gpusched.domain.ledger import PriorityClass
from gpusched.domain.pricing import PriceBook
from gpusched.infra.textfiles import FileRefused, bounded_lines, check_readable, read_small_text

from .workload import WHOLE_GPU_MILLI, TracePod, UserRow

__all__ = [
    "OPENB",
    "PHILLY",
    "TraceError",
    "TraceFiles",
    "read_demand_csv",
    "read_inventory",
    "read_openb_nodes",
    "read_openb_pods",
    "read_philly",
    "read_price_book",
    "read_user_csv",
]

OPENB = "alibaba-gpu-v2023"
PHILLY = "philly"
DOWNLOAD_HINT = (
    "download the traces as README.md 'Cluster traces' says (alibaba/clusterdata "
    "cluster-trace-gpu-v2023 csv files into <traces>/alibaba-gpu-v2023/, the Philly "
    "run times into <traces>/philly/), or point GPUSCHED_TRACES_DIR (--traces) at them"
)
USER_COLUMNS = ("name", "arrival_s", "gpus", "run_s", "class")
DEMAND_COLUMNS = ("t_s", "gpus")
# More GPUs of inference work than any cluster has: a unit mix-up, not a demand.
MAX_DEMAND_GPUS = 1_000_000.0
# A year at a 30 s step: the replay visits every step, so a finer or longer curve is
# refused rather than replayed for hours.
MAX_DEMAND_STEPS = 1_051_200
# Ten years: a time past it is a typo (milliseconds for seconds), not a workload.
MAX_SECONDS = 10 * 365 * 86_400.0


class TraceError(ValueError):
    """A trace or CSV file is missing or malformed."""


class TraceFiles:
    """Where the files of the traces folder are."""

    def __init__(self, root: Path, pod_list: str = "openb_pod_list_default") -> None:
        self.root = root
        self.pods = root / OPENB / f"{pod_list}.csv"
        self.nodes = root / OPENB / "openb_node_list_gpu_node.csv"
        self.philly = root / PHILLY / "philly_runtime.csv"

    def check(self) -> None:
        if not self.root.is_dir():
            raise TraceError(f"no traces folder at {self.root}: {DOWNLOAD_HINT}")
        for path in (self.pods, self.nodes, self.philly):
            if not path.is_file():
                raise TraceError(
                    f"the traces folder has no {path.relative_to(self.root)}: {DOWNLOAD_HINT}"
                )


def _rows(path: Path, required: tuple[str, ...]) -> Iterator[tuple[int, dict[str, str]]]:
    try:
        check_readable(path)
        # utf-8-sig: a spreadsheet's CSV export starts with a byte-order mark, which
        # would otherwise be read as part of the first column's name.
        handle = path.open(newline="", encoding="utf-8-sig")
    except FileRefused as exc:
        raise TraceError(str(exc)) from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    with handle:
        try:
            reader = csv.DictReader(bounded_lines(handle, path))
            header = [column.strip() for column in reader.fieldnames or []]
            missing = [column for column in required if column not in header]
            if missing:
                raise TraceError(f"{path.name}: missing column(s) {', '.join(missing)}")
            reader.fieldnames = header
            for line, row in enumerate(reader, start=2):
                if any((value or "").strip() for value in row.values()):
                    yield line, {key: (value or "").strip() for key, value in row.items() if key}
        except UnicodeDecodeError as exc:
            raise TraceError(_not_text(path, exc)) from None
        except csv.Error as exc:
            raise TraceError(f"{path.name}: not a CSV file ({exc})") from None
        except FileRefused as exc:
            raise TraceError(str(exc)) from None


def _not_text(path: Path, exc: UnicodeDecodeError) -> str:
    return (
        f"{path.name}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset "
        f"{exc.start}): give a text file saved as UTF-8"
    )


def _number(
    row: dict[str, str], column: str, where: str, *, optional: bool = False
) -> float | None:
    text = row.get(column, "")
    if text == "" and optional:
        return None
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{where}: {column} is not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise TraceError(f"{where}: {column} must be a finite number >= 0, got {text!r}")
    return value


def _count(row: dict[str, str], column: str, where: str, default: int | None = None) -> int:
    text = row.get(column, "")
    if text == "" and default is not None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise TraceError(f"{where}: {column} is not a whole number: {text!r}") from None
    if value < 0 or value > 1_000_000:
        raise TraceError(f"{where}: {column} must be within 0..1000000, got {value}")
    return value


def read_openb_pods(path: Path) -> list[TracePod]:
    pods: list[TracePod] = []
    columns = (
        "name",
        "num_gpu",
        "gpu_milli",
        "qos",
        "creation_time",
        "deletion_time",
        "scheduled_time",
    )
    for line, row in _rows(path, columns):
        where = f"{path.name} line {line}"
        creation = _number(row, "creation_time", where)
        assert creation is not None
        pods.append(
            TracePod(
                name=row["name"] or f"pod-{line}",
                num_gpu=_count(row, "num_gpu", where),
                gpu_milli=_count(row, "gpu_milli", where, default=WHOLE_GPU_MILLI),
                qos=row["qos"],
                creation=creation,
                deletion=_number(row, "deletion_time", where, optional=True),
                scheduled=_number(row, "scheduled_time", where, optional=True),
            )
        )
    return pods


def read_philly(path: Path) -> list[float]:
    runtimes: list[float] = []
    for line, row in _rows(path, ("runtime",)):
        value = _number(row, "runtime", f"{path.name} line {line}")
        assert value is not None
        runtimes.append(value)
    return runtimes


def read_openb_nodes(path: Path) -> Inventory:
    try:
        return parse_openb_node_csv(io.StringIO(read_small_text(path)))
    except FileRefused as exc:
        raise TraceError(str(exc)) from None
    except UnicodeDecodeError as exc:
        raise TraceError(_not_text(path, exc)) from None
    except OSError as exc:
        raise TraceError(f"cannot read {path}: {exc.strerror or exc}") from None
    except InventoryError as exc:
        raise TraceError(f"{path.name}: {exc}") from None


_CLASSES = {c.value: c for c in PriorityClass}


def read_user_csv(path: Path) -> list[UserRow]:
    """``name,arrival_s,gpus,run_s,class`` and optional ``gpu_milli``, ``team``."""
    rows: list[UserRow] = []
    for line, row in _rows(path, USER_COLUMNS):
        where = f"{path.name} line {line}"
        arrival, run = _number(row, "arrival_s", where), _number(row, "run_s", where)
        assert arrival is not None and run is not None
        for column, value in (("arrival_s", arrival), ("run_s", run)):
            if value > MAX_SECONDS:
                raise TraceError(f"{where}: {column} {value:g} s is over ten years: give seconds")
        gpus = _count(row, "gpus", where)
        milli = _count(row, "gpu_milli", where, default=WHOLE_GPU_MILLI)
        priority = _CLASSES.get(row["class"])
        if priority is None:
            raise TraceError(f"{where}: class {row['class']!r} is not one of {', '.join(_CLASSES)}")
        if (
            gpus < 1
            or gpus > 1024
            or not 0 < milli <= WHOLE_GPU_MILLI
            or (milli < WHOLE_GPU_MILLI and gpus != 1)
        ):
            raise TraceError(
                f"{where}: gpus must be within 1..1024 and gpu_milli within 1..1000 (a "
                f"fraction for one GPU only), got gpus={gpus} gpu_milli={milli}"
            )
        if run <= 0 and priority is not PriorityClass.INFERENCE:
            raise TraceError(f"{where}: run_s of a training job must be > 0")
        rows.append(
            UserRow(
                row["name"] or f"row-{line}",
                arrival,
                gpus,
                milli,
                run,
                priority,
                row.get("team") or "default",
            )
        )
    if not rows:
        raise TraceError(f"{path.name}: no rows")
    return rows


def read_demand_csv(path: Path) -> tuple[list[float], float]:
    """``t_s,gpus``: the inference demand step by step, in GPUs of work (the busy GPUs a
    history shows, e.g. the sum of the serving GPUs' utilization), from ``t_s`` 0 at a
    constant step; the values and the step."""
    times: list[float] = []
    values: list[float] = []
    for line, row in _rows(path, DEMAND_COLUMNS):
        where = f"{path.name} line {line}"
        t, gpus = _number(row, "t_s", where), _number(row, "gpus", where)
        assert t is not None and gpus is not None
        if t > MAX_SECONDS:
            raise TraceError(f"{where}: t_s {t:g} s is over ten years: give seconds")
        if gpus > MAX_DEMAND_GPUS:
            raise TraceError(f"{where}: gpus {gpus:g} is more than any cluster: give GPUs")
        if not times and t != 0:
            raise TraceError(f"{where}: the first t_s must be 0, got {t:g}")
        if times and t <= times[-1]:
            raise TraceError(f"{where}: t_s must increase, got {t:g} after {times[-1]:g}")
        if len(times) >= MAX_DEMAND_STEPS:
            raise TraceError(
                f"{where}: more than {MAX_DEMAND_STEPS:,} steps (a year at 30 s): give a "
                "coarser step (a minute is plenty) or a shorter span"
            )
        if len(times) >= 2 and not math.isclose(t - times[-1], times[1] - times[0], rel_tol=1e-6):
            raise TraceError(
                f"{where}: t_s {t:g} breaks the step of {times[1] - times[0]:g} s: give one "
                "row per step, evenly spaced"
            )
        times.append(t)
        values.append(gpus)
    if len(values) < 2:
        raise TraceError(f"{path.name}: at least two rows are needed (their t_s give the step)")
    return values, times[1] - times[0]


def read_inventory(path: Path) -> Inventory:
    """A user's inventory YAML (as deploy/inventory/)."""
    try:
        data = yaml.safe_load(read_small_text(path))
        return parse_inventory(data if isinstance(data, dict) else {})
    except FileRefused as exc:
        raise TraceError(f"the inventory: {exc}") from None
    except OSError as exc:
        raise TraceError(f"cannot read the inventory {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(_not_text(path, exc)) from None
    except (yaml.YAMLError, InventoryError) as exc:
        raise TraceError(f"inventory {path.name}: {exc}") from None


def read_price_book(path: Path) -> PriceBook:
    try:
        data = yaml.safe_load(read_small_text(path))
        return PriceBook.from_mapping(data if isinstance(data, dict) else {})
    except FileRefused as exc:
        raise TraceError(f"the price book: {exc}") from None
    except OSError as exc:
        raise TraceError(f"cannot read the price book {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(_not_text(path, exc)) from None
    except (yaml.YAMLError, ValueError) as exc:
        raise TraceError(f"price book {path.name}: {exc}") from None
