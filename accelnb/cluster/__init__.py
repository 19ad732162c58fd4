"""Backends that run the ranks on a cluster engine's nodes rather than on this machine.

A backend is a module with two functions over a :class:`ClusterRequest` (``cluster/request.py``: a view of the launch's
settled options, :class:`accelnb.options.SettledOptions`, filled by field name):

- ``check(request)``: everything that can fail before anything starts (the engine is not
  installed, no cluster is reachable, the cluster cannot hold the ranks), as
  :class:`~accelnb.errors.LaunchConfigError`;
- ``start(request, persistent=..., restart_count=...)``: the ranks, started, as a
  :class:`~accelnb.kernel.run.rank_group.RankGroup`, which the engine (runs, restarts, sessions) drives
  exactly as it drives ranks forked on this machine.

    >>> backend = cluster_backend("ray")                                      # doctest: +SKIP
    >>> backend.check(request); group = backend.start(request, persistent=False, restart_count=0)  # doctest: +SKIP

Ray (:mod:`accelnb.cluster.ray_backend`) is the one backend today; a Slurm or Kubernetes backend
is one more module and one more entry in :func:`cluster_backend`, and no adapter (magic, panels)
changes. This folder runs in the kernel and may import ``kernel``, ``wire`` and the one worker
module that is a cluster rank's body (``worker/ray_rank.py``, which its actors run).
"""

from __future__ import annotations

from typing import Protocol

from accelnb.cluster.request import ClusterRequest
from accelnb.errors import LaunchConfigError
from accelnb.kernel.run.rank_group import RankGroup

__all__ = ["ClusterBackend", "ClusterRequest", "cluster_backend"]


class ClusterBackend(Protocol):
    def check(self, request: ClusterRequest) -> None: ...

    def start(self, request: ClusterRequest, *, persistent: bool, restart_count: int) -> RankGroup: ...


def cluster_backend(kind: str) -> ClusterBackend:
    """The backend of ``cluster=kind``."""
    if kind == "ray":
        from accelnb.cluster import ray_backend

        return ray_backend  # type: ignore[return-value]  # a module with the two functions
    raise LaunchConfigError(f"cluster={kind!r} has no backend; use cluster=\"ray\" or \"local\".")
