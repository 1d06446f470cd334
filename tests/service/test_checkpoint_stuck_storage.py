"""Checkpoint verification against storage that stops answering (a hung NFS or Lustre
mount, an S3 call that never returns): the read is abandoned at the claim's budget and
the claim refused as incomplete, and nothing else waits for it: not the next claim,
not a database connection, not the event loop's default threads.

The stuck storage is a fsspec filesystem registered for a test scheme, whose objects
live in memory and whose info, open or read blocks until the test releases it.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import fsspec
import pytest
from fsspec.spec import AbstractFileSystem
from prometheus_client import REGISTRY
from tests.service.test_checkpoint_service import (
    Victim,
    checkpoint_requested,
    confirm,
    evict_commands,
    request_eviction,
    running,
    stored,
    victim,
    wait_for,
    wait_for_audit,
    with_checkpoint,
)
from tests.support.waiting import eventually

from gpusched.checkpoint.storage import DEFAULT_GRACE_S, Budget, FsspecStorage
from gpusched.checkpoint.verification import ClaimCheck
from gpusched.contracts.manifest import MANIFEST_NAME
from gpusched.contracts.messages import CheckpointKind
from gpusched.domain.saga import CheckpointRef, Stage
from gpusched.infra.runtime import ServiceRuntime
from gpusched.infra.settings import Settings

SCHEME = "stuck-test"
HUNG = "hung/"  # objects under this prefix stall; the others answer at once
# A stalled call gives up on its own after this long, should a test fail to release it.
STALL_LIMIT_S = 120.0


@dataclass
class Stall:
    """Where the stuck store's I/O blocks, and the switch that releases it."""

    where: str = "read"  # "info", "open" or "read"
    released: threading.Event = field(default_factory=threading.Event)
    blocked: int = 0  # calls blocked right now
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def at(self, where: str, path: str) -> None:
        if where != self.where or not path.startswith(HUNG) or self.released.is_set():
            return
        with self._lock:
            self.blocked += 1
        try:
            self.released.wait(STALL_LIMIT_S)
        finally:
            with self._lock:
                self.blocked -= 1


class _StallingFile(io.BytesIO):
    def __init__(self, data: bytes, before_read: Callable[[], None]) -> None:
        super().__init__(data)
        self._before_read = before_read

    def read(self, size: int | None = -1) -> bytes:
        self._before_read()
        return super().read(size)


class StuckStore(AbstractFileSystem):  # type: ignore[misc]
    protocol = SCHEME
    cachable = False
    objects: ClassVar[dict[str, bytes]] = {}
    stall: ClassVar[Stall] = Stall()

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        path = self._strip_protocol(path)
        self.stall.at("info", path)
        if path not in self.objects:
            raise FileNotFoundError(path)
        return {"name": path, "size": len(self.objects[path]), "type": "file"}

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> _StallingFile:
        path = self._strip_protocol(path)
        self.stall.at("open", path)
        return _StallingFile(self.objects[path], lambda: self.stall.at("read", path))


@pytest.fixture
def stall() -> Iterator[Stall]:
    stalled = Stall()
    StuckStore.objects = {}
    StuckStore.stall = stalled
    fsspec.register_implementation(SCHEME, StuckStore, clobber=True)
    try:
        yield stalled
    finally:
        # Every blocked thread returns before the next test.
        stalled.released.set()
        deadline = time.monotonic() + 10
        while stalled.blocked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert stalled.blocked == 0


def stored_claim(path: str, data: bytes, checkpoint_id: str = "c-1") -> CheckpointRef:
    StuckStore.objects[path] = data
    return CheckpointRef(checkpoint_id, 1, f"{SCHEME}://{path}", len(data),
                         hashlib.sha256(data).hexdigest(), Stage.PERSISTED)  # fmt: skip


def local_claim(tmp_path: Path) -> CheckpointRef:
    data = b"an ordinary checkpoint"
    path = tmp_path / "ordinary.pt"
    path.write_bytes(data)
    return CheckpointRef("c-2", 2, path.as_uri(), len(data), hashlib.sha256(data).hexdigest(),
                         Stage.PERSISTED)  # fmt: skip


