"""Live stacks: every rank's current Python stack while it runs, nothing stopped.

Real worker processes on CPU. Each rank blocks in a function with a known name; the tests wait
on something real (the file each rank writes once it is there), never on a sleep.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import accelnb
from accelnb import LaunchConfigError, LaunchTimeout, Session
from accelnb.kernel.run import run_state
from accelnb.kernel.stacks.faulthandler_dumps import split_stack_dump
from tests.conftest import worker_processes

READY_WAIT_S = 60.0


def waiting_in_a_known_place(marker_dir: str, release_file: str) -> int:
    """Say "I am here" with a file, then wait until the test releases us (a file appears)."""
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    Path(marker_dir, f"rank{rank}").write_text(str(os.getpid()))
    while not os.path.exists(release_file):  # polling a file: the rank must not need the kernel
        time.sleep(0.01)
    return rank


def _wait_for_markers(marker_dir: Path, ranks: int) -> None:
    """Block until every rank wrote its marker file (a bounded poll of that condition)."""
    deadline = time.monotonic() + READY_WAIT_S
    while len(list(marker_dir.glob("rank*"))) < ranks:
        assert time.monotonic() < deadline, "the ranks never reached the known place"
        threading.Event().wait(0.02)


def _assert_every_rank_in_the_known_place(dump: dict[int, str]) -> None:
    assert set(dump) == {0, 1}, dump
    for rank, text in dump.items():
        assert "waiting_in_a_known_place" in text, f"rank {rank}:\n{text}"
        assert "accelnb/worker" not in text  # accelnb's own frames are dropped


@pytest.mark.usefixtures("no_leftovers")
def test_stacks_of_a_launch_running_in_another_thread(tmp_path: Path) -> None:
    markers, release = tmp_path / "markers", tmp_path / "release"
    markers.mkdir()
    outcome: dict[str, Any] = {}

    def launch_in_background() -> None:
        outcome["result"] = accelnb.launch(waiting_in_a_known_place, args=(str(markers), str(release)),
                                           num_processes=2, cpu=True, quiet=True, output="none", timeout=120)

    launcher = threading.Thread(target=launch_in_background)
    launcher.start()
    try:
        _wait_for_markers(markers, 2)
        dump = accelnb.stacks()
        run = run_state.current_run()
        assert run is not None and not run.finished  # nothing was stopped
        pids_before = {p.pid for p in worker_processes()}
    finally:
        release.write_text("go")
        launcher.join(120)
    _assert_every_rank_in_the_known_place(dump)
    assert len(pids_before) == 2
    assert outcome["result"].values == {0: 0, 1: 1}  # the run went on and finished normally
    print(f"\n{accelnb.stacks.__name__}() of a running launch:\n{dump}")


@pytest.mark.usefixtures("no_leftovers")
def test_stacks_of_a_session_between_cells(tmp_path: Path) -> None:
    markers, release = tmp_path / "markers", tmp_path / "release"
    markers.mkdir()
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        outcome: dict[str, Any] = {}
        caller = threading.Thread(target=lambda: outcome.update(
            result=session.run(waiting_in_a_known_place, args=(str(markers), str(release)), output="none")))
        caller.start()  # a call in progress in another thread: that thread serves the request
        try:
            _wait_for_markers(markers, 2)
            during_call = session.stacks()
        finally:
            release.write_text("go")
            caller.join(120)
        _assert_every_rank_in_the_known_place(during_call)
        assert outcome["result"].values == {0: 0, 1: 1}

        between_cells = accelnb.stacks()  # nobody pumps now: this thread reads the dumps itself
        assert set(between_cells) == {0, 1}
        assert all("waiting_in_a_known_place" not in text for text in between_cells.values())
        assert all("most recent call first" in text and "waiting for the next call" in text
                   for text in between_cells.values()), between_cells
        assert session.alive
        assert session.run(os.getpid).values.keys() == {0, 1}  # still usable afterwards


def waiting_beside_a_busy_thread(marker_dir: str, release_file: str) -> int:
    """A rank whose own thread never stops calling functions (as a data-loading thread walking
    nested records does) while its main thread waits in a known place. faulthandler's dump,
    which reads the other threads' frames as they change, killed such a rank at its first dump."""
    import threading

    def walk_records(depth: int) -> int:
        fields = {"depth": depth, "name": f"record {depth}", "tags": [depth, depth + 1]}
        return len(fields) if depth == 0 else walk_records(depth - 1) + len(fields)

    def load_records_forever() -> None:
        while True:
            walk_records(300)
            threading.Event().wait(0.00001)

    threading.Thread(target=load_records_forever, name="loader", daemon=True).start()
    return waiting_in_a_known_place(marker_dir, release_file)


