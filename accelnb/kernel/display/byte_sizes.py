"""Byte counts as people write and read them: ``80.3 KB``, ``--return-limit 1GB``.

Decimal units (1 KB = 1,000 bytes), as Jupyter states its own limits; ``KiB``/``MiB``/``GiB`` are
accepted when parsing, for people who think in powers of two. GPU memory alone is in GiB
(:func:`gpu_memory`), as nvidia-smi and the cards' names count it.

    >>> human_bytes(80_300), human_bytes(5_200_000)
    ('80.3 KB', '5.2 MB')
    >>> gpu_memory(3 * 2**30, 80 * 2**30)
    '3.0 / 80.0 GiB'
    >>> describe_limit(256 * 2**20), describe_limit(10**9)
    ('256 MiB', '1.0 GB')
    >>> parse_byte_size("256MB"), parse_byte_size("1.5 GiB")
    (256000000, 1610612736)
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "K": 10**3, "M": 10**6, "G": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def human_bytes(count: int) -> str:
    """512 bytes, 80.3 KB, 5.2 MB, 1.1 GB."""
    if count < 1000:
        return f"{count:,} byte{'s' if count != 1 else ''}"
    for unit, scale in (("KB", 1e3), ("MB", 1e6)):
        if count < scale * 1000:
            return f"{count / scale:.1f} {unit}"
    return f"{count / 1e9:.1f} GB"


def gpu_memory(used: int, total: int) -> str:
    """A GPU's memory in use, of its total, in GiB: ``3.0 / 80.0 GiB``. GPU memory is counted in
    powers of two wherever people read it (nvidia-smi's MiB, an "80GB" card's 80 GiB), so every
    view of it says GiB: the panels, the per-rank view and its one-line summary alike."""
    return f"{used / 2**30:.1f} / {total / 2**30:.1f} GiB"


def describe_limit(limit: int) -> str:
    """A limit as it was most likely written: ``256 MiB`` for whole mebibytes, else decimal."""
    if limit >= 2**20 and limit % 2**20 == 0:
        return f"{limit // 2**20:,} MiB"
    return human_bytes(limit)


def parse_byte_size(text: str) -> int:
    """``"256MB"``, ``"1 GB"``, ``"512MiB"``, ``"1000"`` (bytes) → bytes; ValueError otherwise."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a size; write it like 256MB, 1GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])
