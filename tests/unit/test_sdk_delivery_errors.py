"""Which publish failures hold the SDK's event buffer back (the link) and which give up
one event (the event itself)."""

from __future__ import annotations

import pytest
from nats.errors import (
    ConnectionClosedError,
    ConnectionDrainingError,
    MaxPayloadError,
    NoRespondersError,
)
from nats.errors import (
    TimeoutError as NatsTimeout,
)
from nats.js.errors import NoStreamResponseError

from gpusched.sdk.delivery import _link_failed


def _no_stream_response() -> NoStreamResponseError:
    """As nats-py raises it: JetStream had no responder (not ready, no stream leader)."""
    try:
        try:
            raise NoRespondersError
        except NoRespondersError:
            raise NoStreamResponseError  # noqa: B904 - nats-py chains it this way
    except NoStreamResponseError as exc:
        return exc


@pytest.mark.parametrize(
    "exc",
    [
        ConnectionClosedError(),
        ConnectionDrainingError(),
        NatsTimeout(),
        TimeoutError(),
        ConnectionRefusedError(),
        _no_stream_response(),
    ],
    ids=type,
)
def test_an_outage_or_a_connection_in_transition_holds_the_events_back(exc: Exception) -> None:
    assert _link_failed(exc)


@pytest.mark.parametrize("exc", [MaxPayloadError(), ValueError("bad header")], ids=type)
def test_a_failure_of_the_event_itself_gives_that_event_up(exc: Exception) -> None:
    assert not _link_failed(exc)
