"""The suite on a machine with GPUs: one test of each way to start ranks, rerun in ``make test``
under the synthetic inventories of one and of four GPUs (``ACCELNB_SYNTHETIC_GPUS=1``, ``=4``).

A test that means CPU ranks asks for them (``cpu=True``, ``--cpu``): on a machine with one GPU a
launch of ``num_processes=2`` without it is refused (``GpuSelectionError: num_processes=2 asks
for more GPUs than the 1 visible``), as 232 tests were on a lent H100 before every test said so.
The whole suite passes with ``ACCELNB_SYNTHETIC_GPUS=1`` and ``=4`` (run ``ACCELNB_SYNTHETIC_GPUS=1
make test`` after changing many tests); this keeps the cheapest part of that in CI, in a child
pytest: a test of each entry point (sweeps and config files reach the same planner through
``launch``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

EACH_WAY_TO_START_RANKS = [
    "tests/test_public_api.py::test_collect_decides_whose_values_come_back",  # launch(), notebook_launcher()
    "tests/test_session_status.py::test_a_cpu_session_lists_ranks_pids_and_host_memory",  # Session
    "tests/test_other_launchers.py::test_spawn_runs_the_tutorials_function_and_returns_every_ranks_value_in_rank_order",
    "tests/test_other_launchers.py::test_a_torchrun_script_runs_as_main_with_its_argv_and_torchruns_environment",
    "tests/test_return_budget.py::test_return_limit_and_named_returns",  # %%distributed cells in a real kernel
]
EXPECTED_PASSES = len(EACH_WAY_TO_START_RANKS)


@pytest.mark.parametrize("gpus", ["1", "4"])
def test_each_way_to_start_ranks_passes_on_a_machine_with_gpus(gpus: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                           *EACH_WAY_TO_START_RANKS], cwd=REPO, env=dict(os.environ, ACCELNB_SYNTHETIC_GPUS=gpus),
                          capture_output=True, text=True, timeout=600)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.fullmatch(rf"{EXPECTED_PASSES} passed(, \d+ warnings?)? in [\d.]+s.*", summary), summary  # none skipped
