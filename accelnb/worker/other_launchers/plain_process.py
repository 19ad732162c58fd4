"""A rank forked from the notebook's kernel looks like a plain Python process to the code in it.

A fork carries the kernel's memory: IPython's shell singleton (``get_ipython()`` answers),
``sys.ps1`` (the interpreter looks interactive), the logging handlers ipykernel and the notebook
installed, which hold the kernel's own stream objects, and modules that chose a notebook flavour
when the kernel imported them (``tqdm.auto`` picks the widget bar). Libraries decide "am I in a
notebook?" from exactly these, and in a rank the answer must be no: the widget bar and the
kernel's streams write to the kernel's ZMQ sockets, which a fork may not use (jupyter_client:
"attempted to send message from fork"), and a handler writing to an fd accelnb closed fills the
cell with ``--- Logging error ---`` tracebacks (86-640 KB per Hugging Face example, issue 25).

:func:`shed_the_notebook` undoes all of it, before the user's code runs. A rank that a spawned
helper started never had any of it, and the function changes nothing there. Nothing here imports
IPython, ipykernel or tqdm: it only touches what the fork already holds.

    >>> shed_the_notebook()   # in the rank, after its own streams are installed   # doctest: +SKIP
"""

from __future__ import annotations

import builtins
import logging
import os
import sys
from typing import Any

# Modules a plain process has not imported, dropped from ``sys.modules`` so that the rank's code
# sees them absent (tqdm.auto asks whether ``ipykernel.zmqshell`` is loaded) and, if it imports
# one, gets a fresh copy that decides as a plain process. All pure Python: C extensions (zmq,
# jupyter_client's dependencies) cannot be imported twice, and stay.
_NOTEBOOK_PACKAGES = ("ipykernel", "IPython", "ipywidgets", "comm")
_NOTEBOOK_FLAVOURED_MODULES = ("tqdm.auto", "tqdm.autonotebook", "tqdm.notebook")
# Lightning's package names, old and new.
_LIGHTNING_PACKAGES = ("lightning", "lightning_fabric", "pytorch_lightning")
# The packages whose objects are the notebook's and must not be used from a rank.
_KERNEL_PACKAGES = ("ipykernel", "IPython", "jupyter_client", "zmq", "comm", "ipywidgets")
# The kernel's objects the fork holds (its shell, and through it its sockets), kept referenced so
# that forgetting them finalises nothing of the kernel's in the rank.
_kept_from_the_kernel: list[object] = []


def shed_the_notebook() -> None:
    """Make this process look like ``python`` started it, not a notebook (see the module docstring)."""
    _forget_the_shell()
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)
    sys.displayhook, sys.excepthook = sys.__displayhook__, sys.__excepthook__
    _point_logging_at_this_process()
    _forget_cached_answers()
    for name in [name for name in sys.modules if name.split(".", 1)[0] in _NOTEBOOK_PACKAGES]:
        _kept_from_the_kernel.append(sys.modules.pop(name))
    for name in _NOTEBOOK_FLAVOURED_MODULES:
        sys.modules.pop(name, None)


def _forget_cached_answers() -> None:
    """Answers a library cached in the kernel:

    - transformers' ``is_in_notebook()`` is an ``lru_cache`` (``cache_clear`` is the cache's
      public API);
    - Lightning computes ``_IS_INTERACTIVE`` (``sys.ps1`` exists) once, at import, and its modules
      copy it with ``from ... import _IS_INTERACTIVE``. Left True in a rank, ``Trainer(devices=N)``
      picks its fork strategy and starts N processes again inside each rank.

    tests/test_plain_ranks.py checks the first, tests/test_frameworks_inside.py the second, against
    the versions installed.
    """
    for name, module in list(sys.modules.items()):
        if name.split(".", 1)[0] in _LIGHTNING_PACKAGES and getattr(module, "_IS_INTERACTIVE", None) is True:
            module._IS_INTERACTIVE = False  # type: ignore[attr-defined]
    import_utils = sys.modules.get("transformers.utils.import_utils")
    cached = getattr(import_utils, "is_in_notebook", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _forget_the_shell() -> None:
    shell_module = sys.modules.get("IPython.core.interactiveshell")
    if shell_module is not None:
        shell_class: Any = shell_module.InteractiveShell
        shell = getattr(shell_class, "_instance", None)
        if shell is not None:
            _kept_from_the_kernel.append(shell)
            type(shell).clear_instance()  # traitlets' public way: get_ipython() is None from now on
    if hasattr(builtins, "get_ipython"):  # IPython puts it there while a cell runs
        delattr(builtins, "get_ipython")


def _point_logging_at_this_process() -> None:
    """Handlers of the notebook's packages go; handlers writing to the kernel's streams (a
    ``logging.basicConfig()`` in the notebook) write to this process's stderr instead."""
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)]
    for logger in loggers:
        for handler in list(logger.handlers):
            if _belongs_to_the_kernel(handler):
                logger.removeHandler(handler)
            elif isinstance(handler, logging.StreamHandler) and (
                    _belongs_to_the_kernel(handler.stream) or _is_closed_here(handler.stream)):
                handler.setStream(sys.stderr)


def _is_closed_here(stream: Any) -> bool:
    """A stream over an fd this process no longer has (the fork closed the kernel's fds)."""
    try:
        fd = stream.fileno()
    except Exception:  # no fd (a StringIO): the user's business
        return False
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def _belongs_to_the_kernel(thing: object) -> bool:
    module = type(thing).__module__ or ""
    return module.split(".", 1)[0] in _KERNEL_PACKAGES
