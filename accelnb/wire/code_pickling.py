"""Code objects sent by value keep the file they were written in, and so their source lines.

cloudpickle sends a function defined in a notebook cell or a script's ``__main__`` by value: its
code object travels in the pickle. Since cloudpickle 3.1.3 that code object arrives with
``co_filename = "<dynamic-code>"`` (``_code_reduce`` sets it, to make payloads deterministic),
so a rank's traceback, its debugger and its stack dumps would name ``<dynamic-code>`` and show no
line of the user's code. accelnb never compares payloads, and the cell's name is what the user
needs, so the pickler of ``wire/buffers.py`` reduces code objects with :func:`reduce_code`
instead of cloudpickle's reducer, whatever cloudpickle's version.

``marshal`` is the format of ``.pyc`` files: it carries every field of a code object exactly,
the file name, line table and the code of nested functions, lambdas and comprehensions in
``co_consts`` included, and it is written in C (faster than cloudpickle's reducer, which
rebuilds each code object field by field). Its one condition is that both ends run the same
Python version, which holds for ranks (forks of the template, started from the
kernel's interpreter) and which cloudpickle's own code pickling already requires of a Ray cluster.

    >>> import pickle
    >>> code = compile("x = 1", "/notebook/cell.py", "exec")
    >>> rebuild, args = reduce_code(code)
    >>> rebuild(*args).co_filename
    '/notebook/cell.py'
"""

from __future__ import annotations

import marshal
import types
from collections.abc import Callable
from typing import Any


def reduce_code(code: types.CodeType) -> tuple[Callable[[bytes], Any], tuple[bytes]] | None:
    """``(marshal.loads, (bytes,))`` for ``code``, or None where marshal cannot carry it.

    marshal refuses a code object whose constants it does not know (one built by hand with an
    arbitrary object in ``co_consts``; the compiler never makes such): cloudpickle's own reducer
    takes those.
    """
    try:
        data = marshal.dumps(code)
    except ValueError:
        return None
    return marshal.loads, (data,)
