"""``cluster="ray"``: check a request against the cluster, then place and start its actors.

    >>> check(request)                                                         # doctest: +SKIP
    >>> group = start(request, persistent=False, restart_count=0)             # doctest: +SKIP

:func:`check` fails before anything starts: Ray missing, no cluster reachable, or a cluster that
can never hold the ranks (too few nodes, CPUs or GPUs in total). :func:`start` reserves one
placement group (see :mod:`accelnb.cluster.rank_layout` for its shape), starts one actor per rank
in it, learns where each landed, binds the rendezvous port on rank 0's node, prints the rank →
node → device table, and starts every rank's set-up. Whatever stops it half-way (an interrupt,
a cluster too busy to place the group in time) kills what it started and removes the group.
"""

from __future__ import annotations

import time
from typing import Any

from accelnb.cluster.rank_layout import (
    CPUS_PER_RANK,
    PlacedActor,
    RankShape,
    cluster_plan,
    cluster_table,
    rank_order,
    rank_shape,
)
from accelnb.cluster.ray_connection import connected_ray
from accelnb.cluster.ray_group import RayRankGroup
from accelnb.cluster.request import ClusterRequest
from accelnb.errors import LaunchConfigError, WorkerStartError
from accelnb.kernel.display.output import OutputRouter, notebook_sink
from accelnb.kernel.planning.worker_specs import worker_specs
from accelnb.kernel.run.failure_report import start_interrupted
from accelnb.worker.ray_rank import RankActor

PLACEMENT_WAIT_S = 120.0  # resources exist but are busy: how long to wait for them
ACTORS_WAIT_S = 120.0  # actors start a fresh interpreter and import torch on their node
ACTOR_CONCURRENCY = 6  # the call, its events poll, and stacks, an interrupt or a delivery beside them


def check(request: ClusterRequest) -> None:
    """Raise :class:`LaunchConfigError` for anything that keeps the ranks from ever starting."""
    ray = connected_ray()
    shape = rank_shape(request, ray.cluster_resources().get("GPU", 0.0))
    _check_capacity(ray, shape)


def _check_capacity(ray: Any, shape: RankShape) -> None:
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    need = shape.rank_resources()
    if shape.nodes is not None:
        per_node = {name: amount * (shape.per_node or 0) for name, amount in need.items()}
        fitting = sum(all(node.get(name, 0) >= amount for name, amount in per_node.items()) for node in nodes)
        if fitting < shape.nodes:
            raise LaunchConfigError(
                f"{shape.describe()} need {shape.nodes} nodes with {_amounts(per_node)} each; the Ray cluster has "
                f"{fitting} such node(s) of {len(nodes)} ({_amounts(ray.cluster_resources())} in all). Add nodes "
                "(ray start --address=HEAD_IP:6379 on each), or ask for fewer.")
        return
    for name, amount in need.items():
        total = sum(node.get(name, 0) for node in nodes)
        if total < amount * shape.ranks:
            raise LaunchConfigError(
                f"{shape.describe()} need {amount * shape.ranks:g} {name} in all; the Ray cluster has {total:g} "
                f"({len(nodes)} node(s)). Ask for fewer ranks, or add nodes to the cluster.")


def _amounts(resources: dict[str, float]) -> str:
    return ", ".join(f"{resources[name]:g} {name}" for name in ("CPU", "GPU") if name in resources) or "nothing"


def start(request: ClusterRequest, *, persistent: bool, restart_count: int) -> RayRankGroup:
    """Place and start one actor per rank; returns the group with every rank's set-up under way."""
    ray = connected_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    shape = rank_shape(request, ray.cluster_resources().get("GPU", 0.0))
    group_of_bundles = placement_group(shape.bundles(), strategy=shape.strategy)
    actors: list[Any] = []
    group: RayRankGroup | None = None
    try:
        _wait(ray, [group_of_bundles.ready()], PLACEMENT_WAIT_S,
              f"Ray could not place {shape.describe()} within {PLACEMENT_WAIT_S:g} s: the cluster has the "
              "resources, but other work holds them. Wait for it, or ask for fewer ranks.")
        remote_actor = ray.remote(RankActor)
        for slot in range(shape.ranks):
            actors.append(remote_actor.options(
                num_cpus=shape.rank_resources()["CPU"], num_gpus=1 if shape.gpus else 0,
                max_concurrency=ACTOR_CONCURRENCY, name=None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    group_of_bundles, placement_group_bundle_index=shape.bundle_of(slot)),
            ).remote())
        facts_refs = [actor.facts.remote() for actor in actors]
        _wait(ray, facts_refs, ACTORS_WAIT_S,
              f"The rank actors did not start within {ACTORS_WAIT_S:g} s; is accelnb installed on every node?")
        facts = ray.get(facts_refs)
        placed = [PlacedActor(f.node_id, f.address, f.interface, f.gpu_ids, f.pid) for f in facts]
        order = rank_order(placed)
        actors, placed = [actors[i] for i in order], [placed[i] for i in order]
        port = ray.get(actors[0].reserve_port.remote(placed[0].address))
        plan = cluster_plan(placed, shape, master_port=port, backend=request.backend).with_options(request.rank_options)
        router = OutputRouter(live_ranks={0}, prefix=False, sink=notebook_sink)
        group = RayRankGroup(plan, actors, placed, group_of_bundles, router, persistent=persistent)
        if not request.quiet:
            notebook_sink("stdout", cluster_table(plan, placed) + "\n")
        # Each actor holds one CPU of its node (CPUS_PER_RANK); rank 0's actor bound its own store
        # socket (reserve_port above), so none is handed down from the kernel.
        group.begin(worker_specs(plan, persistent, restart_count, threads=int(CPUS_PER_RANK), store_on_rank0=False,
                                 on_this_machine=False))
        return group
    except BaseException as error:
        if group is not None:
            group.close()
        else:
            for actor in actors:
                ray.kill(actor, no_restart=True)
            remove_placement_group(group_of_bundles)
        if isinstance(error, KeyboardInterrupt):
            raise start_interrupted() from None
        if isinstance(error, ray.exceptions.RayError):
            raise WorkerStartError(f"Ray could not start the rank actors: {error}") from None
        raise


def _wait(ray: Any, refs: list[Any], limit: float, message: str) -> None:
    """Wait for every ref, in slices an interrupt can land between."""
    deadline = time.monotonic() + limit
    pending = refs
    while pending:
        if time.monotonic() > deadline:
            raise WorkerStartError(message)
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
