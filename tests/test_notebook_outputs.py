"""The outputs stored in ``notebooks/*.ipynb`` name no absolute path of any machine.

The notebooks are read on GitHub and run by nbval, which compares each stored output with a live
one after ``notebooks/sanitize.cfg`` masked what differs between machines. A traceback frame
stored as ``File "/home/me/.venv/lib/python3.11/site-packages/..."`` passes nbval (the mask
hides it) but shows a reader the paths of whoever last ran the notebook, and so does a cell's
frame under ``/tmp/ipykernel_1234/``. Such frames are stored as ``File ".../site-packages/..."``,
``File ".../lib/python3.11/threading.py"`` and ``File ".../ipykernel_1234/567.py"``, which the same
masks match. The outputs may have been made on any machine, so the test looks for any absolute
path (POSIX or Windows), not only those of the machine it runs on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("**/*.ipynb"))

# An absolute path: "/" then at least two names ("/home/me", "/tmp/ipykernel_1/2.py"), or a
# drive ("C:\\Users\\me"). Not one inside a longer token: a URL's "//host/path", a relative
# ".../site-packages/x.py", "<ipykernel cell>", an HTML "</td>", a rate like "samples/s"; nor the
# kernel's files, which are the same on every Linux machine ("/dev/shm", "/proc/self").
ABSOLUTE_PATH = re.compile(r"""(?<![\w.:/<>~-])/(?!(?:dev|proc|sys)/)[\w.@+-]+/[^\s"'<>:,;)]*"""
                           r"|(?<![\w])[A-Za-z]:\\[\w .@+-]+\\[^\s\"'<>]*")


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


def absolute_paths_in_outputs(notebook: dict[str, Any]) -> list[str]:
    """``cell N: ...the line around each match...`` for every absolute path in a stored output."""
    found = []
    for number, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []):
            for text in strings_in(output):
                for match in ABSOLUTE_PATH.finditer(text):
                    line_start = text.rfind("\n", 0, match.start()) + 1
                    line_end = text.find("\n", match.end())
                    found.append(f"cell {number}: {text[line_start:line_end if line_end >= 0 else None].strip()}")
    return found


FOUND = [
    '  File "/home/alice/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1, in _call',
    '  File "/tmp/ipykernel_14950/1644806582.py", line 10 in wait_for_data',
    '[rank 1]   File "/work/wt-issue16ui/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"',
    "FileNotFoundError: [Errno 2] No such file or directory: '/Users/bob/data/train.csv'",
    "saved to /root/checkpoints",
    '  File "C:\\Users\\carol\\miniconda3\\Lib\\site-packages\\torch\\serialization.py", line 3',
]
NOT_FOUND = [
    '  File ".../site-packages/torch/nn/modules/module.py", line 1, in _call',
    '  File ".../lib/python3.11/threading.py", line 1 in wait',
    '  File ".../ipykernel_14950/1644806582.py", line 10 in wait_for_data',
    'File "<ipykernel cell>", see https://pytorch.org/docs/stable/distributed.html',
    "<table><tr><td>rank 0</td><td>12.5 samples/s</td><td>3/4 done</td></tr></table>",
    "loss/step 0.25, 1/2 of the data, and/or a path named in prose: site-packages/torch",
    "ok    /dev/shm             23.5 GB in all, 23.5 GB free",
]


def test_the_check_finds_an_absolute_path_of_any_machine_and_nothing_else() -> None:
    notebook = {"cells": [{"cell_type": "code", "source": "", "outputs": [
        {"output_type": "stream", "name": "stdout", "text": [line + "\n" for line in FOUND + NOT_FOUND]},
        {"output_type": "error", "ename": "E", "evalue": "under /home/dave/project", "traceback": NOT_FOUND}]}]}
    assert absolute_paths_in_outputs(notebook) == [f"cell 0: {line.strip()}" for line in FOUND] + [
        "cell 0: under /home/dave/project"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[path.name for path in NOTEBOOKS])
def test_stored_outputs_name_no_absolute_path(path: Path) -> None:
    found = absolute_paths_in_outputs(json.loads(path.read_text()))
    assert found == [], (f"{path.name} stores absolute paths; write them as .../site-packages/..., "
                         ".../lib/python3.X/... or .../ipykernel_N/M.py, which notebooks/sanitize.cfg masks "
                         "the same way:\n" + "\n".join(found))


def test_there_are_notebooks_to_check() -> None:
    assert NOTEBOOKS, "no notebooks/*.ipynb found: the test above checked nothing"


def test_nbval_reads_every_rule_of_the_sanitize_file() -> None:
    # nbval reads "regex: …" then "replace: …" with the space after the colon even for an empty
    # replacement: a rule written "replace:" was silently dropped (the frozen-frames flake).
    pytest.importorskip("nbval", reason="nbval is not installed here (make setup installs it)")
    from nbval.plugin import get_sanitize_patterns

    text = (Path(__file__).resolve().parents[1] / "notebooks" / "sanitize.cfg").read_text()
    sections = [line for line in text.splitlines() if line.startswith("[")]
    assert len(get_sanitize_patterns(text)) == len(sections), sections
