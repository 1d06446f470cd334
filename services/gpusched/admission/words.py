"""Many things named in one line: the lists in admission's replies and audit reasons.

A request may name up to 32 GPU models of 200 characters each, and a scale-down may
release hundreds of replicas: a reason that listed them all would be pages long (and
longer than an audit record holds). A reason names the first few and counts the rest;
the whole list, where it matters, goes in the record's details.
"""

from __future__ import annotations

from collections.abc import Sequence

# How many items a reason names before it counts the rest: few of what a user sent
# (each up to 200 characters), more of what the operator configured (the known GPU
# models, the teams), which a user reads to correct a request.
NAMED = 3
NAMED_KNOWN = 20


def some_of(items: Sequence[str], separator: str = ", ", most: int = NAMED) -> str:
    """``items`` joined; past ``most`` of them, the first ``most`` and how many more."""
    if len(items) <= most:
        return separator.join(items)
    return f"{separator.join(items[:most])} and {len(items) - most} more"


def models_words(models: Sequence[str]) -> str:
    """The GPU models a job accepts: ``A|B``, ``any model``, or for many of them
    ``any of 31 models (A, B, C and 28 more)``."""
    if not models:
        return "any model"
    if len(models) <= NAMED:
        return "|".join(models)
    return f"any of {len(models)} models ({some_of(models)})"
