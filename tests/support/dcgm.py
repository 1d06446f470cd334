"""dcgm-exporter stand-ins over real HTTP, and a real Prometheus, for the DCGM input
tests and the dcgm bench."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web

from gpusched.infra.embedded import free_port

FIXTURE = Path(__file__).parents[1] / "unit" / "data" / "dcgm-exporter.txt"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# dcgm-exporter's default counters (its default-counters.csv), so a page is as long
# and as mixed as a real one: the parser must skip all but five of them.
_COUNTERS = (
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption (in mJ)."),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries."),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
    ("DCGM_FI_DEV_ENC_UTIL", "gauge", "Encoder utilization (in %)."),
    ("DCGM_FI_DEV_DEC_UTIL", "gauge", "Decoder utilization (in %)."),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered."),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter", "Total NVLink bandwidth counters."),
    ("DCGM_FI_DEV_VGPU_LICENSE_STATUS", "gauge", "vGPU License status"),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "counter", "Rows remapped (uncorrectable)."),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "counter", "Rows remapped (correctable)."),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "Whether remapping of rows has failed"),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active."),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor pipe is active."),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge", "Ratio of cycles the device memory is active."),
    ("DCGM_FI_PROF_PCIE_TX_BYTES", "counter", "Bytes of PCIe tx (header and payload)."),
    ("DCGM_FI_PROF_PCIE_RX_BYTES", "counter", "Bytes of PCIe rx (header and payload)."),
)


def exporter_page(node: str, gpus: int = 8, seed: int = 0) -> str:
    """A page as dcgm-exporter prints it for one node of `gpus` A100-80GB (every
    default counter, its labels), with readings that differ per node and GPU."""
    lines: list[str] = []
    for name, kind, help_text in _COUNTERS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for g in range(gpus):
            n = seed * 31 + g * 7
            value = {
                "DCGM_FI_DEV_GPU_UTIL": n % 101,
                "DCGM_FI_DEV_FB_USED": 1000 + (n * 97) % 80000,
                "DCGM_FI_DEV_FB_FREE": 81920 - 1000 - (n * 97) % 80000,
                "DCGM_FI_DEV_GPU_TEMP": 30 + n % 50,
                "DCGM_FI_DEV_POWER_USAGE": 60 + (n * 13) % 340 + 0.125,
            }.get(name, n % 1000)
            lines.append(
                f'{name}{{gpu="{g}",UUID="GPU-{seed:08x}-{g:04x}-4c1a-9e6f-0d3b8a7c6e51",'
                f'device="nvidia{g}",modelName="NVIDIA A100-SXM4-80GB",Hostname="{node}",'
                f'DCGM_FI_DRIVER_VERSION="535.129.03"}} {value}'
            )
    return "\n".join(lines) + "\n"


def fixture_text(hostname: str = "node-a") -> str:
    """The recorded exporter page, its Hostname label set to `hostname`."""
    return FIXTURE.read_text().replace('Hostname="node-a"', f'Hostname="{hostname}"')


def text(body: str | bytes, status: int = 200) -> Handler:
    data = body.encode() if isinstance(body, str) else body

    async def handler(_: web.Request) -> web.Response:
        return web.Response(body=data, status=status, content_type="text/plain")

    return handler


@contextlib.asynccontextmanager
async def http_server(routes: Mapping[str, Handler]) -> AsyncIterator[str]:
    """A real aiohttp server on a free local port with these GET routes; its base URL.
    Handlers still running at the end (a hung target) are cancelled within a second."""
    app = web.Application()
    for path, handler in routes.items():
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=1.0, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


PROMETHEUS = shutil.which("prometheus")


@dataclass(frozen=True)
class Prometheus:
    url: str
    log_path: Path
    process: subprocess.Popen[bytes]

    def check_running(self) -> None:
        """Fail at once, with its log, if the server has exited (e.g. a bad config)."""
        if self.process.poll() is not None:
            raise AssertionError(f"prometheus exited: {self.log_tail()}")

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


@contextlib.contextmanager
def running_prometheus(target: str, scrape_interval_s: float = 1.0) -> Iterator[Prometheus]:
    """A real Prometheus (the `prometheus` on PATH) scraping `target` (host:port, path
    /metrics), its data in a temp dir removed at the end."""
    every = f"{round(scrape_interval_s * 1000)}ms"  # Prometheus takes no "1.0s"
    with prometheus_server(
        lambda _: (
            "global:\n"
            f"  scrape_interval: {every}\n"
            f"  scrape_timeout: {every}\n"
            "scrape_configs:\n"
            "  - job_name: dcgm\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n"
        )
    ) as server:
        yield server


@contextlib.contextmanager
def prometheus_server(config: Callable[[Path], str]) -> Iterator[Prometheus]:
    """A real Prometheus (the `prometheus` on PATH) with the configuration `config`
    returns for a scratch dir (where it may write rule files), its data in that dir,
    removed at the end."""
    assert PROMETHEUS is not None
    scratch = Path(tempfile.mkdtemp(prefix="gpusched-prometheus-"))
    config_path = scratch / "prometheus.yml"
    config_path.write_text(config(scratch))
    port = free_port()
    log_path = scratch / "prometheus.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [
            PROMETHEUS,
            f"--config.file={config_path}",
            f"--storage.tsdb.path={scratch / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield Prometheus(f"http://127.0.0.1:{port}", log_path, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        log.close()
        shutil.rmtree(scratch, ignore_errors=True)
