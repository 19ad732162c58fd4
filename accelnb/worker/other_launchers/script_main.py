"""In a rank: run a ``torchrun`` script as ``__main__``, as ``python train.py args`` would (``%torchrun``).

The kernel side (``accelnb/other_launchers.py``) parsed the command line and launched
:func:`run_script` on every rank; the rank already has torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, …), the kernel's working directory and a
process group the script's own ``init_process_group`` adopts. What ``python`` itself does for a
script is done here:

- ``sys.argv`` is the script's path (or, with ``-m``, its module's file) and its arguments;
- ``sys.path[0]`` is the script's folder, so its sibling modules import;
- ``__name__ == "__main__"``, through :mod:`runpy` (``run_path``, or ``run_module`` for ``-m``);
- its exit code decides: ``sys.exit()``, ``sys.exit(0)`` or the end of the script is success;
  any other code is a failure, raised as :class:`accelnb.errors.ScriptExited` so that the kernel reports it
  like an exception, with the rank, the code and the line that exited.
"""

from __future__ import annotations

import os
import runpy
import sys

from accelnb.errors import ScriptExited


def run_script(target: str, arguments: list[str], as_module: bool) -> None:
    """Run ``target`` (a script's path, or a module's name with ``as_module``) as ``__main__``."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    try:
        if as_module:
            sys.argv = [target, *arguments]  # run_module puts the module's file in sys.argv[0]
            sys.path.insert(0, os.getcwd())  # python -m: the current directory comes first
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *arguments]
            sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as leaving:
        if leaving.code is None or leaving.code == 0:
            return
        raise ScriptExited(target, leaving.code) from leaving
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
