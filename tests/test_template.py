"""The template the ranks fork from (``kernel/helper/template.py``, ``worker/template/helper.py``), from a script.

This test process plays the kernel: what it imported, the template imports too, in a fresh
interpreter that is never a fork of it. Each test writes the modules it needs into its own folder
(on ``sys.path`` for the test), as a user's project folder would hold them, and asks the ranks what
they found loaded *before* their function imported anything: a function here names no module at
module level, so unpickling it imports nothing.
"""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import accelnb
from accelnb.kernel.helper import template
from accelnb.kernel.helper.template import running_helper_pid, shared_helper
from accelnb.wire.template import TORCH_DYNAMO_IN_TURNS, TRAINING_PREIMPORTS
from tests.conftest import is_standby

pytestmark = pytest.mark.usefixtures("no_leftovers", "following")


@pytest.fixture
def following(monkeypatch: pytest.MonkeyPatch) -> None:
    """Templates follow this process's imports, as they do for users (the suite's are bare: conftest)."""
    monkeypatch.setenv("ACCELNB_TEMPLATE", "on")


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    """A folder of the user's modules on ``sys.path``; they are forgotten afterwards."""
    sys.path.insert(0, str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in set(sys.modules) - before:
        if getattr(sys.modules[name], "__file__", "") and str(tmp_path) in (sys.modules[name].__file__ or ""):
            del sys.modules[name]


def write_module(folder: Path, name: str, source: str) -> None:
    path = folder / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    os.utime(path, (path.stat().st_atime, path.stat().st_mtime + 1))  # a new mtime even within one tick
    importlib.invalidate_caches()


# ── what the ranks run ──────────────────────────────────────────────────────────────────────
def what_the_rank_found(names: list[str]) -> dict[str, object]:
    import os
    import sys

    import psutil

    parent = psutil.Process(os.getppid())
    return {"loaded": {name: name in sys.modules for name in names}, "parent": parent.pid,
            "parent_cmdline": " ".join(parent.cmdline()), "grandparent": parent.ppid()}


def version_of(name: str) -> object:
    return importlib.import_module(name).VERSION


def run_ranks(function: object, *args: object) -> dict[int, object]:
    return accelnb.launch(function, args, num_processes=2, cpu=True, quiet=True, timeout=120).values  # type: ignore[arg-type]


# ── tests ───────────────────────────────────────────────────────────────────────────────────
def test_ranks_fork_from_a_fresh_interpreter_that_imported_what_this_process_has(project: Path) -> None:
    write_module(project, "users_model", "VERSION = 1\nimport json\n")
    import users_model  # noqa: F401  (imported here, as a notebook cell would)

    sys.modules["only_in_memory"] = types.ModuleType("only_in_memory")  # exists in no file
    try:
        values = run_ranks(what_the_rank_found, ["users_model", "only_in_memory"])
    finally:
        del sys.modules["only_in_memory"]
    helper = running_helper_pid()
    for found in values.values():
        assert found["loaded"] == {"users_model": True, "only_in_memory": False}
        assert found["parent"] == helper and found["grandparent"] == os.getpid()
        # a program of its own, not a fork of ours
        assert "-m accelnb.worker.template.helper" in str(found["parent_cmdline"])


def what_a_full_collection_walks() -> tuple[int, int]:
    import gc

    return gc.get_freeze_count(), len(gc.get_objects())


def test_a_ranks_garbage_collector_leaves_the_templates_objects_alone() -> None:
    # torch alone is ~100k objects: a full collection walking them stalls a training step and
    # copies the shared pages it touches.
    for frozen, walked in run_ranks(what_a_full_collection_walks).values():
        assert frozen > 50_000 and walked < 20_000, (frozen, walked)


def test_a_module_binding_init_process_group_at_import_runs_like_under_torchrun(project: Path) -> None:
    """pytorch/examples' DDP series: ``from torch.distributed import init_process_group`` at the top of
    the module, imported in the notebook before the launch; under a fork of the kernel the rank's
    call was torch's own and failed with "default process group twice"."""
    write_module(project, "ddp_series_style", """
        import torch
        import torch.nn.functional as F
        from torch.distributed import destroy_process_group, init_process_group
        from torch.nn.parallel import DistributedDataParallel as DDP


        def ddp_setup():
            init_process_group(backend="gloo")


        def main(total_epochs):
            ddp_setup()
            model = DDP(torch.nn.Linear(4, 1))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(total_epochs):
                optimizer.zero_grad()
                loss = F.mse_loss(model(torch.ones(8, 4)), torch.zeros(8, 1))
                loss.backward()
                optimizer.step()
            weight = model.module.weight.detach().clone()
            destroy_process_group()
            return weight.sum().item()
        """)
    from ddp_series_style import main

    values = run_ranks(main, 3)
    assert values[0] == values[1]  # one model, kept in step by DDP's all-reduce


def test_a_changed_module_gets_a_new_template_and_the_old_one_ends(project: Path) -> None:
    write_module(project, "edited", "VERSION = 1\n")
    import edited

    assert run_ranks(version_of, "edited") == {0: 1, 1: 1}
    first = running_helper_pid()
    write_module(project, "edited", "VERSION = 2\n")
    importlib.reload(edited)  # what autoreload does; the template's copy is stale now

    assert run_ranks(version_of, "edited") == {0: 2, 1: 2}
    assert running_helper_pid() != first
    assert first is not None and not psutil.pid_exists(first)


def test_a_module_that_starts_a_thread_at_import_is_left_to_the_ranks(project: Path) -> None:
    """A tracker-like module that starts a thread when imported: forking the template after that
    would copy a process with a thread in it, so the template is replaced by one without it."""
    write_module(project, "starts_a_thread", """
        import threading
        _stop = threading.Event()
        threading.Thread(target=_stop.wait, name="tracker-uploader", daemon=True).start()
        VERSION = "threaded"
        """)
    import starts_a_thread

    try:
        values = run_ranks(what_the_rank_found, ["starts_a_thread", "json"])
        assert [v["loaded"]["starts_a_thread"] for v in values.values()] == [False, False]
        assert run_ranks(version_of, "starts_a_thread") == {0: "threaded", 1: "threaded"}  # the rank imports it
        assert "starts_a_thread" in template.unsafe_packages()
        assert psutil.Process(running_helper_pid()).num_threads() >= 1
    finally:
        starts_a_thread._stop.set()


def test_an_import_that_fails_in_the_template_is_no_error(project: Path) -> None:
    write_module(project, "gone_from_disk", "VERSION = 1\n")
    import gone_from_disk  # noqa: F401

    (project / "gone_from_disk.py").unlink()  # the template cannot import it; the launch is fine
    values = run_ranks(what_the_rank_found, ["gone_from_disk"])
    assert [v["loaded"]["gone_from_disk"] for v in values.values()] == [False, False]


def test_a_stale_template_whose_session_runs_is_retired_until_the_session_ends(project: Path) -> None:
    write_module(project, "edited_during_a_session", "VERSION = 1\n")
    import edited_during_a_session

    with accelnb.Session.start(num_processes=2, cpu=True, quiet=True) as session:
        session_template = running_helper_pid()
        write_module(project, "edited_during_a_session", "VERSION = 2\n")
        importlib.reload(edited_during_a_session)
        assert run_ranks(version_of, "edited_during_a_session") == {0: 2, 1: 2}  # a new template
        assert running_helper_pid() != session_template
        assert session.run(version_of, args=("edited_during_a_session",)).values == {0: 1, 1: 1}  # its own, still
        assert psutil.pid_exists(session_template)
    shared_helper()  # the next look for a template closes the retired one
    assert not psutil.pid_exists(session_template) or psutil.Process(session_template).status() == psutil.STATUS_ZOMBIE


def test_a_killed_template_is_replaced_at_the_next_launch() -> None:
    killed = shared_helper().pid
    psutil.Process(killed).kill()
    psutil.Process(killed).wait(10)
    values = run_ranks(what_the_rank_found, [])
    assert {v["parent"] for v in values.values()} == {running_helper_pid()} != {killed}


def slow_import_source(flag: Path, seconds: float) -> str:
    """A module that, imported anywhere but in this process, says so in ``flag`` and takes ``seconds``."""
    return f"""
        import os, time
        if os.getpid() != {os.getpid()}:
            with open({str(flag)!r}, "a") as flag:
                flag.write(f"{{os.getpid()}}\\n")
            time.sleep({seconds})
        VERSION = "slow"
        """


def when_written(flag: Path, then: object) -> threading.Thread:
    """Run ``then(pid)`` in a thread as soon as ``flag`` names a process (the template importing)."""
    def watch() -> None:
        deadline = time.monotonic() + 120
        while not flag.exists() or not flag.read_text().strip():
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)
        then(int(flag.read_text().split()[0]))  # type: ignore[operator]

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_an_interrupt_while_the_launch_waits_for_the_template_leaves_nothing(project: Path) -> None:
    shared_helper()  # a ready template: the launch below waits only for its new import
    flag = project / "importing"
    write_module(project, "slow_to_import", slow_import_source(flag, 3.0))
    import slow_to_import  # noqa: F401

    watcher = when_written(flag, lambda pid: os.kill(os.getpid(), signal.SIGINT))
    with pytest.raises(accelnb.RunInterrupted):
        run_ranks(what_the_rank_found, ["slow_to_import"])
    watcher.join()
    template_pid = running_helper_pid()
    assert template_pid is not None and [p for p in psutil.Process(template_pid).children()
                                         if not is_standby(p)] == []  # no rank was forked
    found = run_ranks(what_the_rank_found, ["slow_to_import"])  # the same template, done importing
    assert [v["loaded"]["slow_to_import"] for v in found.values()] == [True, True]
    assert running_helper_pid() == template_pid


