"""Big buffers in anonymous shared memory: written once by the sender, mapped by every receiver.

A :func:`write_buffers` call copies buffers into one ``memfd_create`` file (no name in
``/dev/shm``, not limited by its size, gone with the last fd or mapping) and returns its fd; the
fd travels with ``SCM_RIGHTS`` (``wire/channel.py``). :func:`map_buffers` maps that file
**privately** (``MAP_PRIVATE``, ``mmap.ACCESS_COPY``): a receiver reads the sender's pages with
no copy, and the first write to a page gives that process its own copy of just that page. So a
rank that writes into its argument changes nothing for the other ranks or the kernel.

    >>> fd, layout = write_buffers([memoryview(b"abc"), memoryview(b"de")])
    >>> views = map_buffers(fd, layout); os.close(fd)
    >>> bytes(views[0]), bytes(views[1])
    (b'abc', b'de')

The mapping lives as long as a view of it does: a tensor or array rebuilt over a view
(``torch.frombuffer``, ``numpy.frombuffer``) holds the view, so the pages are unmapped when the
last object over them is freed, and the file is freed when its last mapping or fd goes.

Module-level state: ``_LIBC``, libc loaded once per process on first use (``mmap`` of a memfd).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Any

from accelnb.wire.held_interrupts import held_interrupts

ALIGNMENT = 64  # every buffer starts on a cache line: any dtype is aligned, SIMD loads are whole
WRITE_CHUNK_BYTES = 1 << 30  # pwrite may write less than asked for; never ask for more than this


def layout_of(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Where each buffer goes in the file: ``(offset, size)`` pairs, each offset aligned."""
    placed, offset = [], 0
    for size in sizes:
        placed.append((offset, size))
        offset += -(-size // ALIGNMENT) * ALIGNMENT
    return placed


def write_buffers(buffers: Sequence[memoryview], name: str = "accelnb") -> tuple[int, list[tuple[int, int]]]:
    """Copy ``buffers`` (contiguous byte views) into a new memfd; returns its fd and the layout.

    The fd is close-on-exec and the caller's to close, once it has been sent.
    """
    layout = layout_of([view.nbytes for view in buffers])
    fd = -1
    try:
        with held_interrupts():  # a Ctrl-C right after memfd_create returns would lose the fd
            fd = os.memfd_create(name, os.MFD_CLOEXEC)
        total = layout[-1][0] + layout[-1][1] if layout else 0
        os.ftruncate(fd, total)
        for view, (offset, size) in zip(buffers, layout, strict=True):
            written = 0
            while written < size:
                written += os.pwrite(fd, view[written:written + WRITE_CHUNK_BYTES], offset + written)
    except BaseException:  # an interrupt while copying: the half-written file goes with its fd
        if fd >= 0:
            os.close(fd)
        raise
    return fd, layout


def map_buffers(fd: int, layout: Sequence[tuple[int, int]]) -> list[memoryview]:
    """Writable copy-on-write views of the buffers in ``fd``; the caller may close ``fd`` at once."""
    total = max((offset + size for offset, size in layout), default=0)
    if total == 0:
        return [memoryview(bytearray()) for _ in layout]
    whole = _map_private(fd, total)
    return [whole[offset:offset + size] for offset, size in layout]


def _map_private(fd: int, size: int) -> memoryview:
    """``mmap(MAP_PRIVATE)`` of ``fd``, unmapped when the last view of it is released.

    Not :class:`mmap.mmap`: it keeps a duplicate of the fd open as long as the mapping lives
    (before Python 3.13's ``trackfd=False``), so every value brought back would hold an fd.
    """
    libc = _libc()
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address in (None, _MAP_FAILED):
        error = ctypes.get_errno()
        raise OSError(error, f"could not map {size} bytes of shared memory: {os.strerror(error)}")
    # A ctypes array over the pages owns them: views hold it, and the last one to go unmaps.
    region_type: Any = type("PrivateMapping", (ctypes.c_char * size,),
                            {"__del__": lambda self, at=address, length=size: libc.munmap(at, length)})
    return memoryview(region_type.from_address(address)).cast("B")


_MAP_FAILED = ctypes.c_void_p(-1).value
_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long)
        libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
        _LIBC = libc
    return _LIBC
