"""`python -m gpusched.infra.probe [livez|readyz]`: ask this container's own service
whether it is alive or ready, for a container healthcheck (docker-compose.yml).

Reads the port and interface the service serves on from GPUSCHED_METRICS_PORT and
GPUSCHED_METRICS_HOST (as the service itself does); exits 0 when the answer is 200,
else 1 with one line saying why. Standard library only: it runs every few seconds.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def probe(what: str, env: dict[str, str]) -> tuple[bool, str]:
    port = env.get("GPUSCHED_METRICS_PORT", "0")
    host = env.get("GPUSCHED_METRICS_HOST", "127.0.0.1")
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    if not port.isdigit() or int(port) == 0:
        return False, "GPUSCHED_METRICS_PORT is not set: the service serves no health endpoint"
    url = f"http://{host}:{port}/{what}"
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S):
            return True, f"{what}: ok"
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")
        try:
            problems = json.loads(body).get("problems") or [body.strip()]
        except (ValueError, AttributeError):
            problems = [body.strip()]
        return False, f"{what}: {'; '.join(map(str, problems))}"[:500]
    except (urllib.error.URLError, OSError) as exc:
        return False, f"{what}: no answer from {url} ({exc})"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    what = args[0] if args else "readyz"
    if what not in ("livez", "readyz"):
        print("usage: python -m gpusched.infra.probe [livez|readyz]", file=sys.stderr)
        return 2
    ok, line = probe(what, dict(os.environ))
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
