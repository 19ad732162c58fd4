"""The package's folders say where code runs, and the imports between them only go one way.

- ``accelnb.wire``: what crosses the pipe; imports only itself and ``accelnb.errors``;
- ``accelnb.worker``: runs in the helper and the ranks; imports only ``wire``, ``errors`` and itself;
- ``accelnb.kernel``: runs in the notebook's kernel, one sub-package per family (``planning``,
  ``run``, ``helper``, ``doctor``, ``stacks``, ``display``); never imports ``worker``, ``notebook``
  or the top-level API modules above it;
- ``accelnb.cluster``: cluster backends, run in the kernel; import ``kernel``, ``wire`` and, of the worker
  side, only the module that is a cluster rank's body (its actors run it);
- ``accelnb.errors``: every exception; imports nothing of accelnb;
- ``accelnb.options``: the start options, settled before anything runs; reads only the planning
  pieces of the kernel (and the ``output=`` choices of the engine);
- ``accelnb.launcher`` and ``accelnb.session``: the API; import the kernel, and the launcher wires in
  the cluster backends and the notebook's live chart (the one place the UI is plugged in);
- ``accelnb.notebook``: the UI adapters; may import anything below it (of the worker side, only the
  cell contract its magic shares with the ranks); nothing but the API imports it;
- ``accelnb`` itself: the public API, gathered from everywhere; ``accelnb.demo`` uses only that API.

Every ``import`` is read from the source, function-level ones included (a lazy import is still a
dependency); imports under ``if TYPE_CHECKING:`` are annotations only and are not counted. The same
imports, file to file, must not form a cycle, and no folder holds more than
:data:`MAX_MODULES_PER_FOLDER` modules.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping, Set
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "accelnb"
MAX_MODULES_PER_FOLDER = 15

# A rule names a module or a folder (it covers everything below that folder) and what it may import.
# ``"accelnb"`` means the package's own ``__init__`` (the public API), never "all of accelnb".
ALLOWED: dict[str, tuple[str, ...]] = {
    "accelnb.wire": ("accelnb.wire", "accelnb.errors"),
    "accelnb.worker": ("accelnb.worker", "accelnb.wire", "accelnb.errors"),
    "accelnb.kernel": ("accelnb.kernel", "accelnb.wire", "accelnb.errors"),
    "accelnb.cluster": ("accelnb.cluster", "accelnb.kernel", "accelnb.wire", "accelnb.worker.ray_rank",
                        "accelnb.errors"),
    "accelnb.errors": (),
    "accelnb.options": ("accelnb.errors", "accelnb.wire", "accelnb.kernel.planning", "accelnb.kernel.watched_state",
                        "accelnb.kernel.run.call_settings"),  # OutputMode, CollectMode: the choices
    "accelnb.launcher": ("accelnb.options", "accelnb.errors", "accelnb.wire", "accelnb.kernel", "accelnb.cluster",
                         "accelnb.notebook.metrics_view"),  # the live chart, wired in lazily when a run reports
    "accelnb.other_launchers": ("accelnb.launcher", "accelnb.options", "accelnb.errors", "accelnb.wire",
                                "accelnb.kernel"),
    "accelnb.session": ("accelnb.launcher", "accelnb.options", "accelnb.errors", "accelnb.wire", "accelnb.kernel"),
    "accelnb.sweeper": ("accelnb.launcher", "accelnb.options", "accelnb.errors", "accelnb.wire", "accelnb.kernel",
                        "accelnb.notebook.sweep_table"),  # the live table, wired in lazily as the launcher's chart
    # No worker module: the cell contract %%distributed shares with the ranks is wire/cell_contract.
    "accelnb.notebook": ("accelnb.notebook", "accelnb.launcher", "accelnb.other_launchers", "accelnb.session",
                         "accelnb.sweeper",
                         "accelnb.options",
                         "accelnb.errors", "accelnb.wire", "accelnb.kernel"),
    "accelnb": ("accelnb.errors", "accelnb.kernel", "accelnb.launcher", "accelnb.other_launchers", "accelnb.session",
                "accelnb.sweeper",
                "accelnb.notebook",
                "accelnb.worker"),  # worker: the API a rank calls (report, progress, restart_count, ...)
    "accelnb.demo": ("accelnb",),
}

def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_import_nodes(source: str) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module's source that runs (function-level ones too)."""
    tree = ast.parse(source)
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(child) for child in ast.walk(node) if child is not node.test)
    for node in ast.walk(tree):
        if id(node) not in type_only and isinstance(node, (ast.Import, ast.ImportFrom)):
            if isinstance(node, ast.ImportFrom):
                assert node.level == 0, "accelnb uses absolute imports only, so that this walk sees them"
            yield node


