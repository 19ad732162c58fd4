"""A function sent to the ranks keeps the file it was written in, with every cloudpickle allowed.

cloudpickle 3.1.3 renames the code of every function it sends by value ``<dynamic-code>``;
``wire/code_pickling.py`` keeps the name. Checked here, for the oldest cloudpickle that
``pyproject.toml`` allows (installed for the test into a folder put first on ``PYTHONPATH``)
and the newest (the one pip resolved), with ranks forked from the caller and from a spawned
helper, on three kinds of function:

- one defined in a notebook cell (a real kernel): the stacks of ``accelnb.stacks()`` and the
  rank's traceback name the cell's file and line, and the traceback shows the cell's source line;
- one defined in a script's ``__main__`` (a real ``python script.py``): the same, and the rank's
  debugger (``breakpoint()``, answered on the script's stdin) shows the script's file and lines;
- one imported from a module: the traceback names the module's file and line.

Each rank also says whether it is a fork of the caller (a marker only the caller's memory has),
so a test cannot pass on the other way of starting ranks than the one it names.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
from packaging.version import Version

from accelnb.wire import buffers
from accelnb.wire.code_pickling import reduce_code
from tests.conftest import REPO, error_of, run_notebook, stream_text

NEWEST = "newest"
OLDEST = "oldest"


def allowed_floor() -> str:
    """The oldest cloudpickle ``pyproject.toml`` allows (``cloudpickle>=X``)."""
    match = re.search(r'^\s*"cloudpickle>=([\w.]+)",', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert match, "pyproject.toml should require cloudpickle as a plain floor, cloudpickle>=X"
    return match.group(1)


@pytest.fixture(scope="module")
def oldest_cloudpickle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding only the oldest allowed cloudpickle, to put first on ``PYTHONPATH``."""
    folder = tmp_path_factory.mktemp("cloudpickle-oldest")
    floor = allowed_floor()
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder),
                                f"cloudpickle=={floor}"], capture_output=True, text=True, timeout=300, check=False)
    if installed.returncode != 0:
        if "No matching distribution" in installed.stderr:  # no package index reachable (a lent GPU machine)
            pytest.skip(f"cannot install cloudpickle=={floor} here, no package index has it: "
                        f"{installed.stderr.strip().splitlines()[-1]}")
        raise AssertionError(f"pip could not install cloudpickle=={floor}:\n{installed.stderr}")
    return folder


@pytest.fixture(params=[NEWEST, OLDEST])
def cloudpickle_under_test(request: pytest.FixtureRequest) -> Iterator[tuple[str, dict[str, str]]]:
    """(the version the ranks must run, the environment that makes the caller load it)."""
    if request.param == NEWEST:
        yield cloudpickle.__version__, {}
        return
    folder = request.getfixturevalue("oldest_cloudpickle")
    path = os.pathsep.join(p for p in (str(folder), str(REPO), os.environ.get("PYTHONPATH")) if p)
    yield allowed_floor(), {"PYTHONPATH": path}


# One way ranks start since issue 33: forks of the template, never of the kernel or script (so every
# "forked from the kernel" below must read False). ACCELNB_HELPER_START is no longer read.
STARTS = ["template"]


def test_code_sent_by_value_keeps_its_file_name_nested_code_included() -> None:
    namespace: dict[str, object] = {"__name__": "__main__"}  # by value, as a cell's functions are
    exec(compile("def outer():\n    return lambda: [x for x in (1, 2)]\n", "/notebook/cell-7.py", "exec"), namespace)
    outer = buffers.load(buffers.dump(namespace["outer"]))
    inner = outer()
    assert outer.__code__.co_filename == inner.__code__.co_filename == "/notebook/cell-7.py"
    assert inner() == [1, 2]
    # A code object marshal cannot carry (a constant only a hand-made code object holds) goes
    # through cloudpickle's own reducer instead of failing.
    odd = (lambda: None).__code__.replace(co_consts=(frozenset({object()}),))
    assert reduce_code(odd) is None
    assert isinstance(buffers.load(buffers.dump(odd)), types.CodeType)


def line_of(source: str, text: str) -> int:
    """The number of the only line of ``source`` that holds ``text``."""
    numbers = [n for n, line in enumerate(source.splitlines(), start=1) if text in line]
    assert len(numbers) == 1, (text, numbers)
    return numbers[0]

CELL_SETUP = """
import sys, torch, cloudpickle, accelnb
sys.accelnb_test_marker = True  # in this kernel's memory only: a fork of it has it too
print("cloudpickle", cloudpickle.__version__)
"""

CELL_LAUNCH = """\
import tempfile, threading, time
from pathlib import Path

go = Path(tempfile.mkdtemp()) / "go"

def waits_then_fails(go):
    import os, sys, time
    here = f"{go}.rank{os.environ['RANK']}"
    # One line: the rank says it is here from inside the loop, so its stack is at this line
    # whenever the caller has seen it here.
    while not os.path.exists(go): open(here, "a").close(); time.sleep(0.02)  # noqa: E702
    forked = hasattr(sys, "accelnb_test_marker")
    raise ValueError(f"rank {os.environ['RANK']} forked from the kernel: {forked}")

failures = []
def run():
    try:
        accelnb.launch(waits_then_fails, args=(str(go),), num_processes=2, cpu=True, quiet=True)
    except accelnb.RankFailed as error:
        failures.append(error)

runner = threading.Thread(target=run)
runner.start()
while not all(Path(f"{go}.rank{r}").exists() for r in (0, 1)):
    time.sleep(0.02)
print(accelnb.stacks())
go.touch()
runner.join()
print(failures[0].failures[0].summary)
print(failures[0].failures[0].traceback)
"""


