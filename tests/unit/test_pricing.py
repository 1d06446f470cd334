from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpusched.domain.pricing import (
    Credit,
    PriceBook,
    UnknownGpuModel,
    Usage,
    UsageKind,
    build_statements,
    price_credit,
    price_usage,
    render_statement,
)

D = Decimal
MARCH = datetime(2025, 3, 1, tzinfo=UTC)
APRIL = datetime(2025, 4, 1, tzinfo=UTC)
T0 = datetime(2025, 3, 10, 9, 0, tzinfo=UTC)

BOOK = PriceBook(
    gpu_hour={"A100": D("3.00"), "H100": D("4.50")},
    cpu_core_hour=D("0.05"),
    memory_gb_hour=D("0.005"),
    disk_gb_hour=D("0.0002"),
    inference_request_unit=D("0.0001"),
)


def training(
    *,
    team: str = "vision",
    job: str = "job-1",
    start: datetime = T0,
    minutes: float = 90,
    gpu_milli: int = 2000,
    model: str = "A100",
    cpu: str = "0",
    memory: str = "0",
    disk: str = "0",
) -> Usage:
    return Usage(
        team=team,
        allocation_id=f"alloc-{job}",
        job_id=job,
        kind=UsageKind.TRAINING,
        start=start,
        end=start + timedelta(minutes=minutes),
        gpu_model=model,
        gpu_milli=gpu_milli,
        cpu_cores=D(cpu),
        memory_gb=D(memory),
        disk_gb=D(disk),
    )


def test_two_a100s_for_ninety_minutes_at_three_dollars_cost_nine_dollars() -> None:
    line = price_usage(training(), BOOK)

    assert line.gpu_seconds == D("10800.000000")
    assert line.gpu_cost == D("9.000000")
    assert line.total == D("9.000000")


def test_training_pays_for_gpu_cpu_memory_and_disk_hours() -> None:
    line = price_usage(training(cpu="8", memory="64", disk="100"), BOOK)

    # 8 cores x 1.5 h x 0.05, 64 GB x 1.5 h x 0.005, 100 GB x 1.5 h x 0.0002
    assert (line.cpu_cost, line.memory_cost, line.disk_cost) == (
        D("0.600000"),
        D("0.480000"),
        D("0.030000"),
    )
    assert line.total == D("10.110000")


def test_inference_pays_for_gpu_hours_and_requests_only() -> None:
    usage = Usage(
        team="search",
        allocation_id="alloc-svc",
        job_id="svc-1",
        kind=UsageKind.INFERENCE,
        start=T0,
        end=T0 + timedelta(hours=1),
        gpu_model="H100",
        gpu_milli=500,
        cpu_cores=D(4),
        memory_gb=D(32),
        requests=10_000,
    )

    line = price_usage(usage, BOOK)

    # Half an H100 for an hour at 4.50, plus 10,000 requests at 0.0001.
    assert line.gpu_seconds == D("1800.000000")
    assert line.gpu_cost == D("2.250000")
    assert line.request_cost == D("1.000000")
    assert line.cpu_cost == line.memory_cost == D(0)
    assert line.total == D("3.250000")


def test_preprocessing_pays_for_cpu_and_memory_without_a_gpu_model() -> None:
    usage = Usage(
        team="data",
        allocation_id="alloc-prep",
        job_id="prep-1",
        kind=UsageKind.PREPROCESSING,
        start=T0,
        end=T0 + timedelta(hours=2),
        cpu_cores=D(16),
        memory_gb=D(100),
        disk_gb=D(500),
    )

    line = price_usage(usage, BOOK)

    assert line.total == D("1.600000") + D("1.000000")


def test_line_amounts_keep_six_decimal_places() -> None:
    line = price_usage(training(minutes=1 / 60, gpu_milli=1000), BOOK)

    # One A100-second at 3.00 per hour is 0.000833333...
    assert line.gpu_cost == D("0.000833")


def test_usage_straddling_the_period_is_clipped_and_its_requests_prorated() -> None:
    usage = Usage(
        team="search",
        allocation_id="alloc-svc",
        job_id="svc-1",
        kind=UsageKind.INFERENCE,
        start=APRIL - timedelta(hours=1),
        end=APRIL + timedelta(hours=3),
        gpu_model="A100",
        gpu_milli=1000,
        requests=40_000,
    )

    [statement] = build_statements([usage], [], BOOK, MARCH, APRIL)

    [line] = statement.lines
    assert (line.start, line.end) == (APRIL - timedelta(hours=1), APRIL)
    assert line.gpu_cost == D("3.000000")
    assert line.requests == D("10000.000000")
    assert line.request_cost == D("1.000000")