def gauge(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


STUCK = "gpusched_checkpoint_verify_threads_stuck"
REFUSED = "gpusched_checkpoint_verify_refused_total"


@pytest.mark.parametrize(
    ("where", "kind", "name"),
    [
        ("info", CheckpointKind.FILE, "ckpt.pt"),
        ("open", CheckpointKind.FILE, "ckpt.pt"),
        ("read", CheckpointKind.FILE, "ckpt.pt"),
        ("read", CheckpointKind.MANIFEST, MANIFEST_NAME),
    ],
)
async def test_storage_that_never_answers_is_given_up_at_the_budget_and_the_next_claim_verified(
    stall: Stall, tmp_path: Path, where: str, kind: CheckpointKind, name: str
) -> None:
    stall.where = where
    storage = FsspecStorage([SCHEME, "file"], budget=Budget(1.0, 0.0))
    started = time.monotonic()
    verdict = await asyncio.wait_for(
        storage.verify(stored_claim(f"{HUNG}{name}", b"x" * 100), kind), timeout=10
    )
    assert time.monotonic() - started < 1.0 + DEFAULT_GRACE_S + 1.0
    assert verdict is not None and verdict.check is ClaimCheck.INCOMPLETE
    assert "not verified within the budget of 1s" in verdict.why
    assert stall.blocked == 1  # abandoned, not waited for

    # The storage still works for everything else while that thread is stuck.
    answering = stored_claim("ok/ckpt.pt", b"y" * 100, "c-3")
    verified = await asyncio.wait_for(storage.verify(answering, CheckpointKind.FILE), 10)
    assert verified is not None and verified.check is ClaimCheck.VERIFIED
    local = await asyncio.wait_for(storage.verify(local_claim(tmp_path), CheckpointKind.FILE), 10)
    assert local is not None and local.check is ClaimCheck.VERIFIED
    assert stall.blocked == 1


async def test_when_every_verification_thread_is_stuck_new_claims_are_refused_at_once(
    stall: Stall, tmp_path: Path
) -> None:
    storage = FsspecStorage([SCHEME, "file"], budget=Budget(1.0, 0.0), threads=2, grace_s=0.5)
    stuck_before, refused_before = gauge(STUCK), gauge(REFUSED)
    hung = [stored_claim(f"{HUNG}ckpt-{i}.pt", b"x" * 100) for i in range(2)]
    first = await asyncio.wait_for(
        asyncio.gather(*(storage.verify(c, CheckpointKind.FILE) for c in hung)), timeout=10
    )
    assert [v.check if v else None for v in first] == [ClaimCheck.INCOMPLETE] * 2
    assert gauge(STUCK) == stuck_before + 2

    # Both threads are held by reads that do not return: an ordinary claim is refused
    # at once, rather than queued behind them.
    started = time.monotonic()
    refused = await asyncio.wait_for(
        storage.verify(local_claim(tmp_path), CheckpointKind.FILE), timeout=10
    )
    assert time.monotonic() - started < 0.5
    assert refused is not None and refused.check is ClaimCheck.INCOMPLETE
    assert "all 2 verification threads are stuck in storage I/O" in refused.why
    assert gauge(REFUSED) == refused_before + 1
    # The event loop's default threads (host name lookups, /metrics) were never used.
    assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), timeout=2) == "free"

    stall.released.set()

    async def recovered() -> bool:
        return gauge(STUCK) == stuck_before

    await eventually(recovered, within=10)
    verdict = await asyncio.wait_for(
        storage.verify(local_claim(tmp_path), CheckpointKind.FILE), timeout=10
    )
    assert verdict is not None and verdict.check is ClaimCheck.VERIFIED


# --- the service ---------------------------------------------------------------------------


