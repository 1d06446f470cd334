"""What the ledger refuses: every command that raises one of these leaves it unchanged."""

from __future__ import annotations

__all__ = [
    "AllocationExists",
    "GpuNotEligible",
    "GpuNotFree",
    "GpuNotReserved",
    "InvalidRequest",
    "LayoutChangeRefused",
    "LedgerError",
    "NodeBusy",
    "UnknownAllocation",
    "UnknownGpu",
    "UnknownNode",
    "UnknownReservation",
]


class LedgerError(Exception):
    """A command the ledger refuses; the state is left unchanged."""


class InvalidRequest(LedgerError, ValueError):
    pass


class _Unknown(LedgerError, KeyError):
    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class UnknownAllocation(_Unknown):
    pass


class UnknownGpu(_Unknown):
    pass


class UnknownReservation(_Unknown):
    pass


class UnknownNode(_Unknown):
    pass


class AllocationExists(LedgerError):
    pass


class GpuNotFree(LedgerError):
    pass


class GpuNotEligible(LedgerError):
    """The GPU exists and may be free, but its pool or model does not fit the command."""


class GpuNotReserved(LedgerError):
    pass


class LayoutChangeRefused(LedgerError):
    """A MIG layout change within the interval since the GPU's last change."""


class NodeBusy(LedgerError):
    """The node still holds allocations or lent GPUs, so it cannot be removed."""
