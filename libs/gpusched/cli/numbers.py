"""Numbers on the command line: finite, within bounds, refused in words a person reads.

Typer's own `min`/`max` check lets NaN through to its range message ("should be less
than or equal to 1000000" for `nan`) and takes `inf` where only a lower bound is set;
`number(low, high)` is the parser every float option uses instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import typer

__all__ = ["number", "number_option"]


def number(low: float | None = None, high: float | None = None) -> Callable[[str], float]:
    """A parser of a finite number within [low, high]; BadParameter names what is wrong."""

    def parse(text: str | float) -> float:
        try:
            value = float(text)
        except ValueError:
            raise typer.BadParameter(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise typer.BadParameter(f"{text} is not a finite number")
        if low is not None and value < low:
            raise typer.BadParameter(f"{text} is below the least allowed, {low:g}")
        if high is not None and value > high:
            raise typer.BadParameter(f"{text} is above the most allowed, {high:g}")
        return value

    return parse


def number_option(low: float | None, high: float | None, help: str) -> Any:
    """A typer option parsed by ``number(low, high)``."""
    return typer.Option(parser=number(low, high), help=help)
