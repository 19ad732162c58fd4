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

IMPORT_EACH = """
import importlib, json, sys
sys.path.insert(0, sys.argv[1])
heavy = {}
for name in json.loads(sys.argv[2]):
    importlib.import_module(name)
    loaded = [m for m in json.loads(sys.argv[3]) if m in sys.modules]
    if loaded:
        heavy[name] = loaded
        break
print(json.dumps(heavy))
"""


def test_no_test_module_that_ranks_import_pulls_in_the_notebook_libraries() -> None:
    names = sorted(p.stem for p in TESTS.glob("test_*.py") if p.stem not in MAY_IMPORT_NOTEBOOK_LIBRARIES)
    assert "test_launcher" in names and "test_metrics" in names
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(TESTS), json.dumps(names), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == {}, (
        "this test module imports a notebook library at its top; import it inside the function that needs it")


def test_the_check_sees_a_module_that_does() -> None:
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, str(TESTS), json.dumps(["test_install"]),
                           json.dumps(HEAVY)], capture_output=True, text=True, timeout=120, check=True)
    assert "jsonschema" in json.loads(done.stdout.splitlines()[-1])["test_install"]


def test_every_test_module_has_a_name_of_its_own() -> None:
    # pytest imports test modules by their base name (no __init__.py here): two test_x.py in two
    # folders make the collection of the whole suite fail, though each folder passes alone.
    modules = sorted(path.name for path in TESTS.rglob("test_*.py"))
    assert len(modules) == len(set(modules)), [name for name in set(modules) if modules.count(name) > 1]