@pytest.mark.parametrize("start", STARTS)
def test_a_cell_function_keeps_its_cell(cloudpickle_under_test: tuple[str, dict[str, str]], start: str) -> None:
    version, env = cloudpickle_under_test
    outputs = run_notebook([CELL_SETUP, CELL_LAUNCH], env={**env, "ACCELNB_HELPER_START": start})
    assert error_of(outputs[0]) is None and error_of(outputs[1]) is None, outputs
    loaded = stream_text(outputs[0]).split()
    assert loaded[0] == "cloudpickle" and Version(loaded[1]) == Version(version), outputs[0]
    out = stream_text(outputs[1])
    print(f"cloudpickle {version}, {start}:\n{out}")
    # The cell's file: ipykernel names it after the kernel's pid and the cell's hash.
    cell_file = r"File \"[^\"]*ipykernel_\d+/\d+\.py\""
    waiting, raising = line_of(CELL_LAUNCH, "while not os.path.exists"), line_of(CELL_LAUNCH, "raise ValueError")
    assert len(re.findall(cell_file + f", line {waiting} in waits_then_fails", out)) == 2  # both ranks' stacks
    assert "<dynamic-code>" not in out
    assert f"forked from the kernel: {start == 'fork'}" in out
    assert re.search(cell_file + f", line {raising}, in waits_then_fails\n +raise ValueError\\(", out), out


SCRIPT = '''\
import os, sys, tempfile, threading, time
from pathlib import Path

import torch  # first, as training scripts do: ACCELNB_HELPER_START=fork then forks this process
import cloudpickle
import accelnb
from origin_module import fails_in_a_module

sys.accelnb_test_marker = True  # in this process's memory only: a fork of it has it too


def waits_then_fails(go):
    import torch.distributed as dist
    here = f"{go}.rank{dist.get_rank()}"
    # One line: the rank says it is here from inside the loop, so its stack is at this line
    # whenever the caller has seen it here.
    while not os.path.exists(go): open(here, "a").close(); time.sleep(0.02)  # noqa: E702
    if dist.get_rank() == 1:
        breakpoint()
        forked = hasattr(sys, "accelnb_test_marker")
        raise ValueError(f"rank 1 forked from the script: {forked}")
    dist.barrier()


def main():
    print("cloudpickle", cloudpickle.__version__)
    go = Path(tempfile.mkdtemp()) / "go"
    failures = []

    def run():
        try:
            accelnb.launch(waits_then_fails, args=(str(go),), num_processes=2, cpu=True, quiet=True)
        except accelnb.RankFailed as error:
            failures.append(error)

    runner = threading.Thread(target=run)
    runner.start()
    while not all(Path(f"{go}.rank{r}").exists() for r in (0, 1)):
        time.sleep(0.02)
    print(accelnb.stacks())
    go.touch()
    runner.join()
    print("FAILED:", failures[0].failures[0].summary)
    print(failures[0].failures[0].traceback)
    try:
        accelnb.launch(fails_in_a_module, num_processes=2, cpu=True, quiet=True)
    except accelnb.RankFailed as error:
        print(error.failures[0].traceback)


if __name__ == "__main__":
    main()
'''

MODULE = '''\
def fails_in_a_module():
    raise RuntimeError("from a module")
'''


@pytest.mark.parametrize("start", STARTS)
def test_a_script_function_keeps_its_file(cloudpickle_under_test: tuple[str, dict[str, str]], start: str,
                                          tmp_path: Path) -> None:
    version, env = cloudpickle_under_test
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    (tmp_path / "origin_module.py").write_text(textwrap.dedent(MODULE))
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
               **env, "ACCELNB_HELPER_START": start}
    done = subprocess.run([sys.executable, str(script)], input="where\nl\nc\n", capture_output=True, text=True,
                          env=environ, cwd=str(tmp_path), timeout=180)
    out = done.stdout
    print(f"cloudpickle {version}, {start}:\n{out}\n{done.stderr}")
    assert done.returncode == 0, done.stderr
    loaded = out.split("\n", 1)[0].split()
    assert loaded[0] == "cloudpickle" and Version(loaded[1]) == Version(version), out
    assert "<dynamic-code>" not in out
    # Stacks: both ranks wait in the script's own function, at its line.
    waiting, stopped, raising = (line_of(SCRIPT, text)
                                 for text in ("while not os.path", "forked =", "raise ValueError"))
    assert out.count(f'File "{script}", line {waiting} in waits_then_fails') == 2
    # The debugger: where the rank stopped, the call stack (where) and the source (l).
    assert out.count(f"[rank 1] > {script}({stopped})waits_then_fails()") == 2  # on stopping, and `where`
    assert "[rank 1] -> forked = hasattr(sys, \"accelnb_test_marker\")" in out
    assert f"[rank 1]  {stopped}  ->\t        forked = hasattr" in out
    assert "raise ValueError(f\"rank 1 forked from the script:" in out  # l shows the lines after
    # The traceback of the function from __main__, and of the one from a module.
    assert f"FAILED: ValueError: rank 1 forked from the script: {start == 'fork'}" in out
    assert f'File "{script}", line {raising}, in waits_then_fails\n    raise ValueError(' in out
    module = tmp_path / "origin_module.py"
    assert f'File "{module}", line 2, in fails_in_a_module\n    raise RuntimeError("from a module")' in out
