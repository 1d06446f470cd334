"""Billing core (DESIGN §3.6, §7 Billing): price usage and credits into team statements.

Money is Decimal end to end. Each priced component is kept at 6 decimal places; the
only rounding to cents (half-even) is the statement total, so splitting a usage or a
period in two changes a bill by at most the last cent.

What each kind of work pays for follows DESIGN §7:
- training: GPU-hours x that GPU model's price + CPU core-hours + memory GB-hours
  + disk GB-hours;
- inference: GPU-hours x model price + requests x unit price;
- preprocessing: CPU core-hours + memory GB-hours.
Quantities a kind does not pay for are still accepted (the ledger records what the
allocation held) and show up priced at zero.

Time windows are half-open, [start, end). A usage straddling the statement period is
clipped to it, and its requests are prorated by time, assuming a steady request rate
over the usage window (inference stats arrive per short interval, so this is close).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import ROUND_HALF_EVEN, Context, Decimal, InvalidOperation, localcontext
from enum import StrEnum
from types import MappingProxyType
from typing import Final

ZERO: Final = Decimal(0)
LINE_QUANTUM: Final = Decimal("0.000001")
CENT: Final = Decimal("0.01")
SECONDS_PER_HOUR: Final = Decimal(3600)
MILLI_PER_GPU: Final = Decimal(1000)

# Enough digits that no intermediate product is rounded before the 6-place quantize,
# whatever decimal context the caller's thread happens to run with.
_CONTEXT: Final = Context(prec=40, rounding=ROUND_HALF_EVEN)


class UsageKind(StrEnum):
    TRAINING = "training"
    INFERENCE = "inference"
    PREPROCESSING = "preprocessing"


class Component(StrEnum):
    GPU = "gpu"
    CPU = "cpu"
    MEMORY = "memory"
    DISK = "disk"
    REQUESTS = "requests"


CHARGED: Final[Mapping[UsageKind, frozenset[Component]]] = MappingProxyType(
    {
        UsageKind.TRAINING: frozenset(
            {Component.GPU, Component.CPU, Component.MEMORY, Component.DISK}
        ),
        UsageKind.INFERENCE: frozenset({Component.GPU, Component.REQUESTS}),
        UsageKind.PREPROCESSING: frozenset({Component.CPU, Component.MEMORY}),
    }
)


class UnknownGpuModel(ValueError):
    def __init__(self, model: str, known: Iterable[str]) -> None:
        self.model = model
        self.known = tuple(sorted(known))
        listed = ", ".join(self.known) or "none"
        super().__init__(
            f"no price for GPU model {model!r} and the price book has no default "
            f"(known models: {listed})"
        )


@dataclass(frozen=True)
class PriceBook:
    gpu_hour: Mapping[str, Decimal]  # per whole GPU-hour, by GPU model
    default_gpu_hour: Decimal | None = None  # None: an unpriced model is an error
    cpu_core_hour: Decimal = ZERO
    memory_gb_hour: Decimal = ZERO
    disk_gb_hour: Decimal = ZERO
    inference_request_unit: Decimal = ZERO  # per single request
    currency: str = "USD"

    def __post_init__(self) -> None:
        for model, price in self.gpu_hour.items():
            _check_price(price, f"gpu_hour[{model!r}]")
        if self.default_gpu_hour is not None:
            _check_price(self.default_gpu_hour, "default_gpu_hour")
        _check_price(self.cpu_core_hour, "cpu_core_hour")
        _check_price(self.memory_gb_hour, "memory_gb_hour")
        _check_price(self.disk_gb_hour, "disk_gb_hour")
        _check_price(self.inference_request_unit, "inference_request_unit")
        if not (len(self.currency) == 3 and self.currency.isalpha() and self.currency.isupper()):
            raise ValueError(
                f"price book: currency must be a 3-letter ISO code, got {self.currency!r}"
            )
        # A frozen book must not change under a statement being built from it.
        object.__setattr__(self, "gpu_hour", MappingProxyType(dict(self.gpu_hour)))

    def gpu_hour_price(self, model: str) -> Decimal:
        price = self.gpu_hour.get(model, self.default_gpu_hour)
        if price is None:
            raise UnknownGpuModel(model, self.gpu_hour)
        return price

    @classmethod
    def from_mapping(cls, data: Mapping[str, object]) -> PriceBook:
        """Parse a price book from config (YAML/JSON); prices may be strings or numbers."""
        unknown = set(data) - _BOOK_KEYS
        if unknown:
            raise ValueError(
                f"price book: unknown key(s) {', '.join(sorted(unknown))} "
                f"(expected {', '.join(sorted(_BOOK_KEYS))})"
            )
        gpu_hour = data.get("gpu_hour")
        if not isinstance(gpu_hour, Mapping) or not gpu_hour:
            raise ValueError("price book: 'gpu_hour' must map GPU models to prices")
        default = data.get("default_gpu_hour")
        currency = data.get("currency", "USD")
        if not isinstance(currency, str):
            raise ValueError(f"price book: currency must be a string, got {currency!r}")
        return cls(
            gpu_hour={
                str(model): _parse_price(price, f"gpu_hour[{model!r}]")
                for model, price in gpu_hour.items()
            },
            default_gpu_hour=(
                None if default is None else _parse_price(default, "default_gpu_hour")
            ),
            cpu_core_hour=_parse_price(data.get("cpu_core_hour", 0), "cpu_core_hour"),
            memory_gb_hour=_parse_price(data.get("memory_gb_hour", 0), "memory_gb_hour"),
            disk_gb_hour=_parse_price(data.get("disk_gb_hour", 0), "disk_gb_hour"),
            inference_request_unit=_parse_price(
                data.get("inference_request_unit", 0), "inference_request_unit"
            ),
            currency=currency,
        )

    def to_mapping(self) -> dict[str, object]:
        """The `from_mapping` form, with prices as strings so no digit is lost."""
        return {
            "gpu_hour": {model: str(price) for model, price in self.gpu_hour.items()},
            "default_gpu_hour": (
                None if self.default_gpu_hour is None else str(self.default_gpu_hour)
            ),
            "cpu_core_hour": str(self.cpu_core_hour),
            "memory_gb_hour": str(self.memory_gb_hour),
            "disk_gb_hour": str(self.disk_gb_hour),
            "inference_request_unit": str(self.inference_request_unit),
            "currency": self.currency,
        }


_BOOK_KEYS: Final = frozenset(
    {
        "gpu_hour",
        "default_gpu_hour",
        "cpu_core_hour",
        "memory_gb_hour",
        "disk_gb_hour",
        "inference_request_unit",
        "currency",
    }
)


@dataclass(frozen=True, kw_only=True)
class Usage:
    """What one allocation held over [start, end)."""

    team: str
    allocation_id: str
    job_id: str
    kind: UsageKind
    start: datetime
    end: datetime
    gpu_model: str = ""
    gpu_milli: int = 0  # thousandths of a GPU: 2 whole GPUs = 2000, a half = 500
    cpu_cores: Decimal = ZERO
    memory_gb: Decimal = ZERO
    disk_gb: Decimal = ZERO
    requests: int = 0

    def __post_init__(self) -> None:
        where = f"usage of allocation {self.allocation_id}"
        _require_aware(self.start, f"{where}: start")
        _require_aware(self.end, f"{where}: end")
        if self.end < self.start:
            raise ValueError(f"{where}: end {self.end} is before start {self.start}")
        if self.gpu_milli < 0 or self.requests < 0:
            raise ValueError(f"{where}: gpu_milli and requests must not be negative")
        if self.gpu_milli > 0 and not self.gpu_model:
            raise ValueError(f"{where}: gpu_model is required when GPUs are used")
        for name, quantity in (
            ("cpu_cores", self.cpu_cores),
            ("memory_gb", self.memory_gb),
            ("disk_gb", self.disk_gb),
        ):
            if not isinstance(quantity, Decimal) or not quantity.is_finite() or quantity < 0:
                raise ValueError(f"{where}: {name} must be a non-negative Decimal")
        if self.requests and self.kind is not UsageKind.INFERENCE:
            raise ValueError(f"{where}: only inference usage carries requests")

    @property
    def gpus(self) -> Decimal:
        return Decimal(self.gpu_milli) / MILLI_PER_GPU


@dataclass(frozen=True, kw_only=True)
class LineItem:
    team: str
    allocation_id: str
    job_id: str
    kind: UsageKind
    gpu_model: str
    start: datetime  # after clipping to the statement period
    end: datetime
    gpu_seconds: Decimal
    gpu_cost: Decimal
    cpu_cost: Decimal
    memory_cost: Decimal
    disk_cost: Decimal
    requests: Decimal  # requests billed, prorated when the usage was clipped
    request_cost: Decimal
    total: Decimal


@dataclass(frozen=True, kw_only=True)
class Credit:
    """Work lost to a forced preemption, given back at that GPU model's price."""

    team: str
    job_id: str
    allocation_id: str
    gpu_model: str
    lost_gpu_seconds: Decimal
    at: datetime  # when the eviction was forced; decides the statement period

    def __post_init__(self) -> None:
        _require_aware(self.at, f"credit for allocation {self.allocation_id}: at")
        if (
            not isinstance(self.lost_gpu_seconds, Decimal)
            or not self.lost_gpu_seconds.is_finite()
            or self.lost_gpu_seconds < 0
        ):
            raise ValueError(
                f"credit for allocation {self.allocation_id}: lost_gpu_seconds must be a "
                f"non-negative Decimal, got {self.lost_gpu_seconds!r}"
            )


