"""An S3-compatible server for the tests: moto's server mode, in a child process, on a
free local port. The AWS_* variables that point s3fs (and boto) at it are set for the
test session, as a deployment sets them for the SDK and the checkpoint service."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

_SERVER = """
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the test closes our stdin
server.stop()
"""


@contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """The environment of a client of a fresh S3 server (credentials, endpoint)."""
    process = subprocess.Popen(
        [sys.executable, "-c", _SERVER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert process.stdout is not None
        port = process.stdout.readline().decode().strip()
        if not port.isdigit():
            raise RuntimeError("the S3 test server did not start (is moto[server] installed?)")
        yield {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            # Never ask a cloud's metadata service for credentials.
            "AWS_EC2_METADATA_DISABLED": "true",
        }
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
