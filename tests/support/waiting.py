"""Waiting for asynchronous outcomes in tests, without sleeps that guess."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

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
