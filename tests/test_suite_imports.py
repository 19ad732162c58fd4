"""The test modules stay cheap for a rank to import.

A function defined at the top of a test module travels to the ranks by reference, so every rank
of such a launch imports the test module, and with it whatever the module and ``conftest.py``
import. nbformat brings jsonschema, whose format checker builds a grammar at import time: on two
busy cores that was 10 to 15 s per launch, in dozens of tests. Only the modules below, whose
ranks never import them, may import it at the top.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Their launches run cells in a kernel or a fresh venv; no rank imports these modules.
MAY_IMPORT_NOTEBOOK_LIBRARIES = {"test_install", "test_ray_cluster"}
HEAVY = ("jsonschema", "nbformat", "nbclient")

# A module that skips itself at import (pytest.skip(allow_module_level=True), as test_packaging does
# where accelnb runs from its source) is left out: no rank can import it there either.
IMPORT_EACH = """
import importlib, json, sys
import pytest
sys.path.insert(0, sys.argv[1])
heavy = {}
for name in json.loads(sys.argv[2]):
    try:
        importlib.import_module(name)
    except pytest.skip.Exception:
        continue
    loaded = [m for m in json.loads(sys.argv[3]) if m in sys.modules]
    if loaded:
        heavy[name] = loaded
        break
print(json.dumps(heavy))
"""


def heavy_imports(folder: Path, modules: list[str]) -> dict[str, list[str]]:
    """The first of ``modules`` (in ``folder``) whose import loads a notebook library, in a fresh Python."""
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(folder), json.dumps(modules), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"importing the test modules failed:\n{done.stderr[-3000:]}"
    result: dict[str, list[str]] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_no_test_module_that_ranks_import_pulls_in_the_notebook_libraries() -> None:
    names = sorted(p.stem for p in TESTS.glob("test_*.py") if p.stem not in MAY_IMPORT_NOTEBOOK_LIBRARIES)
    assert "test_launcher" in names and "test_metrics" in names
    assert heavy_imports(TESTS, names) == {}, (
        "this test module imports a notebook library at its top; import it inside the function that needs it")


def test_the_check_sees_a_module_that_does(tmp_path: Path) -> None:
    (tmp_path / "test_light.py").write_text("import json\n")
    (tmp_path / "test_skipped.py").write_text("import pytest\npytest.skip('not here', allow_module_level=True)\n")
    (tmp_path / "test_heavy.py").write_text("import nbformat\n")
    found = heavy_imports(tmp_path, ["test_light", "test_skipped", "test_heavy"])
    assert list(found) == ["test_heavy"] and "jsonschema" in found["test_heavy"], found


def test_every_test_module_has_a_name_of_its_own() -> None:
    # pytest imports test modules by their base name (no __init__.py here): two test_x.py in two
    # folders make the collection of the whole suite fail, though each folder passes alone.
    modules = sorted(path.name for path in TESTS.rglob("test_*.py"))
    assert len(modules) == len(set(modules)), [name for name in set(modules) if modules.count(name) > 1]
