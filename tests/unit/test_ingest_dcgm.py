"""dcgm-exporter text -> GPU samples (ingest.dcgm): units, MIG roll-up, refusals."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

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