def _is_ours(name: str) -> bool:
    return name == "accelnb" or name.startswith("accelnb.")


def _runtime_imports(source: str) -> set[str]:
    """Every accelnb name a module's source imports at run time (modules and the names in them)."""
    found: set[str] = set()
    for node in _runtime_import_nodes(source):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if _is_ours(name)}


def _imported_files(source: str) -> set[str]:
    """The accelnb modules a source depends on, file to file: ``from a.b import c`` is ``a.b.c`` when
    that is a module, else ``a.b`` (the parent packages that Python imports on the way are left out)."""
    found: set[str] = set()
    for node in _runtime_import_nodes(source):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        else:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if _is_module(submodule) else node.module or "")
    return {name for name in found if _is_ours(name) and _is_module(name)}


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


def _covers(prefix: str, name: str) -> bool:
    return name == prefix or (prefix != "accelnb" and name.startswith(prefix + "."))


def _rule(module: str) -> str | None:
    """The most specific rule for a module: its own, else its folder's."""
    return max((prefix for prefix in ALLOWED if _covers(prefix, module)), key=len, default=None)


def _violations(module: str, source: str) -> list[str]:
    rule = _rule(module)
    assert rule is not None, f"{module} has no rule in ALLOWED"
    imported = {name for name in _runtime_imports(source) if _is_module(name)}
    return sorted(name for name in imported if not any(_covers(ok, name) for ok in ALLOWED[rule]))


def _find_cycle(graph: Mapping[str, Set[str]]) -> list[str] | None:
    """One import cycle, as the path that closes it (``[a, b, a]``), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(node: str) -> list[str] | None:
        path.append(node)
        on_path.add(node)
        for target in sorted(graph.get(node, ())):
            if target in on_path:
                return [*path[path.index(target):], target]
            if target not in done and (cycle := visit(target)) is not None:
                return cycle
        path.pop()
        on_path.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done and (cycle := visit(start)) is not None:
            return cycle
    return None


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "labextension" not in p.parts)
GRAPH = {_module_name(path): _imported_files(path.read_text()) for path in SOURCES}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    module = _module_name(path)
    wrong = _violations(module, path.read_text())
    assert not wrong, f"{module} must not import {wrong}"


def test_every_module_lives_in_a_folder_that_says_where_it_runs() -> None:
    top_level = sorted(p.stem for p in PACKAGE.glob("*.py"))
    # The public entry points (launcher, other_launchers, session, sweeper, demo) and what they share (options, errors).
    assert top_level == ["__init__", "demo", "errors", "launcher", "options", "other_launchers", "session",
                         "sweeper"], top_level
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["cluster", "kernel", "notebook", "wire", "worker"]


def test_every_module_has_a_rule() -> None:
    assert [_module_name(path) for path in SOURCES if _rule(_module_name(path)) is None] == []


def test_kernel_code_lives_in_a_family_folder() -> None:
    loose = sorted(p.name for p in (PACKAGE / "kernel").glob("*.py") if p.name != "__init__.py")
    assert loose == [], "put a kernel module in the folder of its family (see accelnb/kernel/__init__.py)"


def test_no_folder_holds_more_than_15_modules() -> None:
    folders = {path.parent for path in SOURCES}
    sizes = {str(folder.relative_to(PACKAGE.parent)): len([p for p in folder.glob("*.py") if p.name != "__init__.py"])
             for folder in folders}
    crowded = {folder: size for folder, size in sizes.items() if size > MAX_MODULES_PER_FOLDER}
    assert crowded == {}, f"split these folders by family: {crowded}"


def test_no_import_cycle_between_files() -> None:
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def _kernel_family(module: str) -> str | None:
    """``run`` for ``accelnb.kernel.run.group.call_protocol``; None outside ``accelnb.kernel``."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[:2] == ["accelnb", "kernel"] else None


def test_no_two_kernel_families_import_each_other() -> None:
    # Each family (planning, helper, run, display, ...) sits above the ones it imports; a loop of
    # families means no one can read one of them without the others.
    families: dict[str, set[str]] = {}
    for module, imported in GRAPH.items():
        source = _kernel_family(module)
        if source is not None:
            families.setdefault(source, set()).update(
                target for name in imported if (target := _kernel_family(name)) not in (None, source))
    cycle = _find_cycle(families)
    assert cycle is None, "kernel families import each other: " + " -> ".join(cycle or [])