def test_the_template_killed_while_it_imports_is_replaced_within_the_launch(project: Path) -> None:
    shared_helper()
    flag = project / "importing"
    write_module(project, "slow_then_killed", slow_import_source(flag, 3.0))
    import slow_then_killed  # noqa: F401

    killed: list[int] = []
    watcher = when_written(flag, lambda pid: (killed.append(pid), os.kill(pid, signal.SIGKILL)))
    found = run_ranks(what_the_rank_found, ["slow_then_killed"])  # it died idle: nothing was lost, another serves
    watcher.join()
    assert killed and {v["parent"] for v in found.values()} == {running_helper_pid()} != {killed[0]}
    assert [v["loaded"]["slow_then_killed"] for v in found.values()] == [True, True]


def test_prewarm_waits_until_what_training_touches_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ACCELNB_TEMPLATE", "bare")  # bare templates too import it (the suite's)
    template.shutdown_helper()
    accelnb.prewarm(wait=True)
    found = run_ranks(what_the_rank_found, ["torch._dynamo", "accelerate"])
    assert [v["loaded"] for v in found.values()] == [{"torch._dynamo": True, "accelerate": True}] * 2


def test_torch_dynamo_comes_in_turns_that_each_import_only_what_it_imports_anyway() -> None:
    # Each turn must import cleanly in this order (a module imported out of its natural order can
    # meet a circular import: torch._functorch._aot_autograd.runtime_wrappers does), be new when
    # it comes (not imported by torch or an earlier turn), and be imported by torch._dynamo
    # anyway: else the list no longer matches the installed torch.
    probe = textwrap.dedent(f"""
        import importlib, sys
        import torch, torch.distributed
        import accelnb.worker.template.helper  # what a template has imported before it follows any
        from accelnb.worker.template.imports import install_rank_hooks
        install_rank_hooks()
        turns = {list(TORCH_DYNAMO_IN_TURNS)!r}
        already = [name for name in turns if name in sys.modules]
        for name in turns:
            assert name not in sys.modules, (name, "already imported by an earlier turn")
            importlib.import_module(name)
        print("already:", already)
        """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "already: []"
    dynamo_alone = textwrap.dedent(f"""
        import sys
        import torch, torch.distributed
        import torch._dynamo
        print([name for name in {list(TORCH_DYNAMO_IN_TURNS)!r} if name not in sys.modules])
        """)
    alone = subprocess.run([sys.executable, "-c", dynamo_alone], capture_output=True, text=True, timeout=240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert alone.stdout.strip() == "[]", "torch._dynamo no longer imports these: take them out of the turns"
    assert TORCH_DYNAMO_IN_TURNS[-1] == "torch._dynamo" and set(TORCH_DYNAMO_IN_TURNS) <= set(TRAINING_PREIMPORTS)


def test_the_template_empties_what_every_ranks_init_process_group_empties() -> None:
    # Importing torch._dynamo fills its trace-rule caches and torch's init_process_group empties
    # them; a rank that empties them frees a dict of ~2,800 torch functions, copying ~370 of the
    # template's pages. If either side changes in a torch release, this fails: then the template's
    # emptying (imports.empty_what_every_rank_empties) is to change or go.
    probe = textwrap.dedent("""
        import torch, torch.distributed as dist
        import torch._dynamo
        from accelnb.worker.template.imports import empty_what_every_rank_empties, import_quietly
        rules = torch._dynamo.trace_rules.get_torch_obj_rule_map
        sizes = {"imported": rules.cache_info().currsize}
        empty_what_every_rank_empties()
        sizes["emptied"] = rules.cache_info().currsize
        rules()
        assert import_quietly("wave")  # any import the template makes empties them after it
        sizes["after another import"] = rules.cache_info().currsize
        rules()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        sizes["after init_process_group"] = rules.cache_info().currsize
        print(sizes)
        """)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str({"imported": 1, "emptied": 0, "after another import": 0,
                                       "after init_process_group": 0}), done.stdout


def test_a_bare_template_leaves_the_kernels_modules_to_the_ranks(project: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    write_module(project, "not_followed", "VERSION = 'bare'\n")
    import not_followed  # noqa: F401

    monkeypatch.setenv("ACCELNB_TEMPLATE", "bare")
    values = run_ranks(what_the_rank_found, ["not_followed"])
    assert [v["loaded"]["not_followed"] for v in values.values()] == [False, False]
    assert run_ranks(version_of, "not_followed") == {0: "bare", 1: "bare"}  # each rank imports it
