"""dcgm-exporter text -> GPU samples (ingest.dcgm): units, MIG roll-up, refusals."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tests.support.dcgm import exporter_page

from gpusched.ingest import dcgm

FIXTURE = (Path(__file__).parent / "data" / "dcgm-exporter.txt").read_text()
AT = datetime.now(UTC)


def test_exporter_text_becomes_one_sample_per_node_in_fractions_and_mib() -> None:
    parsed = dcgm.samples_from_series(dcgm.parse_exporter_text(FIXTURE), AT)

    [sample] = parsed.samples
    assert sample.node == "node-a"
    gpu0 = sample.gpus[0]
    assert (gpu0.index, gpu0.util, gpu0.mem_used_mib, gpu0.mem_total_mib) == (0, 0.87, 40000, 81920)
    assert (gpu0.temp_c, gpu0.power_w) == (61, pytest.approx(312.456))


def test_mig_instances_roll_up_onto_their_parent_gpu() -> None:
    parsed = dcgm.samples_from_series(dcgm.parse_exporter_text(FIXTURE), AT)

    gpu1 = parsed.samples[0].gpus[1]
    # 3g at 60 % and 1g at 20 %: weighted by compute slices; memory summed.
    assert gpu1.util == pytest.approx((3 * 0.60 + 1 * 0.20) / 4)
    assert (gpu1.mem_used_mib, gpu1.mem_total_mib) == (10960 + 1920, 40960 + 9920)
    assert (gpu1.temp_c, gpu1.power_w) == (48, pytest.approx(150.2))


def test_a_nan_value_refuses_that_gpu_only() -> None:
    parsed = dcgm.samples_from_series(dcgm.parse_exporter_text(FIXTURE), AT)

    assert [g.index for g in parsed.samples[0].gpus] == [0, 1]
    assert parsed.refused == {"bad_value": 1, "bad_reading": 1}


@pytest.mark.parametrize("value", ["-5", "+Inf", "250"])
def test_negative_infinite_or_out_of_range_utilization_is_refused(value: str) -> None:
    text = (
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",Hostname="n"}} {value}\n'
        'DCGM_FI_DEV_FB_USED{gpu="0",Hostname="n"} 1\n'
        'DCGM_FI_DEV_FB_FREE{gpu="0",Hostname="n"} 1\n'
    )
    parsed = dcgm.samples_from_series(dcgm.parse_exporter_text(text), AT)
    assert parsed.samples == []
    assert sum(parsed.refused.values()) >= 1


def test_a_target_that_names_its_node_overrides_the_hostname_label() -> None:
    parsed = dcgm.samples_from_series(dcgm.parse_exporter_text(FIXTURE), AT, node="inf-1")
    assert [s.node for s in parsed.samples] == ["inf-1"]


@pytest.mark.parametrize(
    ("host", "sampled"),
    [("ip-10-0-1-23.ec2.internal", True), ("gpu node 7", False), ("n..x", False)],
)
def test_a_hostname_as_kubernetes_gives_it_is_a_node_and_a_typo_is_refused(
    host: str, sampled: bool
) -> None:
    text = (
        f'DCGM_FI_DEV_GPU_UTIL{{gpu="0",Hostname="{host}"}} 40\n'
        f'DCGM_FI_DEV_FB_USED{{gpu="0",Hostname="{host}"}} 1\n'
        f'DCGM_FI_DEV_FB_FREE{{gpu="0",Hostname="{host}"}} 1\n'
    )
    parsed = dcgm.samples_from_series(dcgm.parse_exporter_text(text), AT)
    assert [s.node for s in parsed.samples] == ([host] if sampled else [])
    assert parsed.refused == ({} if sampled else {"bad_node": 1})


def _same(text: str) -> bool:
    def outcome(parse: Callable[[str], list[dcgm.Series]]) -> object:
        try:
            return [(s.name, dict(s.labels), repr(float(s.value))) for s in parse(text)]
        except ValueError:
            return "refused"

    return outcome(dcgm.parse_exporter_text) == outcome(dcgm.reference_parse)


def test_real_and_generated_pages_read_the_same_as_with_the_reference_parser() -> None:
    for page in (FIXTURE, exporter_page("node-7", gpus=8, seed=7)):
        assert dcgm.parse_exporter_text(page)
        assert _same(page)


@pytest.mark.parametrize(
    "text",
    [
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="a\\"b"} 5\n',  # an escaped quote
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 5 1700000000000\n',  # a timestamp
        '# TYPE DCGM_FI_DEV_GPU_UTIL counter\nDCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 5\n',
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",gpu="1",Hostname="n"} 5\n',  # a duplicate label
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n"} 1_000\n',
        'DCGM_FI_DEV_GPU_UTIL{gpu="0",Hostname="n",} +Inf\n',
        'DCGM_FI_DEV_GPU_UTIL {gpu="0"} 5\n',
        "DCGM_FI_DEV_GPU_UTIL 5\n",
    ],
)
def test_lines_that_are_not_plain_get_the_reference_parsers_reading(text: str) -> None:
    assert _same(text)


_label_value = st.text(alphabet='ab0,="\\}{ \n', max_size=6)
_value = st.sampled_from(["5", "0", "-1", "1.5", "1e3", "NaN", "+Inf", "Inf", "x", "1_0", ""])


@given(
    st.lists(
        st.tuples(st.sampled_from(dcgm.METRICS), _label_value, _label_value, _value),
        max_size=6,
    )
)
def test_any_page_reads_the_same_as_with_the_reference_parser(
    lines: list[tuple[str, str, str, str]],
) -> None:
    esc = {'"': '\\"', "\\": "\\\\", "\n": "\\n"}
    text = "".join(
        f'{name}{{gpu="{"".join(esc.get(c, c) for c in gpu)}",Hostname="{host}"}} {value}\n'
        for name, gpu, host, value in lines
    )
    assert _same(text)
