"""`make demo` (``python -m accelnb.demo``), the README's main job, run as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.conftest import REPO


def test_the_demo_trains_on_a_dataset_made_in_the_caller_and_the_loss_falls() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "accelnb.demo"], capture_output=True, text=True, timeout=300,
                          env=env, cwd=REPO, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "dataset made here: 259 MiB, handed to both ranks" in out
    assert re.search(r"rank 0 → cpu|rank 0 → cuda:0", out), out
    assert "rank 0 returned {'rank': 0" in out and "rank 1 returned {'rank': 1" in out
    went = re.search(r"rank 0 loss went ([\d.]+) → ([\d.]+)", out)
    assert went is not None and float(went[2]) < float(went[1]) / 10, out
