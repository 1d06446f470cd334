"""Waiting for asynchronous outcomes in tests, without sleeps that guess."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

V = TypeVar("V")


async def eventually(check: Callable[[], Awaitable[V]], within: float = 10.0) -> V:
    """Poll `check` until it returns something truthy; fail with its last value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while True:
        value = await check()
        if value:
            return value
        if loop.time() > deadline:
            raise AssertionError(f"condition not met in {within}s (last: {value!r})")
        await asyncio.sleep(0.05)


async def stream_messages(
    js: JetStreamContext, subject: str, expect: int, within: float = 10.0
) -> list[Msg]:
    """The first `expect` messages stored on `subject` (from the start of its stream)."""
    sub = await js.subscribe(
        subject, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL), manual_ack=False
    )
    got: list[Msg] = []
    try:
        while len(got) < expect:
            got.append(await sub.next_msg(timeout=within))
    finally:
        await sub.unsubscribe()
    return got


async def stream_messages_after(
    js: JetStreamContext, subject: str, after_seq: int = 0, batch: int = 256
) -> list[Msg]:
    """Every message stored on `subject` with a stream sequence above `after_seq`.

    An ephemeral pull consumer knows how many messages are pending when it is created,
    so the read ends when that many have arrived: no per-message timeout to guess, and
    a long stream is read only from the caller's mark on.
    """
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after_seq + 1,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=5.0,  # the server drops the consumer soon after the read
    )
    sub = await js.pull_subscribe(subject, config=config)
    got: list[Msg] = []
    try:
        pending = (await sub.consumer_info()).num_pending
        while len(got) < pending:
            got += await sub.fetch(min(batch, pending - len(got)), timeout=10.0)
    finally:
        await sub.unsubscribe()
    return got