def stuck_storage_settings(settings: Settings, budget_s: float, **bus: Any) -> Settings:
    checkpoint = with_checkpoint(
        settings,
        grace_s=120.0,
        sweep_interval_s=0.1,
        verify_schemes=["file", SCHEME],
        verify_budget_s=budget_s,
        verify_budget_s_per_gb=0.0,
    )
    return checkpoint.model_copy(update={"bus": checkpoint.bus.model_copy(update=bus)})


async def lingering_transactions(rt: ServiceRuntime) -> int:
    """Connections of the service's database idle inside a transaction for over 0.5 s
    (a statement's transaction is idle only between its statements, for milliseconds)."""
    async with rt.uow() as uow:
        result = await uow.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND pid <> pg_backend_pid() AND state LIKE 'idle in transaction%' "
            "AND now() - state_change > interval '0.5 seconds'"
        )
        return int(result.scalar_one())


async def hung_confirmation(rt: ServiceRuntime, v: Victim, request_id: str | None) -> None:
    """The job claims a checkpoint on the stuck store, whose read will hang."""
    ref = stored_claim(f"{HUNG}{v.job_id}/ckpt-7.pt", b"z" * 64, "ckpt-7")
    claim = {"uri": ref.uri, "bytes": ref.bytes, "sha256": ref.sha256}
    await confirm(rt, v, 7, request_id=request_id, claim=claim)


async def test_a_claim_on_storage_that_hangs_is_refused_in_time_and_frees_its_transaction(
    settings: Settings, stall: Stall
) -> None:
    budget_s = 3.0
    async with running(stuck_storage_settings(settings, budget_s)) as rt:
        v = victim()
        await request_eviction(rt, v)
        saga_id = (await checkpoint_requested(rt, v)).correlation_id
        assert saga_id is not None

        started = time.monotonic()
        await hung_confirmation(rt, v, v.request_id)

        async def reading() -> bool:
            return stall.blocked == 1

        await eventually(reading, within=10)

        record = await wait_for_audit(rt, saga_id, "checkpoint.unverified")
        assert time.monotonic() - started < budget_s + 1.0 + 4.0
        assert record["details"]["verification"] == "incomplete"
        assert f"not verified within the budget of {budget_s:.0f}s" in record["reason"]
        assert await stored(rt, evict_commands(rt)) == []
        # The claim's batch held its transaction for the budget, not for as long as the
        # read hangs: it ended with the refusal, while the read still hangs.
        assert stall.blocked == 1
        assert await lingering_transactions(rt) == 0

        # The next, ordinary claim is verified and evicts, while that read still hangs.
        await confirm(rt, v, 8, request_id=v.request_id)
        [evict] = await wait_for(rt, evict_commands(rt))
        assert evict.data["saga_id"] == saga_id
        assert stall.blocked == 1


async def test_with_every_verification_thread_stuck_a_claim_is_refused_until_storage_answers(
    settings: Settings, stall: Stall
) -> None:
    # One consumer lane reading one file at a time: a pool of one thread.
    one_thread = stuck_storage_settings(settings, 1.0, consumer_concurrency=1)
    one_thread = with_checkpoint(one_thread, verify_parallelism=1)
    stuck_before = gauge(STUCK)
    async with running(one_thread) as rt:
        stuck, v = victim(), victim()
        await hung_confirmation(rt, stuck, None)
        await wait_for_audit(rt, stuck.job_id, "checkpoint.unverified")

        await request_eviction(rt, v)
        saga_id = (await checkpoint_requested(rt, v)).correlation_id
        assert saga_id is not None
        await confirm(rt, v, 8, request_id=v.request_id)
        record = await wait_for_audit(rt, saga_id, "checkpoint.unverified")
        assert record["details"]["verification"] == "incomplete"
        assert "all 1 verification threads are stuck in storage I/O" in record["reason"]
        assert await stored(rt, evict_commands(rt)) == []

        stall.released.set()

        async def recovered() -> bool:
            return stall.blocked == 0 and gauge(STUCK) == stuck_before

        await eventually(recovered, within=10)
        await confirm(rt, v, 9, request_id=v.request_id)
        [evict] = await wait_for(rt, evict_commands(rt))
        assert evict.data["saga_id"] == saga_id
