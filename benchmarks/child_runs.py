"""A benchmark that measures each configuration in a fresh script: the script runs itself with
``--child NAME`` and reads the child's last line of output, a JSON object.

    opts = parse_rounds(__doc__)                   # --rounds N, --write, and the hidden --child
    if opts.child:
        print(json.dumps(measure(opts.child)))     # in the child
    found = child_result(__file__, "launches", {"SOME_SWITCH": "1"})   # in the parent
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from typing import Any


def parse_rounds(doc: str | None, default_rounds: int = 2) -> argparse.Namespace:
    """``--rounds`` (fresh scripts per configuration), ``--write`` (replace the script's section of
    RESULTS.md) and ``--child`` (set only in the child)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=default_rounds)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def child_result(script: str, child: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``script --child child`` in a fresh interpreter (``env`` added to this one's); the JSON
    object it printed last."""
    done = subprocess.run([sys.executable, script, "--child", child], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
