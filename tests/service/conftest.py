"""Fixtures shared by the service tests.

A module that uses ``admission`` or ``client`` defines ``admission_settings`` (usually
``with_inventory(settings, tmp_path, ITS_INVENTORY)``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from tests.support.admission import Admission, Client, start_admission
from tests.support.identity import harness_options

from gpusched.contracts.subjects import Subjects
from gpusched.infra.embedded import EmbeddedNats, free_port
from gpusched.infra.settings import Settings


@pytest.fixture
async def admission(admission_settings: Settings) -> AsyncIterator[Admission]:
    running = await start_admission(admission_settings)
    yield running
    await running.stop()


@pytest.fixture
def client_class() -> type[Client]:
    """The client the ``client`` fixture makes; a module may override it with a subclass."""
    return Client


@pytest.fixture
async def client(admission_settings: Settings, client_class: type[Client]) -> AsyncIterator[Client]:
    assert admission_settings.nats_url is not None
    nc = await nats.connect(admission_settings.nats_url, **harness_options(admission_settings))
    yield client_class(nc, nc.jetstream(), Subjects(admission_settings.subject_prefix))
    await nc.drain()


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A NATS of the test's own (no auth), which it may stop and start: an outage that
    touches nothing else of the run."""
    server = EmbeddedNats(tmp_path / "nats", port=free_port())
    server.start()
    try:
        yield server
    finally:
        server.stop()
