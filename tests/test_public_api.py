"""The public surface is small and deliberate; importing it has no side effects; its options work.

Each public name is pinned with what it is (an exception of the accelnb tree, a data record, a
class, a function), so a name that disappears, or turns into something else, fails here.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import subprocess
import sys

import pytest

import accelnb
from accelnb import RankFailed, Session, last_result, launch, notebook_launcher
from tests.conftest import worker_processes

EXPECTED = {
    "AccelnbError": "exception", "GpuSelectionError": "exception", "LaunchConfigError": "exception",
    "LaunchFailed": "exception", "LaunchInsideLaunchError": "exception", "ScriptExited": "exception",
    "LaunchTimeout": "exception",
    "PortInUseError": "exception",
    "RankCrashed": "exception", "RankFailed": "exception", "UnpicklableError": "exception",
    "WorkerStartError": "exception", "HelperDied": "exception", "RunInterrupted": "interrupt",
    "GpuInfo": "record", "Inventory": "record", "LaunchPlan": "record", "LaunchResult": "record",
    "RankFailure": "record", "RankSpec": "record", "Selection": "record",
    "AccelerateTracker": "class", "MetricHistory": "class", "Panel": "class", "Session": "class",
    "current_selection": "function", "last_result": "function", "launch": "function",
    "notebook_launcher": "function", "plan": "function", "prewarm": "function", "progress": "function",
    "read_inventory": "function", "report": "function", "restart_count": "function", "set_selection": "function",
    "spawn": "function", "torchrun": "function",
    "synthetic_inventory": "function", "stacks": "function", "doctor": "function",
    "Check": "record", "DoctorReport": "class",
    "sweep": "function", "Trial": "record", "Trials": "class",
    "stop_requested": "function", "TrainerSaveOnStop": "class", "LightningSaveOnStop": "class",
}
# Subclasses of a library's own class: reaching them imports that library (transformers, lightning).
LIBRARY_CLASSES = ("Panel", "TrainerSaveOnStop", "LightningSaveOnStop")


def test_all_is_pinned() -> None:
    assert set(accelnb.__all__) == set(EXPECTED)


@pytest.mark.parametrize(("name", "kind"), EXPECTED.items())
def test_each_public_name_imports_and_is_what_it_is_documented_to_be(name: str, kind: str) -> None:
    value = getattr(importlib.import_module("accelnb"), name)  # `from accelnb import name`
    assert value.__module__.startswith("accelnb."), value.__module__  # ours, from a private module
    if kind == "exception":
        assert inspect.isclass(value) and issubclass(value, accelnb.AccelnbError)
    elif kind == "interrupt":  # a KeyboardInterrupt, so that `except Exception` does not swallow a stop
        assert inspect.isclass(value) and issubclass(value, KeyboardInterrupt)
        assert not issubclass(value, Exception)
    elif kind == "record":
        assert inspect.isclass(value) and dataclasses.is_dataclass(value)
    elif kind == "class":
        assert inspect.isclass(value) and not issubclass(value, BaseException)
    else:
        assert inspect.isfunction(value)


def test_session_is_the_class_the_magic_uses() -> None:
    from accelnb.notebook import magic

    assert accelnb.Session is magic.Session
    assert hasattr(Session, "__enter__") and hasattr(Session, "__exit__")


def test_import_starts_nothing() -> None:
    # Every public name is reached (each imports its module on first use), and still nothing runs.
    code = ("import sys, threading, accelnb; "
            "loaded_by_import = [m for m in sys.modules if m.startswith('accelnb.')]; "
            f"[getattr(accelnb, name) for name in accelnb.__all__ if name not in {LIBRARY_CLASSES}]; "
            "import accelnb.kernel.helper.template as helper; "
            "print(len(loaded_by_import), threading.active_count(), 'torch' in sys.modules, "
            "'pynvml' in sys.modules, helper.running_helper_pid() is None)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["0", "1", "False", "False", "True"]  # `import accelnb` alone loads none of it


# ── options through the public API ─────────────────────────────────────────────────────────
def say_rank() -> int:
    import torch.distributed as dist

    print(f"hello from rank {dist.get_rank()}", flush=True)
    return dist.get_rank()


def say_then_fail_on_rank_1() -> None:
    import torch.distributed as dist

    print(f"rank {dist.get_rank()} about to decide", flush=True)
    if dist.get_rank() == 1:
        raise ValueError("rank 1 gives up")


@pytest.mark.usefixtures("no_leftovers")
def test_output_none_shows_nothing_live_but_keeps_every_line(capfd: pytest.CaptureFixture[str]) -> None:
    result = launch(say_rank, num_processes=2, cpu=True, quiet=True, output="none")
    assert "hello" not in capfd.readouterr().out
    assert result.output(0) == "hello from rank 0\n" and result.output(1) == "hello from rank 1\n"
    assert result.values == {0: 0, 1: 1}


@pytest.mark.usefixtures("no_leftovers")
def test_output_none_still_shows_what_the_failed_rank_printed(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RankFailed) as failed:
        launch(say_then_fail_on_rank_1, num_processes=2, cpu=True, quiet=True, output="none")
    assert "rank 1 about to decide" in str(failed.value) and "rank 1 gives up" in str(failed.value)
    assert "about to decide" not in capfd.readouterr().out


@pytest.mark.usefixtures("no_leftovers")
def test_collect_decides_whose_values_come_back() -> None:
    # collect="all" is the default
    assert launch(say_rank, num_processes=2, cpu=True, quiet=True, output="none").values == {0: 0, 1: 1}
    assert launch(say_rank, num_processes=2, cpu=True, quiet=True, output="none", collect="rank0").values == {0: 0}
    assert notebook_launcher(say_rank, num_processes=2, cpu=True, quiet=True, output="none") == 0
    latest = last_result()
    assert latest is not None and latest.values == {0: 0}  # notebook_launcher collects rank 0's only
    assert notebook_launcher(say_rank, num_processes=2, cpu=True, quiet=True, output="none", collect="all") == 0
    latest = last_result()
    assert latest is not None and latest.values == {0: 0, 1: 1}


def rank_0_answers_last() -> int:
    import time

    import torch.distributed as dist

    if dist.get_rank() == 0:
        time.sleep(0.5)  # not a wait for anything: rank 1's answer arrives first
    return dist.get_rank()


@pytest.mark.usefixtures("no_leftovers")
def test_values_are_in_rank_order_whatever_order_the_ranks_answered_in() -> None:
    values = launch(rank_0_answers_last, num_processes=2, cpu=True, quiet=True).values
    assert list(values.items()) == [(0, 0), (1, 1)]  # so that printing them reads in rank order


@pytest.mark.usefixtures("no_leftovers")
def test_collect_and_output_through_a_session(capfd: pytest.CaptureFixture[str]) -> None:
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        pids = {p.pid for p in worker_processes()}
        assert len(pids) == 2
        everyone = session.run(say_rank, collect="all", output="none")
        only_rank0 = session.run(say_rank, collect="rank0", output="all")
        assert {p.pid for p in worker_processes()} == pids  # the same workers served both calls
    assert everyone.values == {0: 0, 1: 1} and only_rank0.values == {0: 0}
    shown = capfd.readouterr().out
    assert shown.count("hello from rank") == 2  # the second call's, prefixed; none of the first's
    assert "[rank 0] hello from rank 0" in shown and "[rank 1] hello from rank 1" in shown
    assert everyone.output(1) == "hello from rank 1\n"
