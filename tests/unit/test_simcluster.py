"""The simulated cluster's pure models: load, latency, the virtual loop, the GPU view."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpusched.contracts.messages import InventoryNode
from gpusched.domain.inventory import GpuRef
from gpusched.simcluster.cluster import ClusterView, gpu_samples
from gpusched.simcluster.load import (
    LatencyModel,
    inference_load,
    serving_util,
    training_util,
)
from gpusched.simcluster.training import (
    CheckpointContentError,
    VirtualLoop,
    checkpoint_document,
    checkpoint_step,
)

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _view() -> ClusterView:
    view = ClusterView()
    view.apply_inventory(
        [
            InventoryNode(name="inf-00", pool="inference", gpu_model="A100-80GB", gpus=4),
            InventoryNode(name="shared-00", pool="shared", gpu_model="A100-80GB", gpus=4),
        ]
    )
    return view


# --- load and latency ----------------------------------------------------------------------


def test_serving_gpus_share_the_demand_and_saturate_at_one() -> None:
    assert serving_util(12.0, 24) == 0.5
    assert serving_util(30.0, 24) == 1.0
    assert serving_util(0.0, 24) == 0.0
    assert serving_util(3.0, 0) == 1.0


@given(st.text(min_size=1, max_size=20), st.integers(0, 7), st.integers(0, 10_000))
def test_a_training_gpu_is_busy_near_95_percent_and_the_same_on_every_run(
    node: str, index: int, tick: int
) -> None:
    util = training_util(node, index, tick)
    assert 0.9 <= util <= 1.0
    assert util == training_util(node, index, tick)


def test_p99_rises_slowly_then_steeply_with_utilization() -> None:
    model = LatencyModel()
    p99 = [model.p99_ms(rho) for rho in (0.3, 0.5, 0.7, 0.8, 0.9, 0.95)]
    assert p99 == sorted(p99)
    assert p99[2] < 200 < p99[4]  # a 200 ms SLO holds at 0.7 and breaks at 0.9
    assert p99[4] - p99[3] > p99[1] - p99[0]


def test_an_overloaded_service_reports_the_capped_latency_and_a_long_queue() -> None:
    load = inference_load(30.0, 24, window_s=1.0)
    assert load.util == 1.0
    assert load.p99_ms == LatencyModel().max_latency_ms
    assert load.queue_depth > 1000
    # It answers at most what its GPUs can serve.
    assert load.requests == inference_load(24.0, 24, window_s=1.0).requests


def test_no_demand_means_no_requests_and_bare_service_time() -> None:
    load = inference_load(0.0, 24, window_s=2.0)
    assert (load.requests, load.queue_depth, load.util) == (0, 0, 0.0)
    assert load.p99_ms == pytest.approx(LatencyModel().service_ms * 4.605, rel=1e-3)


# --- the virtual training loop ---------------------------------------------------------------


def test_time_scale_shrinks_wall_clock_step_and_checkpoint_times() -> None:
    loop = VirtualLoop(steps=100, step_seconds=2.0, checkpoint_seconds=30.0, time_scale=60.0)
    assert loop.step_interval_s == pytest.approx(2.0 / 60)
    assert loop.checkpoint_interval_s == pytest.approx(0.5)


def test_progress_is_reported_about_once_a_second_and_at_the_last_step() -> None:
    fast = VirtualLoop(steps=1000, step_seconds=0.1, checkpoint_seconds=0.0)
    assert fast.progress_every == 10
    assert fast.reports_progress(20) and not fast.reports_progress(21)
    assert fast.reports_progress(1000)
    slow = VirtualLoop(steps=10, step_seconds=5.0, checkpoint_seconds=0.0)
    assert slow.progress_every == 1


def test_the_loss_decreases_as_training_advances() -> None:
    loop = VirtualLoop(steps=500, step_seconds=1.0, checkpoint_seconds=1.0)
    losses = [loop.loss(step) for step in range(0, 501, 50)]
    assert losses == sorted(losses, reverse=True)
    assert loop.is_done(500) and not loop.is_done(499)


def test_a_virtual_loop_needs_positive_steps_and_time() -> None:
    with pytest.raises(ValueError):
        VirtualLoop(steps=0, step_seconds=1.0, checkpoint_seconds=0.0)
    with pytest.raises(ValueError):
        VirtualLoop(steps=1, step_seconds=1.0, checkpoint_seconds=0.0, time_scale=0.0)


def test_a_checkpoint_document_round_trips_its_step_for_its_own_job_only() -> None:
    doc = checkpoint_document("job-1", 42)
    assert checkpoint_step(doc, "job-1") == 42
    with pytest.raises(CheckpointContentError, match="belongs to job"):
        checkpoint_step(doc, "job-2")
    with pytest.raises(CheckpointContentError):
        checkpoint_step(b"{not json", "job-1")


# --- which GPUs serve inference --------------------------------------------------------------


def test_the_inference_pool_serves_and_lent_gpus_join_it() -> None:
    view = _view()
    assert view.serving_gpus() == {GpuRef("inf-00", i) for i in range(4)}
    view.apply_reserved("r1", [GpuRef("shared-00", 0)], pending=[])
    assert GpuRef("shared-00", 0) in view.serving_gpus()
    view.apply_returned("r1", [GpuRef("shared-00", 0)])
    assert GpuRef("shared-00", 0) not in view.serving_gpus()


def test_a_pending_gpu_serves_only_once_its_allocation_is_released() -> None:
    view = _view()
    pending = [GpuRef("shared-00", 1), GpuRef("shared-00", 2)]
    view.apply_reserved("r1", pending, pending=pending)
    assert GpuRef("shared-00", 1) not in view.serving_gpus()
    view.apply_released([GpuRef("shared-00", 1), GpuRef("shared-00", 3)])
    assert GpuRef("shared-00", 1) in view.serving_gpus()
    assert GpuRef("shared-00", 2) not in view.serving_gpus()
    assert GpuRef("shared-00", 3) not in view.serving_gpus()
    # Replaying the same events changes nothing.
    view.apply_released([GpuRef("shared-00", 1)])
    assert len(view.serving_gpus()) == 5


def test_a_sample_per_node_shows_serving_training_and_idle_gpus() -> None:
    view = _view()
    view.apply_reserved("r1", [GpuRef("shared-00", 3)], pending=[])
    samples = gpu_samples(
        view, training=[GpuRef("shared-00", 0)], demand_gpus=2.5, tick=1, time=NOW
    )
    by_node = {s.node: {g.index: g for g in s.gpus} for s in samples}
    assert sorted(by_node) == ["inf-00", "shared-00"]
    assert [by_node["inf-00"][i].util for i in range(4)] == [0.5] * 4  # 2.5 over 5 serving
    shared = by_node["shared-00"]
    assert shared[0].util == pytest.approx(0.95, abs=0.04)
    assert shared[1].util == shared[2].util == 0.0
    assert shared[3].util == 0.5
    assert all(g.mem_used_mib <= 0.85 * g.mem_total_mib for g in shared.values())


def test_a_node_no_telemetry_subject_can_name_is_skipped_and_the_others_sampled() -> None:
    # A typo (a space, an empty label): one such node once stopped every node's samples
    # and the inference stats behind them. A name as Kubernetes gives it (dots) is sampled.
    samples = gpu_samples(
        ClusterView(),
        [GpuRef("gpu-a", 0), GpuRef("ip-10-0-1-23.ec2.internal", 0), GpuRef("n x", 1),
         GpuRef("n..y", 0)],
        0.0, 1, NOW,
    )  # fmt: skip
    assert [s.node for s in samples] == ["gpu-a", "ip-10-0-1-23.ec2.internal"]


def test_a_node_missing_from_the_inventory_still_reports_its_busy_gpus() -> None:
    samples = gpu_samples(
        ClusterView(), [GpuRef("gpu-x", 2)], 0.0, 1, NOW, extra_models={"gpu-x": "H100-80GB"}
    )
    [sample] = samples
    assert sample.node == "gpu-x"
    assert [g.index for g in sample.gpus] == [2]
    assert sample.gpus[0].mem_total_mib == 81_920