@dataclass(frozen=True, kw_only=True)
class CreditLine:
    team: str
    job_id: str
    allocation_id: str
    gpu_model: str
    at: datetime
    lost_gpu_seconds: Decimal
    amount: Decimal  # negative


@dataclass(frozen=True, kw_only=True)
class Statement:
    team: str
    period_start: datetime
    period_end: datetime
    currency: str
    lines: tuple[LineItem, ...]
    credits: tuple[CreditLine, ...]
    subtotal: Decimal  # sum of line totals, 6 places
    credits_total: Decimal  # sum of credit amounts (<= 0), 6 places
    total: Decimal  # rounded to cents, half-even; negative when credits exceed usage


def price_usage(
    usage: Usage, book: PriceBook, *, window: tuple[datetime, datetime] | None = None
) -> LineItem:
    """Price a usage, or only its part inside `window` ([start, end)) when given."""
    start, end = usage.start, usage.end
    if window is not None:
        if not _overlaps(usage, *window):
            raise ValueError(
                f"usage of allocation {usage.allocation_id} lies outside "
                f"{window[0].isoformat()}..{window[1].isoformat()}"
            )
        start, end = max(start, window[0]), min(end, window[1])
    charged = CHARGED[usage.kind]
    with localcontext(_CONTEXT):
        seconds = _seconds(end - start)
        full_seconds = _seconds(usage.end - usage.start)
        share = seconds / full_seconds if full_seconds else Decimal(1)
        requests = usage.requests * share
        gpu_seconds = usage.gpus * seconds
        gpu_price = (
            book.gpu_hour_price(usage.gpu_model)
            if Component.GPU in charged and usage.gpu_milli
            else ZERO
        )
        costs = {
            Component.GPU: gpu_seconds * gpu_price / SECONDS_PER_HOUR,
            Component.CPU: usage.cpu_cores * seconds * book.cpu_core_hour / SECONDS_PER_HOUR,
            Component.MEMORY: usage.memory_gb * seconds * book.memory_gb_hour / SECONDS_PER_HOUR,
            Component.DISK: usage.disk_gb * seconds * book.disk_gb_hour / SECONDS_PER_HOUR,
            Component.REQUESTS: requests * book.inference_request_unit,
        }
        line = {c: _line(cost if c in charged else ZERO) for c, cost in costs.items()}
        return LineItem(
            team=usage.team,
            allocation_id=usage.allocation_id,
            job_id=usage.job_id,
            kind=usage.kind,
            gpu_model=usage.gpu_model,
            start=start,
            end=end,
            gpu_seconds=_line(gpu_seconds),
            gpu_cost=line[Component.GPU],
            cpu_cost=line[Component.CPU],
            memory_cost=line[Component.MEMORY],
            disk_cost=line[Component.DISK],
            requests=_line(requests),
            request_cost=line[Component.REQUESTS],
            total=sum(line.values(), ZERO),
        )


