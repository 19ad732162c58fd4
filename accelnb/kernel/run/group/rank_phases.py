"""The run's rank states as displays see them: one :class:`~accelnb.kernel.run.run_state.RankState`
per rank, published through :mod:`accelnb.kernel.run.run_state`.

Both groups (local processes and Ray actors) publish the same way, so they share this:

    >>> phases = RankPhases()                                                    # doctest: +SKIP
    >>> run = phases.begin([RankState(0, "cpu", "starting", pid)], collect_stacks)  # doctest: +SKIP
    >>> phases.set(0, "failed", "ValueError")                                    # doctest: +SKIP
    >>> phases.finish()                                                          # doctest: +SKIP

Until :meth:`RankPhases.begin` (a local group before its workers are forked) there is no run, and
setting a phase changes nothing: nothing is shown of a start that did not finish.
"""

from __future__ import annotations

from collections.abc import Callable

from accelnb.kernel.run import run_state
from accelnb.kernel.run.run_state import RankPhase, RankState, RunState


class RankPhases:
    """The states of one run's ranks, by rank."""

    def __init__(self) -> None:
        self.run: RunState | None = None
        self._states: dict[int, RankState] = {}

    def begin(self, ranks: list[RankState], collect_stacks: Callable[[float], dict[int, str]]) -> RunState:
        """Publish a new run with these ranks; it is the current run from now on."""
        self.run = RunState(run_id=run_state.next_run_id(), ranks=ranks, collect_stacks=collect_stacks)
        self._states = {state.rank: state for state in ranks}
        run_state.begin_run(self.run)
        return self.run

    def set(self, rank: int, phase: RankPhase, detail: str = "") -> None:
        """Change a rank's phase; listeners hear of it only when something changed."""
        state = self._states.get(rank)
        if state is not None and (state.phase != phase or detail):
            state.phase = phase
            state.detail = detail
            run_state.publish()

    def phase(self, rank: int) -> RankPhase | None:
        state = self._states.get(rank)
        return None if state is None else state.phase

    def finish(self) -> None:
        """The run is over (its group is closed)."""
        if self.run is not None:
            self.run.finished = True
            run_state.publish()
