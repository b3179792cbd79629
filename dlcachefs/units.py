"""Parsing and printing of human sizes ("16M", "200G", "1.5T")."""

from __future__ import annotations

import re

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Return bytes for ``text`` ("512", "16M", "16MiB", "1.5G"); binary units. Raises ValueError."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must not be negative: {text}")
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 16M, 200G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    """Short human form of a byte count: 1536 -> '1.5K'."""
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_size_exact(n: int) -> str:
    """The shortest exact form of a byte count, parsed back by :func:`parse_size`:
    ``16 << 20`` -> '16M', ``1536`` -> '1536' (never rounded, unlike :func:`format_size`)."""
    for unit in ("P", "T", "G", "M", "K"):
        if n and n % _UNITS[unit] == 0:
            return f"{n // _UNITS[unit]}{unit}"
    return str(n)
