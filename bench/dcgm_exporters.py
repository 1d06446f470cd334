"""The dcgm bench's exporters: N dcgm-exporter stand-ins, each on its own port, in one
process (`python -m bench.dcgm_exporters --count 1000`), so serving them does not
share an event loop or a CPU budget with the scraper being measured.

Each serves /metrics: the page dcgm-exporter prints for an 8-GPU node (every default
counter, about 40 kB), its readings distinct per node. Once every port listens, one
line goes to stdout: a JSON list of [node, url]. The process runs until stdin closes
(the bench ending, or dying, ends it too).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

from aiohttp import web
from tests.support.dcgm import exporter_page


async def serve(count: int, gpus: int) -> None:
    runners: list[web.AppRunner] = []
    targets: list[tuple[str, str]] = []
    try:
        for i in range(count):
            node = f"node-{i:05d}"
            page = exporter_page(node, gpus, seed=i).encode()

            async def metrics(_: web.Request, page: bytes = page) -> web.Response:
                return web.Response(body=page, content_type="text/plain")

            app = web.Application()
            app.router.add_get("/metrics", metrics)
            runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
            runners.append(runner)
            port = runner.addresses[0][1]
            targets.append((node, f"http://127.0.0.1:{port}/metrics"))
        print(json.dumps(targets), flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    finally:
        for runner in runners:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args()
    asyncio.run(serve(args.count, args.gpus))


if __name__ == "__main__":
    main()