def test_the_cycle_check_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"b", "d"}, "d": set()}
    assert _find_cycle(graph) == ["b", "c", "b"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
    lazy = _imported_files("def f():\n    from accelnb.kernel.run import engine\n")
    assert lazy == {"accelnb.kernel.run.engine"}, "a function-level import is an edge, to the file it names"


@pytest.mark.parametrize(("module", "source"), [
    ("accelnb.worker.main", "def f():\n    from accelnb.kernel.display import output\n"),
    ("accelnb.worker.main", "import accelnb.notebook.magic\n"),
    ("accelnb.kernel.run.engine", "from accelnb.notebook.metrics_view import LiveMetricsView\n"),
    ("accelnb.kernel.run.engine", "from accelnb import launcher\n"),
    ("accelnb.kernel.doctor.checks", "import accelnb.session\n"),
    ("accelnb.wire.events", "from accelnb.kernel.planning.rank_plan import plan\n"),
    ("accelnb.errors", "from accelnb.wire.events import RunCall\n"),
    ("accelnb.options", "from accelnb.launcher import launch\n"),
    ("accelnb.options", "def f():\n    from accelnb.kernel.run.supervisor import WorkerGroup\n"),
    ("accelnb.launcher", "from accelnb.notebook.magic import DistributedMagics\n"),
    ("accelnb.launcher", "from accelnb.worker.main import main\n"),
    ("accelnb.session", "from accelnb.notebook.panel import Panel\n"),
    ("accelnb.session", "from accelnb.cluster import cluster_backend\n"),
    ("accelnb.sweeper", "from accelnb.notebook.panel import Panel\n"),
    ("accelnb.kernel.sweep.scheduler", "from accelnb.sweeper import sweep\n"),
    ("accelnb.notebook.magic", "from accelnb.worker.main import main\n"),
    ("accelnb.notebook.panel", "from accelnb.cluster import cluster_backend\n"),
    ("accelnb.demo", "from accelnb.kernel.run.engine import start_workers\n"),
    ("accelnb", "from accelnb.cluster import cluster_backend\n"),
])
def test_the_walk_catches_a_wrong_import(module: str, source: str) -> None:
    assert _violations(module, source)


@pytest.mark.parametrize(("module", "source"), [
    ("accelnb.demo", "import accelnb\n"),
    ("accelnb", "def f():\n    from accelnb.notebook.magic import DistributedMagics\n"),
    ("accelnb.notebook.magic", "from accelnb.session import Session\n"),
    ("accelnb.options", "from accelnb.kernel.planning.inventory import Inventory\n"),
])
def test_the_walk_lets_a_right_import_through(module: str, source: str) -> None:
    assert _violations(module, source) == []


def test_type_checking_imports_are_annotations_only() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from accelnb.kernel.display import output\n"
    assert _violations("accelnb.worker.main", source) == []


# ── what a rank loads at run time ──────────────────────────────────────────────────────────────
KERNEL_SIDE = ("accelnb.kernel", "accelnb.notebook", "accelnb.launcher", "accelnb.session", "accelnb.options",
               "accelnb.cluster", "ipywidgets", "ipykernel", "IPython")

RANK_MODULES_SCRIPT = """
import json, sys
import accelnb

def kernel_side_modules(prefixes):
    import sys
    return sorted(m for m in sys.modules if m.startswith(tuple(prefixes)) and (m in prefixes or m.startswith(
        tuple(p + "." for p in prefixes))))

result = accelnb.launch(kernel_side_modules, args=(sys.argv[1:],), num_processes=2, cpu=True, quiet=True)
print(json.dumps({"ranks": {str(rank): value for rank, value in result.values.items()},
                  "caller": sorted(m for m in sys.modules if m.startswith("accelnb.kernel"))[:3]}))
"""


def test_a_rank_loads_no_kernel_or_notebook_code(tmp_path: Path) -> None:
    """Real ranks forked by a template that follows a plain script's imports: nothing of the kernel's side
    is in their ``sys.modules`` (the caller's side did load it, so the test can tell)."""
    import json
    import os
    import subprocess
    import sys

    script = tmp_path / "launch.py"
    script.write_text(RANK_MODULES_SCRIPT)
    env = {**os.environ, "ACCELNB_TEMPLATE": "on",  # the template follows the script, less accelnb itself
           "PYTHONPATH": os.pathsep.join(p for p in (str(PACKAGE.parent), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run([sys.executable, str(script), *KERNEL_SIDE], capture_output=True, text=True, env=env,
                          cwd=str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["caller"], "the launching process loads the kernel's modules: the check below can fail"
    assert seen["ranks"] == {"0": [], "1": []}, seen["ranks"]
