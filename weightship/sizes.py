"""Byte sizes for people (``500M``, ``64MiB``, ``1.5G``): the one parser and the one formatter, binary units.

Every size a user writes (the CLI's ``--chunk-size``, the agent's ``--quota``, the benchmarks'
``--size``) goes through ``parse_size``, so ``500M`` means the same 500 MiB everywhere. Units
are binary whatever their spelling: ``K``, ``KB`` and ``KiB`` all mean 1024 bytes, because the
sizes here are chunk sizes and disk quotas that line up with powers of two, and one meaning
beats a 7 % surprise between two programs. Every size shown to people (the CLI's tables, the
agent's disk-full message) goes through ``format_size``.
"""

from __future__ import annotations

import re

from weightship.errors import ValidationError

__all__ = ["format_size", "parse_size"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(?:i?B)?|B)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}


def parse_size(text: str | int) -> int:
    """Bytes from ``"20GiB"``, ``"500M"`` (= 500 MiB), ``"1.5K"``, ``"1048576"`` or an ``int``.

    Raises ``ValidationError`` for anything else, including negative or fractional byte counts.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValidationError(f"size {text} is negative; give a number of bytes such as 500MiB")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValidationError(
            f"size {text!r} is not a number of bytes with an optional binary unit; "
            "write it like 65536, 64K, 500MiB or 20G (500M = 500MiB)"
        )
    number, unit = match.group(1), (match.group(2) or "").upper()
    scale: int = 1 << (10 * _POWERS[unit])
    if "." not in number:
        return int(number) * scale
    whole, fraction = number.split(".")
    numerator = int(whole + fraction) * scale
    denominator = int("1" + "0" * len(fraction))
    if numerator % denominator:
        raise ValidationError(f"size {text!r} is not a whole number of bytes; write it in a smaller unit")
    return numerator // denominator


def format_size(n: int | float) -> str:
    """``n`` bytes as a short binary size: ``1536`` -> ``1.5 KiB``, ``12`` -> ``12 B``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
