"""The mutating admission webhook, served over HTTPS by the agent (aiohttp).

The API server calls `POST /mutate` with an AdmissionReview for every pod created in
a namespace the MutatingWebhookConfiguration selects; the answer comes from the pure
`webhook.review_response`. Bad input gets a 400 with the reason, never a traceback.
"""

from __future__ import annotations

import json
import logging
import ssl
from pathlib import Path

from aiohttp import web

from .webhook import review_response

log = logging.getLogger(__name__)

# An AdmissionReview of one pod is a few kB; the API server sends at most 3 MiB.
_MAX_BODY = 3 * 1024 * 1024


def application(scheduler_name: str) -> web.Application:
    async def mutate(request: web.Request) -> web.Response:
        try:
            review = json.loads(await request.read())
            if not isinstance(review, dict) or not isinstance(review.get("request"), dict):
                raise ValueError("not an AdmissionReview")
        except ValueError as exc:
            return web.json_response({"error": f"expected an AdmissionReview: {exc}"}, status=400)
        answer = review_response(review, scheduler_name)
        if not answer["response"]["allowed"]:
            log.info("refused pod creation: %s", answer["response"]["status"]["message"])
        return web.json_response(answer)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application(client_max_size=_MAX_BODY)
    app.router.add_post("/mutate", mutate)
    app.router.add_get("/healthz", healthz)
    return app


async def serve(
    scheduler_name: str,
    port: int,
    cert_file: Path | None,
    key_file: Path | None,
    host: str = "0.0.0.0",
) -> web.AppRunner:
    context = None
    if cert_file is not None and key_file is not None:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert_file, key_file)
    runner = web.AppRunner(application(scheduler_name), handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port, ssl_context=context).start()
    log.info("webhook serving on %s:%d (%s)", host, port, "TLS" if context else "plain HTTP")
    return runner
