"""Byte counts as people write them: ``--max-shard-size 5GB`` and ``--memory-budget 64GiB`` read,
every size zckpt prints (summaries, reports, the free-space refusal) written, in the same units.
A leaf module: the I/O layer's messages and the operations' reports share it."""

from __future__ import annotations

import re

from .errors import UsageError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """Bytes in a size such as ``"5GB"`` (10^9, as Hugging Face counts), ``"500MiB"`` or ``1000``.

    >>> parse_size("5GB"), parse_size("1.5MB"), parse_size("2KiB"), parse_size("77")
    (5000000000, 1500000, 2048, 77)
    """
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
        if not match or match[2].upper() not in _UNITS:
            raise UsageError(None, f"cannot read size {text!r}: use digits and a unit such as 5GB, 500MB or 2GiB")
        size = int(float(match[1]) * _UNITS[match[2].upper()])
    if size <= 0:
        raise UsageError(None, f"size {text!r} must be positive")
    return size


def format_size(nbytes: int) -> str:
    """A byte count for people, in the units parse_size reads.

    >>> format_size(17_600), format_size(1_610_000_000), format_size(12)
    ('17.6 KB', '1.61 GB', '12 B')
    """
    for unit in ("TB", "GB", "MB", "KB"):
        if nbytes >= _UNITS[unit]:
            return f"{nbytes / _UNITS[unit]:.3g} {unit}"
    return f"{nbytes} B"