def price_credit(credit: Credit, book: PriceBook) -> CreditLine:
    with localcontext(_CONTEXT):
        price = book.gpu_hour_price(credit.gpu_model)
        amount = -_line(credit.lost_gpu_seconds * price / SECONDS_PER_HOUR)
    return CreditLine(
        team=credit.team,
        job_id=credit.job_id,
        allocation_id=credit.allocation_id,
        gpu_model=credit.gpu_model,
        at=credit.at,
        lost_gpu_seconds=credit.lost_gpu_seconds,
        amount=amount,
    )


def build_statements(
    usages: Iterable[Usage],
    credits: Iterable[Credit],
    book: PriceBook,
    period_start: datetime,
    period_end: datetime,
) -> list[Statement]:
    """One statement per team with usage or credits in [period_start, period_end)."""
    _require_aware(period_start, "period_start")
    _require_aware(period_end, "period_end")
    if period_end <= period_start:
        raise ValueError(f"period end {period_end} must be after its start {period_start}")
    window = (period_start, period_end)
    lines: dict[str, list[LineItem]] = defaultdict(list)
    credit_lines: dict[str, list[CreditLine]] = defaultdict(list)
    for usage in usages:
        if _overlaps(usage, period_start, period_end):
            lines[usage.team].append(price_usage(usage, book, window=window))
    for credit in credits:
        if period_start <= credit.at < period_end:
            credit_lines[credit.team].append(price_credit(credit, book))
    statements = []
    for team in sorted(lines.keys() | credit_lines.keys()):
        team_lines = sorted(lines[team], key=lambda li: (li.start, li.job_id, li.allocation_id))
        team_credits = sorted(credit_lines[team], key=lambda c: (c.at, c.job_id, c.allocation_id))
        subtotal = sum((li.total for li in team_lines), ZERO)
        credits_total = sum((c.amount for c in team_credits), ZERO)
        statements.append(
            Statement(
                team=team,
                period_start=period_start,
                period_end=period_end,
                currency=book.currency,
                lines=tuple(team_lines),
                credits=tuple(team_credits),
                subtotal=subtotal,
                credits_total=credits_total,
                total=(subtotal + credits_total).quantize(CENT, rounding=ROUND_HALF_EVEN),
            )
        )
    return statements