def _assert_both_threads_shown(dump: dict[int, str]) -> None:
    assert set(dump) == {0, 1}, dump
    for rank, text in dump.items():
        assert "in waiting_in_a_known_place" in text, f"rank {rank}:\n{text}"
        assert "in load_records_forever" in text, f"rank {rank}:\n{text}"


@pytest.mark.usefixtures("no_leftovers")
def test_stacks_of_ranks_whose_threads_run_all_along_leave_them_running(tmp_path: Path) -> None:
    markers, release = tmp_path / "markers", tmp_path / "release"
    markers.mkdir()
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        pids = set(session.run(os.getpid).values.values())
        outcome: dict[str, Any] = {}
        caller = threading.Thread(target=lambda: outcome.update(
            result=session.run(waiting_beside_a_busy_thread, args=(str(markers), str(release)), output="none")))
        caller.start()
        try:
            _wait_for_markers(markers, 2)
            dumps = [session.stacks() for _ in range(5)]
        finally:
            release.write_text("go")
            caller.join(120)
        for dump in dumps:
            _assert_both_threads_shown(dump)
        assert outcome["result"].values == {0: 0, 1: 1}  # the ranks lived through every dump
        assert set(session.run(os.getpid).values.values()) == pids


@pytest.mark.usefixtures("no_leftovers")
def test_a_timeout_shows_the_stacks_of_ranks_whose_threads_run_all_along(tmp_path: Path) -> None:
    markers = tmp_path / "markers"
    markers.mkdir()
    with pytest.raises(LaunchTimeout) as info:
        accelnb.launch(waiting_beside_a_busy_thread, args=(str(markers), str(tmp_path / "never")),
                       num_processes=2, cpu=True, quiet=True, output="none", timeout=1.5)
    assert "SIGSEGV" not in str(info.value)  # no rank died of the dump
    _assert_both_threads_shown(_stacks_in(info.value))


def deadlocked_in_native_code_holding_the_gil() -> None:
    """Lock a mutex twice through ``ctypes.PyDLL``, which keeps the GIL across the call: a
    deadlock in native code that no thread of the rank can run Python past."""
    import ctypes

    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)  # zeroes: PTHREAD_MUTEX_INITIALIZER, a normal mutex
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


@pytest.mark.usefixtures("no_leftovers")
def test_a_timeout_shows_the_stack_of_a_rank_that_holds_the_gil_in_native_code() -> None:
    """The rank's watcher cannot take the GIL to write its stacks: the second signal has
    faulthandler write them (``wire/stack_signals.py``)."""
    with pytest.raises(LaunchTimeout) as info:
        accelnb.launch(deadlocked_in_native_code_holding_the_gil, num_processes=2, cpu=True, quiet=True,
                       output="none", timeout=1.5)
    stacks = _stacks_in(info.value)
    assert set(stacks) == {0, 1}, str(info.value)
    assert all("in deadlocked_in_native_code_holding_the_gil" in stack for stack in stacks.values()), str(info.value)


def _stacks_in(timeout: LaunchTimeout) -> dict[int, str]:
    """Each rank's stack as the timeout's message shows it (its lines start with ``[rank N]``)."""
    stacks: dict[int, str] = {}
    for line in str(timeout).splitlines():
        for rank in (0, 1):
            if line.startswith(f"[rank {rank}]"):
                stacks[rank] = stacks.get(rank, "") + line + "\n"
    return stacks


def test_stacks_with_nothing_running_says_how_to_use_it() -> None:
    run = run_state.current_run()
    if run is not None and not run.finished:
        pytest.skip("a run from another test is still in progress")
    with pytest.raises(LaunchConfigError, match="No launch or session is running"):
        accelnb.stacks()


def test_a_live_dump_is_told_apart_from_the_ranks_own_stderr() -> None:
    text = ("warning: slow step\n"
            "Thread 0x00007f01 (most recent call first):\n"
            '  File "/x/threading.py", line 327 in wait\n'
            "\n"
            "Current thread 0x00007f02 (most recent call first):\n"
            '  File "<cell 3>", line 2 in train\n'
            "epoch 3 done\n")
    dump, rest = split_stack_dump(text)
    assert rest == "warning: slow step\nepoch 3 done\n"
    assert dump.count("most recent call first") == 2 and "in train" in dump and "epoch" not in dump
