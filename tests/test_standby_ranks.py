"""Ranks forked ahead of a launch (``worker/template/standby_ranks.py``): a launch takes the children the
template forked while idle, and those children are never older than what the template imported.

Real templates, real launches; a waiting child is found by the name it carries
(``accelnb-standby``), and a launch's ranks are compared with them by pid.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import accelnb
from accelnb.kernel.helper.template import running_helper_pid, shared_helper, wait_for_departed_ranks
from accelnb.worker.rank_body import FLUSH_INTERVAL_S
from accelnb.worker.template.standby_ranks import STANDBY_NAME
from tests.conftest import is_standby, worker_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")

WAIT_S = 30.0  # the template forks them once idle: milliseconds, but a loaded CI machine is slow


def waiting_children(count: int) -> list[psutil.Process]:
    """The template's waiting children, once there are ``count`` of them (polled, bounded).

    Only once the last launch's departed ranks are reaped: until then the template may fork one
    ahead as the first is reaped. (It forks none while imports wait for the last rank to end: they
    would let it go again. Under load, that let the children these tests saw go, 3 times in 6.)
    """
    assert wait_for_departed_ranks()
    template = running_helper_pid()
    assert template is not None
    deadline = time.monotonic() + WAIT_S
    while True:
        found = [p for p in psutil.Process(template).children() if is_standby(p)]
        if len(found) == count:
            return found
        assert time.monotonic() < deadline, f"{len(found)} waiting children after {WAIT_S} s, expected {count}"
        time.sleep(0.02)


def who_am_i(names: list[str]) -> dict[str, object]:
    import os
    import sys

    import psutil
    import torch.distributed as dist

    me = psutil.Process()
    return {"pid": os.getpid(), "name": me.name(), "rank": dist.get_rank(), "cwd": os.getcwd(),
            "variable": os.environ.get("ACCELNB_TEST_STANDBY"), "loaded": {n: n in sys.modules for n in names}}


def launch(*names: str, **options: object) -> dict[int, dict[str, object]]:
    result = accelnb.launch(who_am_i, (list(names),), num_processes=2, cpu=True, quiet=True, timeout=120,
                            **options)  # type: ignore[arg-type]
    return result.values  # type: ignore[return-value]


@pytest.fixture
def following(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """Templates follow this process's imports, as for users; a folder of the user's modules."""
    monkeypatch.setenv("ACCELNB_TEMPLATE", "on")
    sys.path.insert(0, str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in set(sys.modules) - before:
        if str(tmp_path) in (getattr(sys.modules[name], "__file__", "") or ""):
            del sys.modules[name]


def test_a_launch_takes_the_children_forked_while_the_template_was_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    shared_helper()
    launch()  # the template now keeps two waiting
    waiting = waiting_children(2)
    assert all(p.name() == STANDBY_NAME for p in waiting)
    monkeypatch.setenv("ACCELNB_TEST_STANDBY", "set after they were forked")
    monkeypatch.chdir(Path(__file__).parent)
    found = launch()
    assert {v["pid"] for v in found.values()} == {p.pid for p in waiting}
    for rank, seen in found.items():
        assert seen["rank"] == rank
        assert seen["name"] != STANDBY_NAME  # a rank takes the template's name back
        assert seen["variable"] == "set after they were forked"  # the launch's environment, not the fork's
        assert seen["cwd"] == str(Path(__file__).parent)
    waiting_children(2)  # and two more wait for the next launch


def test_an_import_lets_the_waiting_children_go_so_a_rank_has_all_its_template_has(following: Path) -> None:
    shared_helper()
    launch()
    before = {p.pid for p in waiting_children(2)}
    module = following / "imported_after_the_fork.py"
    module.write_text(textwrap.dedent("VALUE = 1\n"))
    importlib.invalidate_caches()
    import imported_after_the_fork  # noqa: F401  (a notebook cell's import, after the children were forked)

    found = launch("imported_after_the_fork")
    assert all(v["loaded"] == {"imported_after_the_fork": True} for v in found.values())  # from the template
    assert not {v["pid"] for v in found.values()} & before  # not the children forked before the import
    for pid in before:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_a_waiting_child_that_was_killed_is_replaced_by_a_fork_at_launch() -> None:
    # On ports of the user's, so that the waiting children join no group ahead (test_group_ahead.py
    # has a member's death): each is any rank's, and a launch takes what is left.
    shared_helper()
    launch(master_port=free_port())
    victim, survivor = waiting_children(2)
    os.kill(victim.pid, signal.SIGKILL)  # the OOM killer's choice
    victim.wait(10)
    found = launch(master_port=free_port())
    pids = {v["pid"] for v in found.values()}
    assert survivor.pid in pids and victim.pid not in pids and len(pids) == 2


def test_waiting_children_end_with_the_template() -> None:
    shared_helper()
    launch()
    waiting = waiting_children(2)
    template = psutil.Process(running_helper_pid())  # type: ignore[arg-type]
    template.kill()
    template.wait(10)
    _gone, alive = psutil.wait_procs(waiting, timeout=10)  # PR_SET_PDEATHSIG
    assert alive == []
    assert launch()[0]["rank"] == 0  # the next launch starts another template


def test_a_session_started_from_waiting_children_shows_its_ranks_at_once() -> None:
    shared_helper()
    launch()
    waiting = {p.pid for p in waiting_children(2)}
    with accelnb.Session.start(num_processes=2, cpu=True, quiet=True):
        # The template reports a pid only once its child took the rank's name: never a rank that
        # looks like a waiting child to whoever looks right after the start.
        assert {p.pid for p in worker_processes()} == waiting


def accelnbs_threads() -> list[str]:
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("accelnb-"))


def test_a_waiting_child_starts_the_ranks_threads_while_it_waits_and_dies_of_sigterm() -> None:
    """A thread's start costs a launch 1.5-2 ms on 2 cores: a waiting child has started the two
    a rank runs (the watcher at once, the flusher a while later) before any launch wants them, and
    a rank that takes it runs those very threads."""
    shared_helper()
    launch()
    waiting = waiting_children(2)
    for child in waiting:
        deadline = time.monotonic() + WAIT_S
        while child.num_threads() < 3:  # its main thread, the watcher, the flusher
            assert time.monotonic() < deadline, f"{child.num_threads()} threads in a waiting child"
            time.sleep(0.02)
    result = accelnb.launch(accelnbs_threads, num_processes=2, cpu=True, quiet=True, collect="all", timeout=120)
    assert set(result.values) == {0, 1}
    assert all(threads == ["accelnb-flush", "accelnb-signals"] for threads in result.values.values())

    victim, _survivor = waiting_children(2)
    os.kill(victim.pid, signal.SIGTERM)  # its handler is accelnb's by now: flush (nothing yet), then die of it
    victim.wait(10)
    assert launch()[1]["rank"] == 1  # the launch forks the rank that found no child


def when_the_threads_started() -> dict[str, object]:
    """In a rank: its accelnb threads once the flusher runs, and when each started, in clock ticks
    after the process did (``/proc``: the start times the OS keeps)."""
    import os
    import threading
    import time

    def started(path: str) -> int:
        with open(path) as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime

    names_at_entry = accelnbs_threads()
    deadline = time.monotonic() + 30
    while "accelnb-flush" not in accelnbs_threads():
        assert time.monotonic() < deadline, "no flusher after 30 s"
        time.sleep(0.01)
    ticks = {thread.name: started(f"/proc/self/task/{thread.native_id}/stat") - started("/proc/self/stat")
             for thread in threading.enumerate() if thread.name.startswith("accelnb-")}
    return {"at entry": names_at_entry, "ticks": ticks, "tick_hz": os.sysconf("SC_CLK_TCK"), "pid": os.getpid()}


def test_a_rank_forked_at_launch_starts_its_watcher_and_its_flusher_only_a_while_later() -> None:
    """Each thread a rank starts at a launch costs it 1.5-2 ms of CPU on 2 cores: a rank forked at
    launch starts its watcher (which reads the control socket too) and the flusher only once it
    has lived ``FLUSH_INTERVAL_S``, which a short call never does. A launch of 3 after launches of
    2 has no child waiting for its group: every rank is forked at launch."""
    shared_helper()
    launch()
    waiting = {child.pid for child in waiting_children(2)}
    result = accelnb.launch(when_the_threads_started, num_processes=3, cpu=True, quiet=True, timeout=120)
    assert len(result.values) == 3
    for rank, found in result.values.items():
        assert found["pid"] not in waiting, f"rank {rank} was a waiting child"
        ticks = found["ticks"]
        assert sorted(ticks) == ["accelnb-flush", "accelnb-signals"], (rank, found)
        # 50 ms after the watcher, at the OS's resolution of ticks (a tick is 10 ms).
        later = ticks["accelnb-flush"] - ticks["accelnb-signals"]
        assert later >= FLUSH_INTERVAL_S * found["tick_hz"] - 1, (rank, found)
        assert found["at entry"] in (["accelnb-signals"], ["accelnb-flush", "accelnb-signals"]), (rank, found)
