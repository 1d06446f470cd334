"""Every placed job gets NATS credentials for its own subjects, and only while it runs.

The job issuer is a scoped signing key of the service account (infra.natsauth): the
server lets its users publish only `<p>.jobs.<id>.events` and read only
`<p>.jobs.<id>.control`, whatever admission asks for. A credential lives
`security.job_credential_ttl_s`; admission renews it for every live allocation at a
third of that, so once the allocation ends no renewal follows and the server refuses
the credential (and drops its connection) within one lifetime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from gpusched.contracts.envelope import utcnow
from gpusched.contracts.messages import RenewCredentials, T
from gpusched.contracts.subjects import Subjects
from gpusched.infra.db import Outgoing, UnitOfWorkFactory
from gpusched.infra.natsauth import Identity, Issuer, job_user_name
from gpusched.infra.settings import Settings

from .queue import Clock

if TYPE_CHECKING:
    from .keeper import LedgerKeeper

log = logging.getLogger(__name__)

__all__ = ["Issued", "JobCredentials"]


@dataclass(frozen=True)
class Issued:
    creds: str
    expire_at: datetime


class JobCredentials:
    def __init__(
        self, issuer: Issuer | None, prefix: str, ttl_s: float, clock: Clock = utcnow
    ) -> None:
        self._clock = clock
        self._issuer = issuer
        self._prefix = prefix
        self._ttl_s = ttl_s

    @classmethod
    def from_settings(cls, settings: Settings, clock: Clock = utcnow) -> JobCredentials:
        key = settings.security.job_signing_key
        issuer = None if key is None else Issuer.from_seed_file(key, scoped=True)
        return cls(issuer, settings.subject_prefix, settings.security.job_credential_ttl_s, clock)

    @property
    def enabled(self) -> bool:
        return self._issuer is not None

    @property
    def renew_every_s(self) -> float:
        return self._ttl_s / 3

    def issue(self, job_id: str, now: datetime | None = None) -> Issued | None:
        if self._issuer is None:
            return None
        at = now or self._clock()
        identity = Identity(job_user_name(self._prefix, job_id), ttl_s=self._ttl_s)
        creds = self._issuer.creds(identity, now=at.timestamp())
        return Issued(creds, at + timedelta(seconds=self._ttl_s))

    async def renew(self, uow: UnitOfWorkFactory, keeper: LedgerKeeper) -> None:
        """One round: fresh credentials for every live allocation, in one commit."""
        if self._issuer is None:
            return
        now = self._clock()
        subject = Subjects(self._prefix).command("agent", T.RENEW_CREDENTIALS)
        async with uow() as unit:
            ledger = await keeper.read(unit)
            events: list[Outgoing] = []
            for allocation in ledger.allocations.values():
                issued = self.issue(allocation.job_id, now)
                assert issued is not None
                renewal = RenewCredentials(
                    allocation_id=allocation.allocation_id,
                    job_id=allocation.job_id,
                    credentials=issued.creds,
                    expire_at=issued.expire_at,
                )
                events.append(
                    Outgoing(
                        subject, T.RENEW_CREDENTIALS, renewal, correlation_id=allocation.job_id
                    )
                )
            if events:
                await unit.emit_many(events)
                await unit.commit()