def test_usage_outside_the_period_is_not_billed() -> None:
    before = training(start=MARCH - timedelta(hours=3), minutes=180)
    after = training(start=APRIL, minutes=60)

    assert build_statements([before, after], [], BOOK, MARCH, APRIL) == []


def test_forced_preemption_is_credited_at_the_lost_gpu_seconds_price() -> None:
    credit = Credit(
        team="vision",
        job_id="job-1",
        allocation_id="alloc-job-1",
        gpu_model="A100",
        lost_gpu_seconds=D(4 * 3600),
        at=T0 + timedelta(hours=2),
    )

    [statement] = build_statements([training()], [credit], BOOK, MARCH, APRIL)

    assert price_credit(credit, BOOK).amount == D("-12.000000")
    assert statement.subtotal == D("9.000000")
    assert statement.credits_total == D("-12.000000")
    assert statement.total == D("-3.00")


def test_a_credit_is_billed_in_the_period_of_the_forced_eviction() -> None:
    credit = Credit(
        team="vision",
        job_id="job-1",
        allocation_id="alloc-job-1",
        gpu_model="A100",
        lost_gpu_seconds=D(3600),
        at=APRIL,
    )

    assert build_statements([], [credit], BOOK, MARCH, APRIL) == []
    [april] = build_statements([], [credit], BOOK, APRIL, APRIL + timedelta(days=30))
    assert april.credits_total == D("-3.000000")


def test_statements_come_one_per_team_sorted_by_team() -> None:
    usages = [training(team="vision", job="a"), training(team="audio", job="b")]
    usages.append(training(team="vision", job="c", start=T0 - timedelta(days=1)))

    statements = build_statements(usages, [], BOOK, MARCH, APRIL)

    assert [s.team for s in statements] == ["audio", "vision"]
    assert [line.job_id for line in statements[1].lines] == ["c", "a"]
    assert statements[1].total == D("18.00")


@pytest.mark.parametrize(
    ("gpu_hour", "total"),
    [("0.125", "0.12"), ("0.135", "0.14"), ("0.005", "0.00"), ("0.015", "0.02")],
)
def test_the_statement_total_rounds_half_to_even_cents(gpu_hour: str, total: str) -> None:
    book = PriceBook(gpu_hour={"A100": D(gpu_hour)})

    [statement] = build_statements([training(gpu_milli=1000, minutes=60)], [], book, MARCH, APRIL)

    assert statement.subtotal == D(gpu_hour)
    assert statement.total == D(total)


def test_only_the_statement_total_is_rounded_to_cents() -> None:
    book = PriceBook(gpu_hour={"A100": D("0.004")})
    usages = [training(job=f"j{i}", gpu_milli=1000, minutes=60) for i in range(3)]

    [statement] = build_statements(usages, [], book, MARCH, APRIL)

    # Rounding each line first would bill 3 x 0.00; the sum 0.012 bills 0.01.
    assert statement.total == D("0.01")


def test_an_unknown_gpu_model_names_the_model_and_the_known_ones() -> None:
    with pytest.raises(UnknownGpuModel, match=r"'V100'.*A100, H100") as raised:
        price_usage(training(model="V100"), BOOK)

    assert raised.value.model == "V100"
    assert isinstance(raised.value, ValueError)


def test_an_unknown_gpu_model_uses_the_default_price_when_there_is_one() -> None:
    book = PriceBook(gpu_hour={"A100": D(3)}, default_gpu_hour=D("1.50"))

    assert price_usage(training(model="V100"), book).gpu_cost == D("4.500000")


