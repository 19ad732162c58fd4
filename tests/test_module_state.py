"""Module-level state exists only where a process needs exactly one of a thing, and says so.

A name is module-level state when a function rebinds it (``global``), or when the module binds it
to something that changes: a lock, a list, a dict, a set, a counter, an event, a queue, an
instance. Each such name is named in its module's docstring (````_rank````), with why a process
has exactly one (a rank process is one rank; a kernel shows one run at a time). Constants
(UPPER_CASE, never rebound), loggers, compiled patterns, type aliases and sentinels are not state.

The scan reads the source, as the layout test does: a new ``_cache = {}`` fails here until its
module's docstring says what it is and why there is one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "accelnb"
SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "labextension" not in p.parts)

# Calls whose result never changes: not state.
UNCHANGING_CALLS = {"logging.getLogger", "TypeVar", "re.compile", "frozenset", "tuple", "object", "NewType",
                    "Path", "namedtuple", "MappingProxyType"}
CONTAINERS = (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)


def module_state(source: str) -> set[str]:
    """The module-level state names of a module's source (see the module docstring)."""
    tree = ast.parse(source)
    rebound = {name for node in ast.walk(tree) if isinstance(node, ast.Global) for name in node.names}
    found = set(rebound)
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = [t for t in node.targets if isinstance(t, ast.Name)], node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        changing = isinstance(value, CONTAINERS) or (
            isinstance(value, ast.Call) and ast.unparse(value.func).split("[")[0] not in UNCHANGING_CALLS)
        found.update(t.id for t in targets if changing and not t.id.isupper() and not t.id.startswith("__"))
    return found


def test_the_scan_sees_state_and_leaves_constants() -> None:
    source = ("import threading, logging\nLIMITS = {'a': 1}\n_log = logging.getLogger(__name__)\n"
              "_lock = threading.Lock()\n_seen = []\n_current = None\nT = 3\n"
              "def set_it(v):\n    global _current\n    _current = v\n")
    assert module_state(source) == {"_lock", "_seen", "_current"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_level_state_is_named_in_its_module_docstring(path: Path) -> None:
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source)) or ""
    unnamed = sorted(name for name in module_state(source) if f"``{name}``" not in docstring)
    assert not unnamed, (f"{path.relative_to(PACKAGE.parent)} keeps {unnamed} at module level: say in its "
                         "docstring why a process has exactly one (or keep it in an object that is passed)")
