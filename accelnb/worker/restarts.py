"""Which attempt of a launch this rank is in: ``accelnb.restart_count()``.

With ``max_restarts=N`` a launch whose rank fails is started again, every rank afresh, up to N
times. The function reads its attempt here (0 on the first, 1 after one restart, …), or from
``TORCHELASTIC_RESTART_COUNT``, which every rank also gets, so code written for torchelastic
(``torchrun --max-restarts``) works unchanged:

    def train():
        accelerator = Accelerator(project_config=ProjectConfiguration(
            project_dir="ckpt", automatic_checkpoint_naming=True))
        ...
        if accelnb.restart_count() > 0:
            accelerator.load_state()          # resume from the latest checkpoint

The value is the one accelnb started the rank with, whatever the function later does to
``os.environ``.

Module-level state: ``_restart_count``, this rank process's attempt number.
"""

from __future__ import annotations

_restart_count = 0


def attach(restart_count: int) -> None:
    """Called by the worker at start, with the attempt it belongs to."""
    global _restart_count
    _restart_count = restart_count


def restart_count() -> int:
    """How many times this launch has restarted its ranks before this attempt: 0 on the first
    attempt, and always 0 outside a launch and in a persistent session (which never restarts)."""
    return _restart_count
