"""Which loaded submodules a function sent by value reaches through its globals, found in
microseconds rather than by reading all of ``sys.modules``.

cloudpickle sends a function defined in a notebook cell by value, and with it the submodules it
reaches as attributes of a package it uses (``torch.nn.functional.relu(x)`` with only ``torch``
among its globals), so that unpickling imports them in the rank. Its ``_find_imported_submodules``
finds them by reading every name in ``sys.modules`` once per package the function uses, and
making a set of the function's names for each name under that package. A process that imported
torch holds about 1,100 modules, one that imported transformers too about 2,500: pickling a
trivial function that uses ``torch`` and ``torch.distributed`` took 2.6 ms and 4.6 ms here, paid
by every launch (about 6 % of a one-shot launch) and more with every import.

:func:`find_imported_submodules` gives the same modules by walking down from each package, one
dictionary lookup per name of the function per level: ``package.name`` for each name the code
uses, then ``package.name.name2`` below each found one (the whole pickle of the same function
then takes 0.08-0.11 ms, with or without transformers). A submodule is found where every
package between it and the function's global is loaded too, which importing it does;
cloudpickle's scan would also find one whose parent was removed from ``sys.modules`` by hand.
Only the order of the list differs, which is the order the rank imports them in.

:func:`install` puts it in cloudpickle's place; it is a private function of cloudpickle's, so
``tests/test_submodule_scan.py`` checks, against each release the resolver installs, that the
name is still there and still gives what cloudpickle's own gives. A release without it keeps
its own scan (slower, never wrong).

    >>> import xml.etree.ElementTree, xml
    >>> code = compile("xml.etree.ElementTree.fromstring('<a/>')", "<cell>", "eval")
    >>> [module.__name__ for module in find_imported_submodules(code, [xml])]
    ['xml.etree', 'xml.etree.ElementTree']
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable

import cloudpickle.cloudpickle as cloudpickle_internals

# cloudpickle's own, kept for tests/test_submodule_scan.py to compare with.
CLOUDPICKLES_SCAN = getattr(cloudpickle_internals, "_find_imported_submodules", None)


def find_imported_submodules(code: types.CodeType, top_level_dependencies: Iterable[object]) -> list[types.ModuleType]:
    """The loaded submodules of the packages among ``top_level_dependencies`` that ``code`` can
    reach by attribute (every part of the dotted name is one of ``code.co_names``)."""
    names = frozenset(code.co_names)
    modules = sys.modules
    found: list[types.ModuleType] = []
    for dependency in top_level_dependencies:
        if not (isinstance(dependency, types.ModuleType) and getattr(dependency, "__package__", None)):
            continue
        pending = [dependency.__name__]
        while pending:
            below = pending.pop() + "."
            for name in names:
                module = modules.get(below + name)
                if module is not None:
                    found.append(module)
                    pending.append(below + name)
    return found


def install() -> bool:
    """Use :func:`find_imported_submodules` for cloudpickle's scan; False where this cloudpickle
    has no such function (then nothing is changed)."""
    if CLOUDPICKLES_SCAN is None:
        return False
    cloudpickle_internals._find_imported_submodules = find_imported_submodules  # type: ignore[attr-defined]
    return True
