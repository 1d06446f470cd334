"""bus.PullFeed, the telemetry fold's read path, against the real NATS server: every
stored message once and in order, batches as they come, and a clear error when the
consumer it reads is deleted."""

from __future__ import annotations

import asyncio
import uuid

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from tests.support.identity import harness_options

from gpusched.contracts.subjects import Subjects
from gpusched.infra.bus import ConsumerGone, PullFeed
from gpusched.infra.settings import Settings


async def _collect(feed: PullFeed, count: int) -> list[bytes]:
    got: list[bytes] = []
    while len(got) < count:
        got.extend(msg.data for msg in await feed.next_batch(5.0))
    return got


async def test_a_pull_feed_hands_over_every_stored_message_once_in_order_in_bounded_batches(
    settings: Settings,
) -> None:
    nc = await nats.connect(str(settings.nats_url), **harness_options(settings))
    js = nc.jetstream()
    s = Subjects(settings.subject_prefix)
    stream = s.stream("TELEMETRY")
    subject = f"{s.gpu_telemetry_partition(3)[:-1]}node-{uuid.uuid4().hex[:6]}"
    name = f"feed-{uuid.uuid4().hex[:8]}"
    try:
        for i in range(250):
            await js.publish(subject, str(i).encode())
        await js.add_consumer(
            stream,
            ConsumerConfig(
                name=name,
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
                filter_subject=subject,
                inactive_threshold=30,
            ),
        )
        feed = PullFeed(nc, stream, name, batch=40)
        await feed.start()
        sizes: list[int] = []
        got: list[bytes] = []
        while len(got) < 250:
            batch = await feed.next_batch(5.0)
            sizes.append(len(batch))
            got.extend(msg.data for msg in batch)
        assert got == [str(i).encode() for i in range(250)]
        # Never more than the two requests it keeps outstanding.
        assert max(sizes) <= 80
        # Messages stored later arrive through the requests still open.
        await js.publish(subject, b"late")
        assert await _collect(feed, 1) == [b"late"]
        with pytest.raises(TimeoutError):
            await feed.next_batch(0.3)

        await js.delete_consumer(stream, name)
        with pytest.raises(ConsumerGone):
            await asyncio.wait_for(_collect(feed, 1), 15)
        await feed.close()
    finally:
        await nc.close()
