"""How a handler failure is treated at the edge (STYLE 5): the exception type decides.

- MalformedMessage (contracts.errors): dead-letter at once, never retried.
- Rejected: the message is well-formed but can never be applied (e.g. refers to
  something that does not exist): dead-letter at once, with the reason.
- anything else is presumed transient (database restarting, timeout): redelivered
  with a delay, and dead-lettered after `bus.max_deliver` attempts.
"""

from gpusched.contracts.errors import MalformedMessage


class Rejected(Exception):
    """A well-formed message that can never be applied."""


__all__ = ["MalformedMessage", "Rejected"]