def test_a_price_book_parses_from_config_with_strings_and_numbers() -> None:
    book = PriceBook.from_mapping(
        {
            "gpu_hour": {"A100": "3.00", "H100": 4.5, "L4": 1},
            "default_gpu_hour": None,
            "cpu_core_hour": 0.05,
            "inference_request_unit": "0.0001",
            "currency": "EUR",
        }
    )

    assert book.gpu_hour == {"A100": D("3.00"), "H100": D("4.5"), "L4": D(1)}
    assert book.cpu_core_hour == D("0.05")
    assert book.memory_gb_hour == D(0)
    assert book.currency == "EUR"
    assert PriceBook.from_mapping(book.to_mapping()) == book


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpu_hour": {"A100": "-1"}}, r"gpu_hour\['A100'\] must not be negative"),
        ({"gpu_hour": {"A100": "three"}}, r"gpu_hour\['A100'\] is not a number"),
        ({"gpu_hour": {"A100": True}}, r"gpu_hour\['A100'\] must be a number"),
        ({"gpu_hour": {"A100": "NaN"}}, r"must be a finite Decimal"),
        ({"gpu_hour": {"A100": 3}, "cpu_core_hour": -0.1}, "cpu_core_hour must not be negative"),
        ({"gpu_hour": {}}, "'gpu_hour' must map GPU models to prices"),
        ({"gpu_hour": {"A100": 3}, "gpu_hours": {}}, "unknown key"),
        ({"gpu_hour": {"A100": 3}, "currency": "dollars"}, "3-letter ISO code"),
    ],
)
def test_a_bad_price_book_is_refused_with_a_clear_message(
    data: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        PriceBook.from_mapping(data)


def test_a_usage_ending_before_it_starts_is_refused() -> None:
    with pytest.raises(ValueError, match="before start"):
        training(minutes=-1)


def test_only_inference_usage_may_carry_requests() -> None:
    with pytest.raises(ValueError, match="only inference"):
        Usage(
            team="t",
            allocation_id="a",
            job_id="j",
            kind=UsageKind.TRAINING,
            start=T0,
            end=T0,
            requests=1,
        )


def test_a_naive_period_is_refused() -> None:
    with pytest.raises(ValueError, match="timezone-aware"):
        build_statements([], [], BOOK, datetime(2025, 3, 1), APRIL)


def test_the_rendered_statement_shows_each_line_credit_and_the_total() -> None:
    credit = Credit(
        team="vision",
        job_id="job-1",
        allocation_id="alloc-job-1",
        gpu_model="A100",
        lost_gpu_seconds=D(1800),
        at=T0,
    )
    [statement] = build_statements([training(cpu="8")], [credit], BOOK, MARCH, APRIL)

    text = render_statement(statement)

    assert "Statement for team vision" in text
    assert "job-1" in text and "alloc-job-1" in text and "3.000000" in text
    assert "-1.500000" in text
    assert text.splitlines()[-1].split() == ["Total", "(USD)", "8.10"]


# --- property: splitting time never changes the bill beyond rounding -----------------

LINE_ROUNDING = D("0.00001")  # up to 5 components x 3 lines x half a unit in the 6th place

USAGES = st.builds(
    lambda kind, start_s, duration_s, milli, cpu, mem, disk, requests: Usage(
        team="t",
        allocation_id="a",
        job_id="j",
        kind=kind,
        start=T0 + timedelta(microseconds=start_s),
        end=T0 + timedelta(microseconds=start_s + duration_s),
        gpu_model="H100",
        gpu_milli=milli,
        cpu_cores=cpu,
        memory_gb=mem,
        disk_gb=disk,
        requests=requests if kind is UsageKind.INFERENCE else 0,
    ),
    st.sampled_from(list(UsageKind)),
    st.integers(0, 10**10),
    st.integers(1, 7 * 24 * 3600 * 10**6),
    st.integers(0, 8000),
    st.decimals(0, 256, places=2),
    st.decimals(0, 2048, places=1),
    st.decimals(0, 10_000, places=0),
    st.integers(0, 10**7),
)


@settings(max_examples=300, deadline=None)
@given(usage=USAGES, cut=st.floats(0, 1))
def test_billing_two_adjacent_periods_costs_the_same_as_billing_their_union(
    usage: Usage, cut: float
) -> None:
    start, end = usage.start - timedelta(days=1), usage.end + timedelta(days=1)
    middle = usage.start + (usage.end - usage.start) * cut

    [whole] = build_statements([usage], [], BOOK, start, end)
    halves = [
        s for p in [(start, middle), (middle, end)] for s in build_statements([usage], [], BOOK, *p)
    ]

    split_subtotal = sum((s.subtotal for s in halves), D(0))
    assert abs(split_subtotal - whole.subtotal) <= LINE_ROUNDING
    assert abs(split_subtotal.quantize(D("0.01")) - whole.total) <= D("0.01")


@settings(max_examples=300, deadline=None)
@given(usage=USAGES, cut=st.floats(0, 1), request_share=st.floats(0, 1))
def test_pricing_a_usage_in_two_pieces_costs_the_same_as_pricing_it_whole(
    usage: Usage, cut: float, request_share: float
) -> None:
    middle = usage.start + (usage.end - usage.start) * cut
    first_requests = round(usage.requests * request_share)
    first = replace(usage, end=middle, requests=first_requests)
    second = replace(usage, start=middle, requests=usage.requests - first_requests)

    pieces = price_usage(first, BOOK).total + price_usage(second, BOOK).total

    assert abs(pieces - price_usage(usage, BOOK).total) <= LINE_ROUNDING
