"""Fragmentation-aware placement of fractions, without I/O: the workload mix the FGD
fragment (Weng et al., ATC'23; tests/unit/test_fragmentation.py) is measured against,
and the ledger's choice among candidate GPUs (it must not strand a host's free GPUs)."""

from __future__ import annotations

from datetime import UTC, datetime

from gpusched.domain.inventory import GpuRef, GpuSpec, Inventory, NodeSpec, Pool
from gpusched.domain.ledger import (
    JobKind,
    Ledger,
    Placement,
    PlacementRequest,
    PriorityClass,
)
from gpusched.domain.sharing import (
    WHOLE_GPU_MILLI,
    GpuShare,
    PodShape,
    ShareAsk,
    WorkloadMix,
)

GIB = 1024
T0 = datetime(2026, 3, 2, 12, 0, tzinfo=UTC)
WHOLE_POD = PodShape(1, WHOLE_GPU_MILLI, 8_000, 16 * GIB)
HALF_POD = PodShape(1, 500, 4_000, 8 * GIB)


# --- the workload mix ---------------------------------------------------------------------


def test_the_mix_gives_each_shape_its_share_of_the_requests_seen() -> None:
    mix = WorkloadMix()
    for _ in range(288):
        mix.observe(HALF_POD)
    for _ in range(96):
        mix.observe(WHOLE_POD)
    typical = dict(mix.typical())
    assert typical[HALF_POD] == 288 / 385  # beside one whole 1-GPU pod assumed at start
    assert typical[PodShape(1, WHOLE_GPU_MILLI, 0, 0)] == 1 / 385
    assert abs(sum(typical.values()) - 1) < 1e-9


def test_the_mix_scores_only_the_most_frequent_shapes() -> None:
    mix = WorkloadMix(top=2)
    for milli in range(100, 600, 100):
        for _ in range(milli // 100 + 1):
            mix.observe(PodShape(1, milli, 0, 0))
    assert [shape.milli for shape, _ in mix.typical()] == [500, 400]


def test_the_mix_follows_a_workload_that_changes() -> None:
    mix = WorkloadMix(halve_every=100)
    for _ in range(1_000):
        mix.observe(WHOLE_POD)
    for _ in range(1_000):
        mix.observe(HALF_POD)
    assert dict(mix.typical())[HALF_POD] > 0.9


# --- the ledger's choice ------------------------------------------------------------------


def host(name: str, gpus: int, cpu_milli: int) -> NodeSpec:
    specs = tuple(GpuSpec(name, i, "A100-80GB", 80 * GIB) for i in range(gpus))
    return NodeSpec(name, Pool.SHARED, specs, cpu_milli, 512 * GIB)


def fraction(job: str, milli: int, cpu_milli: int) -> PlacementRequest:
    return PlacementRequest(job, JobKind.TRAINING, 1, cpu_milli=cpu_milli, share=ShareAsk(milli))


def put(ledger: Ledger, job: str, ref: GpuRef, milli: int, cpu_milli: int) -> None:
    """A tenant on a GPU of the test's choosing (as if placed earlier)."""
    request = fraction(job, milli, cpu_milli)
    share = GpuShare(milli, 80 * GIB * milli // WHOLE_GPU_MILLI)
    placement = Placement(request, (ref,), "A100-80GB", Pool.SHARED, share)
    ledger.allocate(f"a-{job}", placement, "team", PriorityClass.P1_NORMAL, T0)


def learn_whole_gpu_pods(ledger: Ledger, count: int, cpu_milli: int) -> None:
    # Asking is enough: the ledger learns the mix from the requests it is asked to place.
    for number in range(count):
        request = PlacementRequest(f"w{number}", JobKind.TRAINING, 1, cpu_milli=cpu_milli)
        ledger.place(request)


def test_a_fraction_avoids_a_tight_gpu_whose_host_it_would_leave_without_cpu() -> None:
    # On "tight" the fraction fits its GPU exactly, but takes the CPU the host's three
    # free GPUs need for the whole-GPU pods that are most of the workload; "roomy" has
    # a looser fit and CPU to spare.
    ledger = Ledger.from_inventory(Inventory((host("roomy", 4, 64_000), host("tight", 4, 20_000))))
    put(ledger, "t0", GpuRef("tight", 0), 600, 4_000)
    put(ledger, "r0", GpuRef("roomy", 0), 500, 4_000)
    learn_whole_gpu_pods(ledger, 20, 8_000)
    placement = ledger.place(fraction("f", 400, 12_000))
    assert placement is not None
    assert placement.gpus == (GpuRef("roomy", 0),)
    ledger.allocate("a-f", placement, "team", PriorityClass.P1_NORMAL, T0)
    # The tight host keeps CPU for whole-GPU pods on two of its three free GPUs; taking
    # the fraction there would have left it 4 cores, for none.
    room = ledger.host_room("tight")
    assert room is not None and room.cpu_free >= 2 * 8_000


def test_without_a_host_to_strand_the_tightest_shared_gpu_wins() -> None:
    ledger = Ledger.from_inventory(Inventory((host("a", 4, 64_000), host("b", 4, 64_000))))
    put(ledger, "a0", GpuRef("a", 0), 600, 4_000)
    put(ledger, "b0", GpuRef("b", 0), 500, 4_000)
    learn_whole_gpu_pods(ledger, 20, 8_000)
    placement = ledger.place(fraction("f", 400, 4_000))
    assert placement is not None and placement.gpus == (GpuRef("a", 0),)


def test_a_fraction_keeps_whole_gpus_whole_while_whole_gpu_pods_are_common() -> None:
    ledger = Ledger.from_inventory(Inventory((host("a", 4, 64_000),)))
    put(ledger, "a0", GpuRef("a", 0), 300, 4_000)
    learn_whole_gpu_pods(ledger, 20, 8_000)
    placement = ledger.place(fraction("f", 500, 4_000))
    assert placement is not None and placement.gpus == (GpuRef("a", 0),)


def test_a_fraction_lands_on_a_host_already_too_starved_for_whole_gpu_pods() -> None:
    # "spent" has CPU for this small fraction only; its partly used GPU is lost to the
    # whole-GPU pods anyway, so using it costs nothing, while a fresh node's GPU would
    # be taken from them.
    ledger = Ledger.from_inventory(Inventory((host("fresh", 8, 96_000), host("spent", 2, 16_000))))
    put(ledger, "s0", GpuRef("spent", 0), 200, 8_000)
    put(ledger, "s1", GpuRef("spent", 1), 1_000 - 200, 6_000)
    learn_whole_gpu_pods(ledger, 20, 8_000)
    placement = ledger.place(fraction("f", 700, 2_000))
    assert placement is not None and placement.gpus == (GpuRef("spent", 0),)
