"""Prometheus metrics shared by every service, and the /metrics endpoint."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

MESSAGES = Counter(
    "gpusched_messages_total",
    "Messages taken from the bus, by consumer, type and outcome",
    ["service", "consumer", "type", "outcome"],
)
HANDLER_SECONDS = Histogram(
    "gpusched_handler_seconds",
    "Time to apply one message (transaction included)",
    ["service", "consumer"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
DEAD_LETTERS = Counter(
    "gpusched_dead_letters_total", "Messages sent to the dead-letter subject", ["service", "reason"]
)
OUTBOX_PUBLISHED = Counter(
    "gpusched_outbox_published_total", "Outbox rows published to JetStream", ["service"]
)
OUTBOX_LAG = Histogram(
    "gpusched_outbox_lag_seconds",
    "Commit-to-publish latency of outbox rows",
    ["service"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
)
OUTBOX_OLDEST_UNPUBLISHED = Gauge(
    "gpusched_outbox_oldest_unpublished_seconds",
    "Age of the oldest outbox row not yet published (0 when the outbox is empty)",
    ["service"],
)
OUTBOX_UNPUBLISHED = Gauge(
    "gpusched_outbox_unpublished_rows", "Outbox rows not yet published", ["service"]
)
OUTAGES = Counter(
    "gpusched_outages_total",
    "Times a component found PostgreSQL or NATS unreachable and began waiting it out",
    ["service", "component"],
)
OUTAGE_ACTIVE = Gauge(
    "gpusched_outage_active",
    "1 while a component waits out an outage of PostgreSQL or NATS",
    ["service", "component"],
)
API_REQUESTS = Counter(
    "gpusched_api_requests_total",
    "Request/reply calls, by subject and outcome",
    ["service", "subject", "outcome"],
)
UP = Gauge("gpusched_up", "1 while the service is running", ["service"])
ACCESS_REFUSED = Counter(
    "gpusched_access_refused_total",
    "API requests refused as forbidden for the caller's identity, by action",
    ["service", "action"],
)


def serve(host: str, port: int) -> None:
    """Start the /metrics endpoint (a daemon thread); port 0 means no endpoint."""
    if port:
        start_http_server(port, addr=host)
