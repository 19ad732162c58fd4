"""GNU OpenMP's thread pool, released right before the kernel forks a helper.

A process that ran an OpenMP parallel region (a torch op on a big CPU tensor does) keeps libgomp's
pool of worker threads. ``fork()`` copies the pool's bookkeeping but not its threads, and libgomp
has no fork handler: a child's first parallel region with more than one thread then waits
forever for threads that do not exist. A rank forked (through a helper) from a kernel that had
done one matmul hung in its own first matmul until ``timeout=`` ended it, where the same rank
from a spawned helper took 0.3 s. Accelerate's ``notebook_launcher``, which forks the kernel,
hangs the same way.

``omp_pause_resource_all`` (OpenMP 5.0; libgomp has it since GCC 9) ends the calling thread's
pool, so that the fork copies none; the kernel's next parallel region starts a new one, which
costs well under a millisecond per thread. Only the forking thread's pool matters: a fork copies
that thread alone. Intel's and LLVM's OpenMP runtimes re-initialise themselves in a forked child,
so only libgomp is looked for.

    >>> if releasable():      # libgomp absent, or able to end its pool
    ...     release()         # just before os.fork()
"""

from __future__ import annotations

import ctypes
import os

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: libgomp ends the pool for either kind


def _loaded_libgomps() -> list[ctypes.CDLL]:
    """Every libgomp mapped in this process (torch wheels bundle their own copy)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        return []
    libraries = []
    for path in sorted(paths):
        try:  # RTLD_NOLOAD: the copy already loaded, never a second one
            libraries.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY))
        except OSError:
            continue
    return libraries


def releasable() -> bool:
    """Whether a fork from this thread can be made safe for OpenMP: no libgomp is loaded, or every
    loaded one can end its pool (an older one cannot: then do not fork)."""
    return all(hasattr(library, "omp_pause_resource_all") for library in _loaded_libgomps())


def release() -> bool:
    """End this thread's libgomp pools; True when every loaded libgomp did (or none is loaded)."""
    ended = True
    for library in _loaded_libgomps():
        pause = getattr(library, "omp_pause_resource_all", None)
        if pause is None:
            ended = False
            continue
        pause.argtypes = (ctypes.c_int,)
        pause.restype = ctypes.c_int
        ended = pause(OMP_PAUSE_SOFT) == 0 and ended
    return ended
