"""Errors that describe what is wrong with a message, independent of any broker."""


class ContractError(Exception):
    """Base of the wire-contract errors."""


class MalformedMessage(ContractError):
    """The bytes are not a valid envelope, or the payload does not match its schema.

    Such a message can never succeed: it is dead-lettered at once, not retried.
    """
