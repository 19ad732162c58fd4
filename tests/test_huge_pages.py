"""The template's memory on 2 MiB pages (``worker/template/huge_pages.py``): the template collapses
its written memory while idle, a rank that writes still copies only 4 KiB pages, and memory that
was reserved but never touched stays out of memory.

Real templates and launches, real ``madvise``; the pages are read back from ``/proc``. Where this
kernel cannot collapse memory at all (older than 6.1, built without THP), the tests skip and say so.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import time
from collections.abc import Iterator

import pytest

import accelnb
from accelnb.kernel.helper.template import running_helper_pid, shared_helper, shutdown_helper
from accelnb.worker.template.huge_pages import HUGE_PAGE, MADV_COLLAPSE, OFF_ENV, HugePages
from tests.test_standby_ranks import waiting_children

pytestmark = pytest.mark.usefixtures("no_leftovers")

COLLAPSE_WAIT_S = 60.0  # a pass takes 0.2-0.4 s on a quiet machine; a loaded CI machine is slower

libc = ctypes.CDLL(None, use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def aligned_buffer(huge_pages: int) -> tuple[mmap.mmap, int]:
    """A private anonymous mapping (as malloc makes) and the address of ``huge_pages`` 2 MiB
    ranges inside it, aligned."""
    buffer = mmap.mmap(-1, (huge_pages + 1) * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    return buffer, -(-start // HUGE_PAGE) * HUGE_PAGE


def touch(start: int, length: int, every: int = mmap.PAGESIZE) -> None:
    for address in range(start, start + length, every):
        ctypes.c_char.from_address(address).value = b"x"


def resident_pages(start: int, length: int) -> int:
    vector = ctypes.create_string_buffer(length // mmap.PAGESIZE)
    assert libc.mincore(start, length, vector) == 0, ctypes.get_errno()
    return length // mmap.PAGESIZE - vector.raw.count(0)


def huge_kib_at(address: int, pid: str = "self") -> int:
    """AnonHugePages of the mapping that holds ``address``, in KiB."""
    inside = False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def memory_kib(pid: int | str, *fields: str) -> dict[str, int]:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        found = {line.split(":")[0]: int(line.split()[1]) for line in rollup if ":" in line and "kB" in line}
    return {field: found[field] for field in fields}


@pytest.fixture(scope="module", autouse=True)
def kernel_collapses() -> None:
    """Skip the module where this kernel cannot collapse memory at all."""
    buffer, start = aligned_buffer(1)
    touch(start, HUGE_PAGE)
    if libc.madvise(start, HUGE_PAGE, MADV_COLLAPSE) != 0:
        pytest.skip(f"this kernel cannot collapse memory into huge pages (madvise: errno "
                    f"{ctypes.get_errno()}); the template forks on 4 KiB pages as before")
    buffer.close()


@pytest.fixture
def fresh_template() -> Iterator[None]:
    """Each test starts its own template, so that it sees a whole idle turn from the start."""
    shutdown_helper()
    yield
    shutdown_helper()


# ── in this process ─────────────────────────────────────────────────────────────────────────
def test_memory_in_use_is_collapsed_and_memory_barely_touched_stays_out() -> None:
    buffer, start = aligned_buffer(8)
    used, sparse = start, start + 4 * HUGE_PAGE
    touch(used, 4 * HUGE_PAGE)  # every page
    touch(sparse, 4 * HUGE_PAGE, every=HUGE_PAGE // 8)  # 8 pages in 512 of each range
    pages = HugePages()
    while pages.due():
        pages.step()
    assert huge_kib_at(used) >= 4 * HUGE_PAGE // 1024  # the used ranges now on 2 MiB pages
    assert resident_pages(sparse, 4 * HUGE_PAGE) == 4 * 8  # not filled in with zeros
    assert resident_pages(used, 4 * HUGE_PAGE) == 4 * 512
    buffer.close()


def test_memory_grown_after_a_pass_is_collapsed_once_it_is_said_to_have_changed() -> None:
    pages = HugePages()
    while pages.due():
        pages.step()
    buffer, start = aligned_buffer(2)
    touch(start, 2 * HUGE_PAGE)
    assert not pages.due()  # nothing read again until told
    pages.memory_changed()
    while pages.due():
        pages.step()
    assert huge_kib_at(start) >= 2 * HUGE_PAGE // 1024
    buffer.close()


# ── the template and its ranks ──────────────────────────────────────────────────────────────
def private_memory_after_writing() -> dict[str, int]:
    """In a rank: write to objects all over the template's heap (every module's attributes, as a
    rank's code touches what it uses), then say how much memory is this rank's own."""
    import gc
    import sys

    touched = 0
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            touched += sys.getrefcount(value) > 0  # holding a reference writes its count
    gc.collect()
    with open("/proc/self/smaps_rollup") as rollup:
        found = {line.split(":")[0]: int(line.split()[1]) for line in rollup if ":" in line and "kB" in line}
    return {"touched": touched, "Private_Dirty": found["Private_Dirty"], "AnonHugePages": found["AnonHugePages"]}


def collapsed(template: int) -> dict[str, int]:
    """The template's memory once most of it is on huge pages (polled, bounded: it collapses once
    nothing came for a moment, a piece per turn, and says nothing when done)."""
    deadline = time.monotonic() + COLLAPSE_WAIT_S
    while True:
        memory = memory_kib(template, "Anonymous", "AnonHugePages")
        if memory["AnonHugePages"] >= memory["Anonymous"] // 2:
            return memory
        assert time.monotonic() < deadline, f"the template's memory after {COLLAPSE_WAIT_S} s: {memory}"
        time.sleep(0.05)


def rank_memory(monkeypatch: pytest.MonkeyPatch, huge_pages: bool) -> tuple[dict[str, int], dict[str, int]]:
    """The template's memory once idle, and rank 0's after writing, for a template started anew."""
    shutdown_helper()
    monkeypatch.setenv(OFF_ENV, "0" if huge_pages else "1")
    shared_helper()
    accelnb.launch(int, num_processes=2, cpu=True, quiet=True, timeout=120)
    waiting_children(2)  # every import made: the template's memory as it stays
    template = running_helper_pid()
    assert template is not None
    template_memory = collapsed(template) if huge_pages else memory_kib(template, "Anonymous", "AnonHugePages")
    # The children waiting now may be forks of the memory before; the next ones are not.
    accelnb.launch(int, num_processes=2, cpu=True, quiet=True, timeout=120)
    waiting_children(2)
    result = accelnb.launch(private_memory_after_writing, num_processes=2, cpu=True, quiet=True, timeout=120)
    return template_memory, result.values[0]  # type: ignore[return-value]


@pytest.mark.usefixtures("fresh_template")
def test_the_template_is_on_huge_pages_and_a_rank_that_writes_copies_only_small_pages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    template_off, rank_off = rank_memory(monkeypatch, huge_pages=False)
    template_on, rank_on = rank_memory(monkeypatch, huge_pages=True)
    print(f"template off {template_off} on {template_on}; rank off {rank_off} on {rank_on}", file=sys.stderr)
    assert template_off["AnonHugePages"] == 0
    # Most of what it wrote: the rest lies in ranges it barely touched, or at a mapping's ragged ends.
    assert template_on["AnonHugePages"] >= template_on["Anonymous"] // 2
    assert template_on["Anonymous"] <= template_off["Anonymous"] * 1.1  # nothing filled in
    # The rank shares the template's huge pages and copies 4 KiB where it writes: had the kernel
    # copied whole 2 MiB pages, the thousands of objects it touched would cost it far more.
    assert rank_on["AnonHugePages"] > 0
    assert rank_on["Private_Dirty"] <= rank_off["Private_Dirty"] * 1.25 + 4096
