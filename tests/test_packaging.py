"""What `pip install` gives a user: the JupyterLab extension, installed and enabled, no npm step.

The test suite runs from the venv that ``scripts/setup`` made with ``pip install -e .``; the
extension must be there as JupyterLab finds it, with the settings schema that puts the GPUs item
on every notebook's toolbar. ``tests/test_install.py`` checks the same schema in an environment
that a wheel of this checkout was installed into.
"""

from __future__ import annotations

import importlib.metadata
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jupyter_core.paths
import pytest

try:
    importlib.metadata.distribution("accelnb")
except importlib.metadata.PackageNotFoundError:  # the source on PYTHONPATH, as on a lent GPU machine
    pytest.skip("accelnb is not installed here (it runs from its source): no installed extension to check",
                allow_module_level=True)

EXTENSION = "accelnb-labextension"
GPUS_TOOLBAR_ITEM = {"name": "accelnb-gpus", "rank": 990}


def toolbar_items(extension_dir: Path) -> list[Any]:
    """The notebook toolbar items that the installed extension in ``extension_dir`` declares."""
    schema = json.loads((extension_dir / "schemas" / EXTENSION / "gpu-panel.json").read_text())
    return list(schema["jupyter.lab.toolbars"]["Notebook"])


def test_jupyterlab_lists_the_extension_as_enabled_and_ok() -> None:
    listing = subprocess.run([sys.executable, "-m", "jupyter", "labextension", "list"],
                             capture_output=True, text=True, timeout=120, check=True)
    text = re.sub(r"\x1b\[[0-9;]*m", "", listing.stdout + listing.stderr)  # no colours
    assert re.search(rf"{EXTENSION} v\d+\.\d+\.\d+ enabled OK \(python, accelnb\)", text), text


def test_the_installed_extension_declares_its_toolbar_item() -> None:
    installed = [Path(p) / EXTENSION for p in jupyter_core.paths.jupyter_path("labextensions")
                 if (Path(p) / EXTENSION).is_dir()]
    assert installed, "accelnb's JupyterLab extension is not installed: run scripts/setup"
    assert GPUS_TOOLBAR_ITEM in toolbar_items(installed[0])
