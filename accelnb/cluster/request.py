"""What a cluster launch asks of a backend: :class:`ClusterRequest`.

A module of its own, below both the package's ``cluster_backend`` and the backends it imports
lazily, so that a backend importing the request closes no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from accelnb.kernel.planning.rank_environment import RankOptions


@dataclass(frozen=True)
class ClusterRequest:
    """What a cluster launch asks for: the settled options a backend reads, each field filled by
    its name (``SettledOptions.view``), so an option a backend needs is one field here and no
    caller copies it. Checked value by value by ``LaunchOptions`` already."""

    num_processes: int | None
    nodes: int | None
    gpus_per_node: int | None
    cpu: bool = False
    backend: str | None = None
    quiet: bool = False
    rank_options: RankOptions = field(default_factory=RankOptions)  # what every rank's environment gets
