"""What the kernel has imported that its template should import too, and when the template is stale.

The template (``worker/template/helper.py``) imports the modules in the kernel's ``sys.modules``, in the
order the kernel imported them, so that a rank forked from it finds them loaded, less:

- the kernel's own machinery (IPython, ipykernel, zmq, tornado, comm, ipywidgets, jupyter_*, …)
  and a test runner's: a rank is a plain process, and importing them would only cost memory;
- the standard library: cheap for a rank to import itself, and some of its modules act at
  import (``this`` prints, ``antigravity`` opens a browser, ``readline`` takes the terminal);
- private top-level names (``_pytest``, C extension internals their public parents import), and
  modules that exist only in the kernel's memory (no ``__spec__`` origin a process could load);
- the packages an earlier template found unsafe (one of their modules started a thread or CUDA on
  import): the whole package, so that one replacement is enough per package.

A template is stale when an import it made could differ from what the kernel would import now
(:class:`Freshness`): a package was installed, upgraded or removed (a ``site-packages`` folder on
``sys.path`` changed), a module's file changed (an edit of the notebook's own module, with or
without autoreload), or a name now resolves to another file.

    >>> names = modules_to_follow(considered=set())     # doctest: +SKIP
    >>> freshness = Freshness.now(names)                # doctest: +SKIP
    >>> freshness.stale_because()                       # None, or why a new template is needed
"""

from __future__ import annotations

import os
import sys
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

# Top-level packages of the kernel's machinery and of test runners, never imported by a template.
KERNEL_MACHINERY = frozenset({
    "IPython", "ipykernel", "ipywidgets", "widgetsnbextension", "jupyterlab_widgets", "comm", "zmq",
    "tornado", "traitlets", "jupyter_client", "jupyter_core", "jupyter_server", "jupyterlab", "notebook",
    "nbformat", "nbclient", "nbval", "debugpy", "prompt_toolkit", "jedi", "parso", "pexpect",
    "ptyprocess", "matplotlib_inline", "nest_asyncio", "stack_data", "executing", "asttokens",
    "pure_eval", "pygments", "decorator", "pickleshare", "backcall", "wcwidth", "appnope",
    "ipython_genutils", "ipyparallel", "anywidget",
    "pytest", "pluggy", "xdist", "execnet", "iniconfig", "pytest_timeout", "coverage",
    "ray",  # a cluster driver's client; a Ray rank is Ray's process, not a fork of the template
    "accelnb",  # the template imports accelnb's worker side itself
})
_SITE_FOLDERS = ("site-packages", "dist-packages")


def modules_to_follow(considered: set[str], unsafe: Collection[str] = ()) -> list[str]:
    """The modules of this process to ask the template for, in the order they were imported here;
    adds every name it looked at to
    ``considered``, so that the next call looks only at what is new (a set difference: well under
    a millisecond with thousands of modules loaded).

    Submodules count: a library's top level often imports little (transformers imports its
    ``trainer`` only when the code asks for ``Trainer``: two seconds a rank would pay again).
    """
    new = sys.modules.keys() - considered
    if not new:
        return []
    considered.update(new)
    return [name for name, module in list(sys.modules.items())
            if name in new and name.split(".", 1)[0] not in unsafe and _followable(name, module)]


def _followable(name: str, module: object) -> bool:
    top = name.split(".", 1)[0]
    if top.startswith("_") or top in KERNEL_MACHINERY or top in sys.stdlib_module_names:
        return False
    # Built in, or made in memory: nothing a fresh process could import.
    return _file_of(module) is not None or _is_namespace_package(module)


def _file_of(module: object) -> str | None:
    spec = getattr(module, "__spec__", None)
    origin = getattr(spec, "origin", None)
    return origin if isinstance(origin, str) and os.path.isabs(origin) else None


def _is_namespace_package(module: object) -> bool:
    spec = getattr(module, "__spec__", None)
    return spec is not None and spec.origin is None and bool(getattr(spec, "submodule_search_locations", None))


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None


@dataclass
class Freshness:
    """What a template's imports depended on, as it was when they were made."""

    site_folders: dict[str, float | None] = field(default_factory=dict)
    files: dict[str, tuple[str, float | None]] = field(default_factory=dict)  # module -> (its file, mtime)

    @classmethod
    def now(cls, modules: Iterable[str] = ()) -> Freshness:
        """The site folders on ``sys.path`` now, and the files of ``modules`` (and their submodules)."""
        folders = {path: _mtime(path) for path in sys.path if path.rstrip(os.sep).endswith(_SITE_FOLDERS)}
        freshness = cls(folders)
        freshness.add(modules)
        return freshness

    def add(self, modules: Iterable[str]) -> None:
        """Note the files of ``modules`` as loaded now, outside site folders (those change only
        with an install, which the folders' times show)."""
        for name in modules:
            path = _file_of(sys.modules.get(name))
            if path is not None and not any(folder in path for folder in _SITE_FOLDERS):
                self.files[name] = (path, _mtime(path))

    def stale_because(self) -> str | None:
        """Why a template made under this is out of date now, or None."""
        for folder, then in self.site_folders.items():
            if _mtime(folder) != then:
                return f"packages changed in {folder}"
        for name, (path, then) in self.files.items():
            module = sys.modules.get(name)
            now = _file_of(module) if module is not None else path
            if now != path:
                return f"{name} now comes from {now}"
            if _mtime(path) != then:
                return f"{path} changed"
        return None
