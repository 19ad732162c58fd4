"""Run code right after a module is imported, in a rank: how accelnb adapts a library it need not import.

Importing torchelastic's launcher API or Accelerate costs a rank tens of milliseconds to seconds,
and most launches never use them. :func:`when_imported` runs its function once the code imports
the module (at once, if the rank already holds it: the template imported it). It
uses the import system's public hook, a finder at the front of ``sys.meta_path`` that steps
aside after its one module.

    >>> when_imported("accelerate.state", lambda module: print(module.__name__))   # doctest: +SKIP
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


def when_imported(name: str, then: Callable[[Any], None]) -> None:
    """Run ``then(module)`` once module ``name`` is imported: now, or right after its import."""
    if name in sys.modules:
        then(sys.modules[name])
        return

    class PatchAfterImport(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
            if fullname != name:
                return None
            sys.meta_path.remove(self)  # once; and the real finders find the module below
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return spec
            execute = spec.loader.exec_module

            def exec_then_patch(module: Any) -> None:
                execute(module)
                then(module)

            spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, PatchAfterImport())