def render_statement(statement: Statement) -> str:
    """A plain-text statement, as printed by `gpusched bill`."""
    out = [
        f"Statement for team {statement.team}",
        f"Period   {statement.period_start.isoformat()} .. {statement.period_end.isoformat()}",
        f"Currency {statement.currency}",
        "",
    ]
    usage_rows = [
        [
            li.job_id,
            li.allocation_id,
            li.kind.value,
            li.gpu_model or "-",
            _hours(li.gpu_seconds),
            str(li.gpu_cost),
            str(li.cpu_cost),
            str(li.memory_cost),
            str(li.disk_cost),
            f"{li.requests.normalize():f}",
            str(li.request_cost),
            str(li.total),
        ]
        for li in statement.lines
    ]
    out += _table(
        [
            *("job", "allocation", "kind", "GPU model", "GPU-hours"),
            *("GPU", "CPU", "memory", "disk", "requests", "req cost", "total"),
        ],
        usage_rows,
        numeric_from=4,
    )
    if statement.credits:
        out += ["", "Credits for work lost to forced preemption"]
        out += _table(
            ["job", "allocation", "GPU model", "lost GPU-hours", "amount"],
            [
                [c.job_id, c.allocation_id, c.gpu_model, _hours(c.lost_gpu_seconds), str(c.amount)]
                for c in statement.credits
            ],
            numeric_from=3,
        )
    summary = [
        ("Subtotal", str(statement.subtotal)),
        ("Credits", str(statement.credits_total)),
        (f"Total ({statement.currency})", str(statement.total)),
    ]
    label_width = max(len(label) for label, _ in summary)
    value_width = max(len(value) for _, value in summary)
    out += [""] + [f"{label:<{label_width}}  {value:>{value_width}}" for label, value in summary]
    return "\n".join(out) + "\n"


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric_from: int) -> list[str]:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            cell.rjust(width) if i >= numeric_from else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * width for width in widths)
    return [fmt(headers), rule, *(fmt(row) for row in rows)]


def _overlaps(usage: Usage, start: datetime, end: datetime) -> bool:
    if usage.start == usage.end:
        # An instant (e.g. a burst of requests stamped at one time) belongs to the
        # period it falls in, so it is billed exactly once across adjacent periods.
        return start <= usage.start < end
    return max(usage.start, start) < min(usage.end, end)


def _seconds(duration: timedelta) -> Decimal:
    # Integer microseconds keep the conversion exact; timedelta.total_seconds() is a float.
    return Decimal(duration // timedelta(microseconds=1)) / Decimal(1_000_000)


def _line(amount: Decimal) -> Decimal:
    return amount.quantize(LINE_QUANTUM, rounding=ROUND_HALF_EVEN, context=_CONTEXT)


def _hours(seconds: Decimal) -> str:
    return str(_line(seconds / SECONDS_PER_HOUR))


def _check_price(price: object, where: str) -> None:
    if not isinstance(price, Decimal) or not price.is_finite():
        raise ValueError(f"price book: {where} must be a finite Decimal, got {price!r}")
    if price < 0:
        raise ValueError(f"price book: {where} must not be negative, got {price}")


def _parse_price(value: object, where: str) -> Decimal:
    if isinstance(value, bool) or not isinstance(value, str | int | float | Decimal):
        raise ValueError(f"price book: {where} must be a number, got {value!r}")
    try:
        # str() of a float is its shortest round-trip form, so 3.1 from YAML stays 3.1
        # instead of 3.100000000000000088817841970012523.
        price = Decimal(str(value).strip())
    except InvalidOperation:
        raise ValueError(f"price book: {where} is not a number: {value!r}") from None
    _check_price(price, where)
    return price


def _require_aware(value: datetime, what: str) -> None:
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"{what} must be a timezone-aware datetime, got {value!r}")
