"""Kubernetes resource quantities ("64", "63500m", "1056Gi", "2e3") as numbers."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIX = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal(10**3),
    "M": Decimal(10**6),
    "G": Decimal(10**9),
    "T": Decimal(10**12),
    "P": Decimal(10**15),
    "E": Decimal(10**18),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+)((?:[eE][+-]?[0-9]+)|[KMGTPE]i|[numkMGTPE]|)$")


class QuantityError(ValueError):
    pass


def parse_quantity(text: object) -> Decimal:
    """The value of a quantity; QuantityError if it is not one."""
    if isinstance(text, int) and not isinstance(text, bool):
        return Decimal(text)
    if not isinstance(text, str):
        raise QuantityError(f"{text!r} is not a quantity")
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        raise QuantityError(f"{text!r} is not a quantity")
    number, suffix = match.groups()
    try:
        value = Decimal(number)
        if suffix[:1] in ("e", "E"):
            return value * Decimal(10) ** int(suffix[1:])
        if suffix not in _SUFFIX:
            raise QuantityError(f"{text!r}: unknown suffix {suffix!r}")
        return value * _SUFFIX[suffix]
    except InvalidOperation:
        raise QuantityError(f"{text!r} is not a quantity") from None


def milli(text: object) -> int:
    """CPU in millicores."""
    return int(parse_quantity(text) * 1000)


def mebibytes(text: object) -> int:
    return int(parse_quantity(text) / (2**20))


def count(text: object) -> int:
    """A whole count (an extended resource such as nvidia.com/gpu)."""
    value = parse_quantity(text)
    if value != value.to_integral_value() or value < 0:
        raise QuantityError(f"{text!r} is not a whole, non-negative count")
    return int(value)
