"""The whole control plane on one machine: servers, streams, migrations, services.

`gpusched up`, `gpusched demo` and the end-to-end tests use this. With
GPUSCHED_NATS_URL / GPUSCHED_DATABASE_URL set it starts no servers and uses those.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from gpusched.contracts.subjects import Subjects
from gpusched.infra import bus
from gpusched.infra.db import create_engine
from gpusched.infra.embedded import EmbeddedNats, EmbeddedPostgres, free_port
from gpusched.infra.migrations import migrate, migrations_dir
from gpusched.infra.settings import Settings
from gpusched.infra.supervisor import ProcessSpec, Supervisor

log = logging.getLogger(__name__)

# Start order matters little (every service waits on durable consumers), but the
# ledger owner first lets the others see the inventory event at once.
SERVICES: tuple[str, ...] = ("admission", "ingest", "preemption", "checkpoint", "billing", "agent")


def service_migrations(service: str) -> Path | None:
    module = importlib.import_module(f"gpusched.{service}.app")
    assert module.__file__ is not None
    path = migrations_dir(module.__file__)
    return path if path.is_dir() else None


async def prepare(settings: Settings, services: Sequence[str] = SERVICES) -> None:
    """Create the streams and run every service's migrations (idempotent)."""
    nats_url, db_url = settings.require_urls()
    nc = await bus.connect(nats_url, "gpusched-prepare")
    try:
        await bus.ensure_streams(
            nc.jetstream(),
            Subjects(settings.subject_prefix).streams(),
            replicas=settings.bus.stream_replicas,
        )
    finally:
        await nc.close()
    engine = create_engine(db_url, pool_size=1)
    try:
        for service in services:
            path = service_migrations(service)
            if path is not None:
                await migrate(engine, service, path)
    finally:
        await engine.dispose()


@dataclass
class Stack:
    """Servers (unless external) plus one process per service."""

    settings: Settings
    services: Sequence[str] = SERVICES
    env: Mapping[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    output: TextIO | None = None
    metrics_ports: dict[str, int] = field(default_factory=dict, init=False)
    supervisor: Supervisor | None = field(default=None, init=False)
    _servers: list[EmbeddedNats | EmbeddedPostgres] = field(default_factory=list, init=False)

    def start(self) -> Settings:
        """Start everything; returns the settings with the resolved server URLs."""
        data_dir = self.settings.data_dir.resolve()
        nats_url, db_url = self.settings.nats_url, self.settings.database_url
        try:
            if not nats_url:
                nats = EmbeddedNats(data_dir / "nats")
                nats_url = nats.start()
                self._servers.append(nats)
                log.info("embedded NATS at %s", nats_url)
            if not db_url:
                pg = EmbeddedPostgres(data_dir / "postgres")
                pg.start()
                self._servers.append(pg)
                db_url = pg.create_database("gpusched")
                log.info("embedded PostgreSQL at %s", db_url)
            self.settings = self.settings.model_copy(
                update={"nats_url": nats_url, "database_url": db_url}
            )
            asyncio.run(prepare(self.settings, self.services))
            self.supervisor = Supervisor(
                [self._spec(name) for name in self.services],
                env=self._child_env(),
                log_dir=self.log_dir,
                output=self.output,
            )
            self.supervisor.start()
        except BaseException:
            self.stop()
            raise
        return self.settings

    def _spec(self, service: str) -> ProcessSpec:
        return ProcessSpec(service, [sys.executable, "-m", "gpusched.cli.main", "service", service])

    def _child_env(self) -> dict[str, str]:
        assert self.settings.nats_url and self.settings.database_url
        env = {
            "GPUSCHED_NATS_URL": self.settings.nats_url,
            "GPUSCHED_DATABASE_URL": self.settings.database_url,
            "GPUSCHED_SUBJECT_PREFIX": self.settings.subject_prefix,
            "GPUSCHED_DATA_DIR": str(self.settings.data_dir.resolve()),
            # The simulated cluster's checkpoints live with the rest of this stack's data.
            "GPUSCHED_AGENT__WORKDIR": str(self.settings.data_dir.resolve() / "agent"),
            **self.env,
        }
        if self.settings.trace_file is not None:
            env["GPUSCHED_TRACE_FILE"] = str(self.settings.trace_file.resolve())
        return env

    def metrics_env(self, service: str) -> dict[str, str]:
        port = self.metrics_ports.setdefault(service, free_port())
        return {"GPUSCHED_METRICS_PORT": str(port)}

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        for server in reversed(self._servers):
            server.stop()
        self._servers.clear()

    def __enter__(self) -> Stack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
