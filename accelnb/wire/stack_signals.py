"""The two signals the kernel sends a local rank for its Python stacks (a ``timeout=``, the
Stacks button, ``accelnb.stacks()``); each rank prints them on its stderr, where the kernel reads
them (``kernel/stacks``).

- ``ASK_FOR_STACKS`` (SIGUSR1): the rank's signal watcher, a thread of ours, writes every thread's
  stacks while it holds the GIL (``worker/interactive/stack_dump.py``), so that no thread moves while it reads.
- ``STACKS_WITHOUT_THE_GIL``: only for a rank that did not answer the first within
  ``FALLBACK_AFTER_S``, which means that no thread of it can run Python: the main thread holds the
  GIL in native code. faulthandler then prints the stacks from the signal handler, reading frames
  that nothing can change meanwhile. A real-time signal, which no library or scheduler we know of
  uses (SLURM and Lightning use SIGUSR1 and SIGUSR2 for their own checkpoints).
"""

from __future__ import annotations

import signal

ASK_FOR_STACKS = signal.SIGUSR1
STACKS_WITHOUT_THE_GIL = signal.SIGRTMIN + 4
FALLBACK_AFTER_S = 0.5
