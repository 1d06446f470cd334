"""testcontainers option for machines with a Docker engine (GPUSCHED_TEST_CONTAINERS=1)."""

from __future__ import annotations


def start_containers(nats_url: str | None, db_url: str | None) -> tuple[str, str, list[object]]:
    from testcontainers.core.container import DockerContainer
    from testcontainers.core.waiting_utils import wait_for_logs
    from testcontainers.postgres import PostgresContainer

    started: list[object] = []
    if not db_url:
        pg = PostgresContainer("postgres:16", driver="asyncpg")
        pg.start()
        started.append(pg)
        db_url = pg.get_connection_url()
    if not nats_url:
        nats = DockerContainer("nats:2.10").with_command("-js").with_exposed_ports(4222)
        nats.start()
        wait_for_logs(nats, "Server is ready")
        started.append(nats)
        nats_url = f"nats://{nats.get_container_host_ip()}:{nats.get_exposed_port(4222)}"
    return nats_url, db_url, started
