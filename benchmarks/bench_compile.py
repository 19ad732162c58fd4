"""``torch.compile``'s first call inside a rank against the same call in a plain process.

    python benchmarks/bench_compile.py [--repeats 3]

The function is ``tests/test_big_trainers.py``'s ``compiled_first_call`` (a 2-layer MLP, inductor
on the CPU). Each repeat times it in a plain interpreter that imported what accelnb's helper
pre-imports (inductor's default pool of compile processes), then in a one-rank launch (which
compiles in the rank: ``accelnb/worker/rank_body.py``, ``compile_in_process``), then in a two-rank
launch (both ranks compile at once, on cores they share). Inductor's on-disk cache is warmed
first, as it is on any machine that compiled once, so the numbers compare the processes, not a
cold cache. Prints one line per repeat and the medians, in seconds.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from accelnb import launch
from tests.test_big_trainers import compiled_first_call


def in_a_plain_process() -> float:
    source = textwrap.dedent(inspect.getsource(compiled_first_call))
    program = f"import json, torch, torch._dynamo\n{source}\nprint(json.dumps(compiled_first_call()))\n"
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.splitlines()[-1])[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    repeats = parser.parse_args().repeats
    in_a_plain_process()  # warms inductor's on-disk cache
    rows = []
    for _ in range(repeats):
        plain = in_a_plain_process()
        one = launch(compiled_first_call, num_processes=1, quiet=True).values[0][0]
        two = launch(compiled_first_call, num_processes=2, quiet=True).values
        rows.append((plain, one, max(v[0] for v in two.values())))
        print(f"plain process {rows[-1][0]:.2f}  one rank {rows[-1][1]:.2f}  slowest of two ranks {rows[-1][2]:.2f}")
    medians = [statistics.median(column) for column in zip(*rows, strict=True)]
    print(f"median: plain process {medians[0]:.2f}  one rank {medians[1]:.2f}  slowest of two ranks {medians[2]:.2f}")


if __name__ == "__main__":
    main()
