"""The package's folders say where code runs, and the imports between them only go one way.

- ``accelnb.wire``: what crosses the pipe; imports only itself and ``accelnb.errors``;
- ``accelnb.worker``: runs in the helper and the ranks; imports only ``wire``, ``errors`` and itself;
- ``accelnb.kernel``: runs in the notebook's kernel; never imports ``worker``, ``notebook`` or the
  top-level API modules above it;
- ``accelnb.cluster``: cluster backends, run in the kernel; import ``kernel``, ``wire`` and, of the worker
  side, only the module that is a cluster rank's body (its actors run it);
- ``accelnb.notebook``: the UI adapters; may import anything below it.

Every ``import`` is read from the source, function-level ones included (a lazy import is still a
dependency); imports under ``if TYPE_CHECKING:`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "accelnb"

ALLOWED: dict[str, tuple[str, ...]] = {
    "accelnb.wire": ("accelnb.wire", "accelnb.errors"),
    "accelnb.worker": ("accelnb.worker", "accelnb.wire", "accelnb.errors"),
    "accelnb.kernel": ("accelnb.kernel", "accelnb.wire", "accelnb.errors"),
    "accelnb.cluster": ("accelnb.cluster", "accelnb.kernel", "accelnb.wire", "accelnb.worker.ray_rank",
                        "accelnb.errors"),
    "accelnb.errors": (),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_imports(source: str) -> set[str]:
    """Every accelnb name a module's source imports at run time (modules and the names in them)."""
    tree = ast.parse(source)
    type_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(child) for child in ast.walk(node) if child is not node.test)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "accelnb uses absolute imports only, so that this walk sees them"
            found.add(node.module or "")
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "accelnb" or name.startswith("accelnb.")}


def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:])
    return (PACKAGE / relative).with_suffix(".py").exists() or (PACKAGE / relative / "__init__.py").exists()


def _violations(module: str, source: str) -> list[str]:
    rule = next((prefix for prefix in ALLOWED if module == prefix or module.startswith(prefix + ".")), None)
    if rule is None:
        return []  # the top level and notebook/ may import what lies below them
    imported = {name for name in _runtime_imports(source) if _is_module(name)}
    return sorted(name for name in imported
                  if not any(name == ok or name.startswith(ok + ".") for ok in ALLOWED[rule]))


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "labextension" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    module = _module_name(path)
    wrong = _violations(module, path.read_text())
    assert not wrong, f"{module} must not import {wrong}"


def test_every_module_lives_in_a_folder_that_says_where_it_runs() -> None:
    top_level = sorted(p.stem for p in PACKAGE.glob("*.py"))
    assert top_level == ["__init__", "demo", "errors", "launcher", "options", "session"], top_level
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == ["cluster", "kernel", "notebook", "wire", "worker"]


@pytest.mark.parametrize(("module", "source"), [
    ("accelnb.worker.main", "def f():\n    from accelnb.kernel import output\n"),
    ("accelnb.worker.main", "import accelnb.notebook.magic\n"),
    ("accelnb.kernel.runs", "from accelnb.notebook.metrics_view import LiveMetricsView\n"),
    ("accelnb.kernel.runs", "from accelnb import launcher\n"),
    ("accelnb.wire.events", "from accelnb.kernel.planning import plan\n"),
])
def test_the_walk_catches_a_wrong_import(module: str, source: str) -> None:
    assert _violations(module, source)


def test_type_checking_imports_are_annotations_only() -> None:
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from accelnb.kernel import output\n"
    assert _violations("accelnb.worker.main", source) == []
