"""Errors that describe what is wrong with a message, independent of any broker, and the
error codes every service's replies share."""

from typing import Final

# A well-formed request its caller may not make (a capability the operator has not
# given, a role it lacks): refused, stored nowhere, audited.
FORBIDDEN: Final = "forbidden"


class ContractError(Exception):
    """Base of the wire-contract errors."""


class MalformedMessage(ContractError):
    """The bytes are not a valid envelope, or the payload does not match its schema.

    Such a message can never succeed: it is dead-lettered at once, not retried.
    """
