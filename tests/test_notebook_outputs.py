"""The outputs stored in ``notebooks/*.ipynb`` name no absolute path of the machine they ran on.

The notebooks are read on GitHub and run by nbval, which compares each stored output with a live
one after ``notebooks/sanitize.cfg`` masked what differs between machines. A traceback frame
stored as ``File "/home/me/.venv/lib/python3.11/site-packages/..."`` passes nbval (the mask
hides it) but shows a reader the paths of whoever last ran the notebook. Such frames are stored
as ``File ".../site-packages/..."`` and ``File ".../lib/python3.11/threading.py"``, which the
same masks match. This test finds the paths of the machine it runs on, where outputs are made.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def paths_of_this_machine() -> list[str]:
    """This checkout, the Python environment and the installation it comes from, the home
    directory: as given and resolved, longest first (so a match names the most telling one)."""
    places = {REPO, Path(sys.prefix), Path(sys.base_prefix), Path.home()}
    spellings = {str(place) for place in places} | {str(place.resolve()) for place in places}
    return sorted((path for path in spellings if path != "/"), key=len, reverse=True)


def machine_path_pattern(paths: list[str]) -> re.Pattern[str]:
    """Any of ``paths`` as a whole path, not part of a longer name (``/root`` is not ``/rooted``)."""
    either = "|".join(re.escape(path) for path in paths)
    return re.compile(rf"(?<![\w.-])(?:{either})(?![\w.-])")


def strings_in(value: Any) -> Iterator[str]:
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from strings_in(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings_in(item)


def machine_paths_in_outputs(notebook: dict[str, Any], pattern: re.Pattern[str]) -> list[str]:
    """``cell N: ...the line around each match...`` for every stored output that names a path
    that ``pattern`` matches."""
    found = []
    for number, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []):
            for text in strings_in(output):
                for match in pattern.finditer(text):
                    line_start = text.rfind("\n", 0, match.start()) + 1
                    line_end = text.find("\n", match.end())
                    found.append(f"cell {number}: {text[line_start:line_end if line_end >= 0 else None].strip()}")
    return found


def test_the_check_finds_a_path_of_this_machine() -> None:
    frame = f'  File "{sys.prefix}/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in _call'
    notebook = {"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": ["fine\n", frame + "\n"]},
        {"output_type": "error", "ename": "E", "evalue": f"under {Path.home()}", "traceback": []}]}]}
    pattern = machine_path_pattern(paths_of_this_machine())
    assert machine_paths_in_outputs(notebook, pattern) == [f"cell 0: {frame.strip()}",
                                                           f"cell 0: under {Path.home()}"]
    elided = frame.replace(sys.prefix + "/lib/python3.11", "...")
    assert machine_paths_in_outputs({"cells": [{"outputs": [{"text": elided}]}]}, pattern) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_stored_outputs_name_no_path_of_this_machine(path: Path) -> None:
    found = machine_paths_in_outputs(json.loads(path.read_text()), machine_path_pattern(paths_of_this_machine()))
    assert found == [], (f"{path.name} stores paths of this machine; write them as .../site-packages/... "
                         "or .../lib/python3.X/..., which notebooks/sanitize.cfg masks the same way:\n"
                         + "\n".join(found))


def test_there_are_notebooks_to_check() -> None:
    assert NOTEBOOKS, "no notebooks/*.ipynb found: the test above checked nothing"


def test_nbval_reads_every_rule_of_the_sanitize_file() -> None:
    # nbval reads "regex: …" then "replace: …" with the space after the colon even for an empty
    # replacement: a rule written "replace:" was silently dropped (the frozen-frames flake).
    from nbval.plugin import get_sanitize_patterns

    text = (Path(__file__).resolve().parents[1] / "notebooks" / "sanitize.cfg").read_text()
    sections = [line for line in text.splitlines() if line.startswith("[")]
    assert len(get_sanitize_patterns(text)) == len(sections), sections
