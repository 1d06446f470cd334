"""The agent's view of the ledger, rebuilt from admission's events at every start.

The agent keeps nothing durable, so instead of a durable consumer (which would resume
after the last acknowledged event and leave a restarted agent without its inventory)
it reads admission's event history from the beginning with an ordered consumer, then
follows it live. Applying an event only updates the in-memory projection.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import Error as JetStreamError

from gpusched.contracts.envelope import Envelope
from gpusched.contracts.errors import MalformedMessage
from gpusched.contracts.subjects import Subjects

log = logging.getLogger(__name__)

EventSink = Callable[[Envelope], Awaitable[None]]


async def follow_admission(
    js: JetStreamContext, subjects: Subjects, sink: EventSink
) -> JetStreamContext.PushSubscription:
    async def on_message(msg: Msg) -> None:
        try:
            await sink(Envelope.from_bytes(msg.data))
        except MalformedMessage as exc:
            # The durable consumers of these events dead-letter it once; this replay
            # must not dead-letter it again at every agent start.
            log.warning("skipping a malformed admission event on %s: %s", msg.subject, exc)

    return await js.subscribe(
        subjects.events_of("admission"),
        # Named, so no stream look-up by subject (which the agent may not do).
        stream=subjects.stream("EVENTS"),
        cb=on_message,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )


_INFO_TIMEOUT_S = 2.0


async def caught_up(sub: JetStreamContext.PushSubscription) -> bool:
    """True once every admission event stored so far has been applied (False while the
    server cannot say, e.g. during an outage)."""
    try:
        info = await asyncio.wait_for(sub.consumer_info(), _INFO_TIMEOUT_S)
    except (NatsError, JetStreamError, TimeoutError, OSError):
        return False
    return info.num_pending == 0 and sub.pending_msgs == 0
