"""One description of a launch's options: checked once, refused by name, the same everywhere.

Bad options must fail before anything starts, so the tests that go through the launcher assert
that no worker exists afterwards (``no_leftovers`` and ``worker_processes()``), not only that an
exception came.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import typing
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

import accelnb
from accelnb import LaunchConfigError, Session, launch, notebook_launcher, synthetic_inventory
from accelnb import launcher as launcher_module
from accelnb.cluster import ClusterRequest
from accelnb.kernel.planning.rank_environment import RankOptions
from accelnb.kernel.planning.worker_specs import threads_per_rank
from accelnb.kernel.run.call_settings import CallSettings
from accelnb.kernel.watched_state.selection import clear_selection, set_selection
from accelnb.options import (
    ALL_OPTIONS,
    CALL_OPTIONS,
    LAUNCH_OPTIONS,
    MIXED_PRECISION_MODES,
    RESTART_OPTIONS,
    SESSION_CALL_OPTIONS,
    START_OPTIONS,
    CallKeywords,
    LaunchKeywords,
    LaunchOptions,
    RestartKeywords,
    SessionCallKeywords,
    SettledOptions,
    StartKeywords,
    described_fields,
    keyword_names,
    names_in_scope,
    settle,
)
from tests.conftest import worker_processes

pytestmark = pytest.mark.usefixtures("no_leftovers")


def rank_and_threads() -> tuple[int, int, str]:
    import torch
    import torch.distributed as dist

    return dist.get_rank(), torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


# ── each value is checked when the options are built ────────────────────────────────────────
@pytest.mark.parametrize(("given", "message"), [
    ({"num_processes": 0}, "num_processes must be at least 1, got 0."),
    ({"num_processes": "2"}, "num_processes must be an integer, got '2'."),
    ({"num_processes": True}, "num_processes must be an integer, got True."),
    ({"timeout": 0}, "timeout must be a positive number of seconds, got 0."),
    ({"timeout": float("nan")}, "timeout must be a positive number of seconds, got nan."),
    ({"timeout": "5"}, "timeout must be a positive number of seconds, got '5'."),
    ({"output": "everything"}, "output='everything' must be 'rank0', 'all' or 'none'."),
    ({"collect": "some"}, "collect='some' must be 'rank0' or 'all'."),
    ({"mixed_precision": "fp32"}, "mixed_precision='fp32' must be 'no', 'fp16', 'bf16' or 'fp8'."),
    ({"backend": "ncl"}, "backend='ncl' must be 'gloo', 'nccl', 'mpi', 'ucc', 'xccl' or 'hccl' "
                         "(nccl for GPUs, gloo for CPU, or leave it unset to choose automatically)."),
    ({"master_port": 0}, "master_port must be a port number from 1 to 65535, got 0."),
    ({"master_port": 65536}, "master_port must be a port number from 1 to 65535, got 65536."),
    ({"master_port": "29500"}, "master_port must be a port number from 1 to 65535, got '29500'."),
    ({"gpus": True}, "gpus=True is not a GPU selection"),
    ({"gpus": [0, 1.5]}, "gpus=[0, 1.5] is not a GPU selection"),
    ({"cpu": "yes"}, "cpu must be True or False, got 'yes'."),
    ({"quiet": 1}, "quiet must be True or False, got 1."),
    ({"inventory": "8 GPUs"}, "inventory must be an accelnb Inventory"),
    ({"cpu": True, "gpus": "0"}, "cpu=True runs CPU ranks; do not also pass gpus=."),
    ({"cpu": True}, "cpu=True needs num_processes=N"),
])
def test_a_bad_value_is_refused_when_the_options_are_built(given: dict[str, Any], message: str) -> None:
    with pytest.raises(LaunchConfigError) as refused:
        LaunchOptions(**given)
    assert message in str(refused.value)


def test_every_mixed_precision_mode_of_accelerate_is_accepted_fp8_included() -> None:
    assert "fp8" in MIXED_PRECISION_MODES
    for mode in MIXED_PRECISION_MODES:
        assert LaunchOptions(mixed_precision=mode).mixed_precision == mode


ENTRY_POINTS: dict[str, Callable[..., Any]] = {
    "notebook_launcher()": lambda **kw: notebook_launcher(print, num_processes=2, cpu=True, **kw),
    "launch()": lambda **kw: launch(print, num_processes=2, cpu=True, **kw),
    "plan()": lambda **kw: accelnb.plan(num_processes=2, inventory=synthetic_inventory(0), **kw),
    "Session.start()": lambda **kw: Session.start(num_processes=2, cpu=True, **kw),
}


@pytest.mark.parametrize("caller", ENTRY_POINTS)
def test_a_misspelt_option_is_refused_with_a_suggestion_before_anything_starts(caller: str) -> None:
    with pytest.raises(LaunchConfigError) as refused:
        ENTRY_POINTS[caller](gpu="0")
    assert str(refused.value).startswith(f"{caller} got an unknown option 'gpu'; did you mean 'gpus'?")
    assert worker_processes() == []


@pytest.mark.parametrize("caller", ENTRY_POINTS)
def test_a_bad_value_fails_before_anything_starts(caller: str) -> None:
    with pytest.raises(LaunchConfigError, match="master_port must be a port number from 1 to 65535, got 0"):
        ENTRY_POINTS[caller](master_port=0)
    assert worker_processes() == []


def test_an_option_of_the_wrong_scope_says_where_it_belongs() -> None:
    with pytest.raises(LaunchConfigError, match=r"^Session.start\(\) does not take timeout=: it applies to "
                                                r"each call \(pass it to Session.run"):
        Session.start(num_processes=2, timeout=5)  # type: ignore[call-arg]
    with pytest.raises(LaunchConfigError, match=r"^launch\(\) does not take ranks=: it chooses ranks of a "
                                                r"running session \(pass it to Session.run"):
        launch(os.getpid, num_processes=2, ranks=[1])  # type: ignore[call-arg]
    assert worker_processes() == []
    with Session.start(num_processes=2, cpu=True, quiet=True) as session:
        with pytest.raises(LaunchConfigError, match=r"^Session.run\(\) does not take gpus=: it places the "
                                                    r"ranks, so it is fixed when the workers start"):
            session.run(os.getpid, gpus="0")  # type: ignore[call-arg]
        assert session.alive  # a refused call leaves the session as it was
        assert sorted(session.run(os.getpid).values) == [0, 1]


# ── one description: the keyword dictionaries, signatures and docs follow the dataclass ────
def test_the_keyword_dictionaries_spell_the_dataclass_fields_with_the_same_types() -> None:
    declared = {each.name: each.type for each in fields(LaunchOptions)}
    for keywords in (StartKeywords, CallKeywords, SessionCallKeywords, RestartKeywords, LaunchKeywords):
        hints = {name: ref.__forward_arg__ if isinstance(ref, typing.ForwardRef) else ref
                 for name, ref in keywords.__annotations__.items()}
        assert hints == {name: declared[name] for name in keyword_names(keywords)}, keywords.__name__
    assert names_in_scope("start") == START_OPTIONS and names_in_scope("call") == CALL_OPTIONS
    assert names_in_scope("launch") == RESTART_OPTIONS
    assert names_in_scope("session") == SESSION_CALL_OPTIONS - CALL_OPTIONS
    assert set(declared) == ALL_OPTIONS == LAUNCH_OPTIONS | SESSION_CALL_OPTIONS
    assert keyword_names(LaunchKeywords) == LAUNCH_OPTIONS - {"num_processes"}  # positional there


@pytest.mark.parametrize(("function", "names", "collect"), [
    (notebook_launcher, LAUNCH_OPTIONS, "rank0"),  # its value is rank 0's: the others stay on the ranks
    (launch, LAUNCH_OPTIONS, "all"),
    (accelnb.plan, START_OPTIONS, None),
    (Session.start, START_OPTIONS, None),
    (Session.run, SESSION_CALL_OPTIONS, "all"),
])
def test_signatures_and_docstrings_list_every_option_they_take(function: Callable[..., Any], names: set[str],
                                                               collect: str | None) -> None:
    parameters = inspect.signature(function).parameters
    assert names <= set(parameters) and not any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    defaults = LaunchOptions()
    for name in names - {"collect"}:
        assert parameters[name].default == getattr(defaults, name), name
    if collect is not None:
        assert parameters["collect"].default == collect
    doc = inspect.getdoc(function) or ""
    keyword_args = doc.split("Keyword Args:")[1]
    for each, info in described_fields():
        if each.name == "num_processes" and function in (notebook_launcher, launch):
            assert "num_processes" in doc.split("Keyword Args:")[0]  # under Args: a positional parameter there
        elif each.name in names:
            assert f"\n    {each.name}: {info.help.split()[0]}" in keyword_args, each.name


# ── the kernel's environment is read with the options, before anything starts ──────────────
def test_omp_num_threads_with_nested_levels_gives_each_rank_the_first_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3,2")  # legal OpenMP: 3 threads, 2 in nested regions
    assert threads_per_rank(2) == 3
    values = launch(rank_and_threads, num_processes=2, cpu=True, quiet=True).values
    assert values == {0: (0, 3, "3,2"), 1: (1, 3, "3,2")}


@pytest.mark.parametrize("garbage", ["abc", "0", "-2", ",4"])
def test_a_garbage_omp_num_threads_is_a_clear_error_before_anything_starts(
        garbage: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", garbage)
    for start in (lambda: launch(rank_and_threads, num_processes=2, cpu=True, quiet=True),
                  lambda: Session.start(num_processes=2, cpu=True, quiet=True)):
        with pytest.raises(LaunchConfigError) as refused:
            start()
        message = str(refused.value)
        assert message.startswith(f"OMP_NUM_THREADS={garbage!r} in the kernel's environment is not a thread count")
        assert '"4,2"' in message and "del os.environ['OMP_NUM_THREADS']" in message
        assert worker_processes() == []


def test_without_omp_num_threads_the_cores_are_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads_per_rank(1) == max(1, os.cpu_count() or 1)
    assert threads_per_rank(4 * (os.cpu_count() or 1)) == 1


# ── settled once, passed whole: the views the kernel and the cluster read are filled by name ──
SETTLED_PROPERTIES = {name for name, value in vars(SettledOptions).items() if isinstance(value, property)}


@pytest.mark.parametrize("view", [RankOptions, ClusterRequest, CallSettings])
def test_a_view_of_the_settled_options_names_options_with_their_defaults(view: type) -> None:
    """A view's field is filled by its name: an option (with the option's default), or a value
    settling derives. A misspelt or drifted field fails here, not in a launch."""
    options = {each.name: each for each in fields(LaunchOptions)}
    plain = settle(LaunchOptions(cluster="ray"))
    for each in fields(view):
        assert each.name in options or each.name in SETTLED_PROPERTIES, f"{view.__name__}.{each.name}"
        if each.name in options:
            assert each.type == options[each.name].type, each.name
        settled_value = getattr(plain.options if each.name in options else plain, each.name)
        if each.default is not dataclasses.MISSING:
            assert settled_value == each.default, each.name
        elif each.default_factory is not dataclasses.MISSING:
            assert settled_value == each.default_factory(), each.name


def test_the_cluster_request_is_the_settled_options_whole_not_copied_by_hand(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[ClusterRequest] = []

    class Backend:
        def check(self, request: ClusterRequest) -> None:
            asked.append(request)

        def start(self, request: ClusterRequest, *, persistent: bool, restart_count: int) -> Any:
            raise AssertionError("nothing starts in this test")

    monkeypatch.setattr(launcher_module, "cluster_backend", lambda kind: Backend())
    settled = settle(LaunchOptions(cluster="ray", num_processes=4, nodes=2, backend="gloo", mixed_precision="bf16",
                                   quiet=True))
    launcher_module.group_starter(settled, persistent=False)
    assert asked == [settled.view(ClusterRequest)] == [ClusterRequest(
        num_processes=4, nodes=2, gpus_per_node=None, backend="gloo", quiet=True,
        rank_options=RankOptions(mixed_precision="bf16"))]


def test_the_pickers_selection_is_settled_once_and_a_session_keeps_it() -> None:
    set_selection(gpus=[1, 3])
    try:
        settled = settle(LaunchOptions(inventory=synthetic_inventory(4)))
        assert settled.options.gpus == settled.given.gpus == (1, 3)
        assert settle(LaunchOptions(num_processes=2)).options.gpus is None  # devices given: no picker
        set_selection(num_processes=2)  # the picker's "CPU ranks": CPU ranks, also where GPUs are
        cpu_ranks = settle(LaunchOptions(inventory=synthetic_inventory(4), quiet=True))
        assert (cpu_ranks.options.cpu, cpu_ranks.options.num_processes, cpu_ranks.options.gpus) == (True, 2, None)
        assert [rank.gpu for rank in launcher_module.plan_launch(cpu_ranks).ranks] == [None, None]
        set_selection()  # chose nothing: every visible GPU, as without a selection
        assert settle(LaunchOptions(inventory=synthetic_inventory(4))).options.cpu is False
        set_selection(gpus=[1, 3])
        with Session.start_with(LaunchOptions(inventory=synthetic_inventory(4), quiet=True)) as session:
            set_selection(gpus=[0])  # a change of the picker does not move a running session's ranks
            assert session.options.gpus == (1, 3) and [r.gpu.index for r in session.plan.ranks if r.gpu] == [1, 3]
    finally:
        clear_selection()


def attribute_reads_outside_the_options_module() -> set[str]:
    """Every name read as an attribute (``x.name``) in accelnb's code, ``accelnb/options.py`` left out."""
    package = Path(accelnb.__file__).parent
    read: set[str] = set()
    for path in package.rglob("*.py"):
        if path == package / "options.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                read.add(node.attr)
    return read


def test_every_option_reaches_a_use_outside_its_declaration() -> None:
    """An option is read by name from a view of the settled options (RankOptions, ClusterRequest,
    CallSettings) or by code outside options.py; one declared and wired to nothing fails here."""
    in_views = {each.name for view in (RankOptions, ClusterRequest, CallSettings) for each in fields(view)}
    read = attribute_reads_outside_the_options_module()
    declared = [each.name for each in fields(LaunchOptions)]
    assert not [name for name in declared if name not in in_views and name not in read]
    assert "an_option_nothing_reads" not in read  # the scan can tell


@pytest.mark.parametrize(("given", "why"), [
    ({"gpus": "0"}, "on a cluster Ray assigns them"),
    ({"master_port": 29500}, "chosen free on rank 0's node"),
    ({"config_file": "default"}, "as keywords instead"),
])
def test_a_cluster_launch_refuses_what_describes_this_machine_saying_why(given: dict[str, Any], why: str) -> None:
    with pytest.raises(LaunchConfigError, match=rf"cluster='ray' does not take {next(iter(given))}=: .*{why}"):
        LaunchOptions(cluster="ray", **given)
