"""Pure planning for a cluster: how many ranks, which bundles, and, once Ray placed the actors,
each rank's number, node, local rank, device and environment. No Ray here, so all of it is
testable without a cluster::

    >>> shape = rank_shape(ClusterRequest(num_processes=4, nodes=2, gpus_per_node=None), cluster_gpus=0)
    >>> shape.bundles(), shape.strategy
    ([{'CPU': 2.0}, {'CPU': 2.0}], 'STRICT_SPREAD')

The rules:

- ``nodes=N``: one bundle per node holding that node's ranks, ``STRICT_SPREAD`` so that the N
  bundles land on N different nodes; each rank's actor takes its share of its node's bundle.
  Without ``nodes``: one bundle per rank, ``PACK``, so ranks fill a node before the next.
- Ranks are numbered after placement, node by node: ranks on one node are consecutive, and
  ``LOCAL_RANK`` is a rank's position on its node, never derived from its global rank.
- GPUs are Ray's assignment: every rank of a node sees the GPUs Ray gave that node's ranks, in
  local-rank order, and uses ``cuda:LOCAL_RANK``, so ``cuda:{LOCAL_RANK}`` and
  ``rank % device_count()`` (equal ranks per node) pick the card Ray reserved for it.
- ``MASTER_ADDR`` is rank 0's node address; ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME``
  name the interface carrying each node's Ray address (without them gloo picks the address the
  hostname resolves to, 127.0.0.1 on many machines, and ranks on two nodes never meet).

Each rank's environment is built from that placement by the one function local ranks use too
(:func:`accelnb.kernel.planning.rank_environment.rank_environment`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from accelnb.cluster.request import ClusterRequest
from accelnb.errors import LaunchConfigError
from accelnb.kernel.planning.rank_environment import RankOptions
from accelnb.kernel.planning.rank_plan import LaunchPlan, RankSpec

CPUS_PER_RANK = 1.0


@dataclass(frozen=True)
class RankShape:
    """How many ranks, on how many nodes (None: as Ray packs them), with a GPU each or not."""

    ranks: int
    nodes: int | None
    gpus: bool

    @property
    def per_node(self) -> int | None:
        return None if self.nodes is None else self.ranks // self.nodes

    @property
    def strategy(self) -> str:
        return "PACK" if self.nodes is None else "STRICT_SPREAD"

    def rank_resources(self) -> dict[str, float]:
        return {"CPU": CPUS_PER_RANK, **({"GPU": 1.0} if self.gpus else {})}

    def bundles(self) -> list[dict[str, float]]:
        if self.nodes is None:
            return [self.rank_resources() for _ in range(self.ranks)]
        share = self.per_node or 0
        return [{name: amount * share for name, amount in self.rank_resources().items()} for _ in range(self.nodes)]

    def bundle_of(self, slot: int) -> int:
        """The bundle that the actor of the ``slot``-th rank (in start order) takes its share of."""
        return slot if self.nodes is None else slot // (self.per_node or 1)

    def describe(self) -> str:
        kind = "GPU" if self.gpus else "CPU"
        where = f"{self.nodes} node(s), {self.per_node} per node" if self.nodes else "packed per node"
        return f"{self.ranks} {kind} rank(s) ({where})"


def rank_shape(request: ClusterRequest, cluster_gpus: float) -> RankShape:
    """The ranks a request asks for. GPU ranks when ``gpus_per_node`` is given, or when the
    cluster has GPUs and ``cpu`` is not set; CPU ranks otherwise."""
    count, nodes = request.num_processes, request.nodes
    per_node = request.gpus_per_node
    if per_node is not None and request.cpu:
        raise LaunchConfigError("gpus_per_node= places GPU ranks; cpu=True runs CPU ranks. Remove one of them.")
    if per_node is not None and nodes is not None:
        if count is not None and count != per_node * nodes:
            raise LaunchConfigError(f"nodes={nodes} × gpus_per_node={per_node} is {nodes * per_node} ranks, but "
                                    f"num_processes={count}. Pass two of the three, or make them agree.")
        count = per_node * nodes
    elif per_node is not None:
        if count is None:
            raise LaunchConfigError(f"gpus_per_node={per_node} needs nodes=N (how many nodes) or num_processes=N.")
        if count % per_node:
            raise LaunchConfigError(f"num_processes={count} is not a whole number of nodes of gpus_per_node="
                                    f"{per_node}. Use a multiple of {per_node}.")
        nodes = count // per_node
    if count is None:
        if nodes is None:
            raise LaunchConfigError('cluster="ray" needs to know how many ranks: pass num_processes=N, or '
                                    "nodes=N with gpus_per_node=M.")
        raise LaunchConfigError(f"nodes={nodes} needs num_processes=N (spread evenly) or gpus_per_node=M.")
    if nodes is not None and count % nodes:
        raise LaunchConfigError(f"num_processes={count} cannot be spread evenly over nodes={nodes}. "
                                f"Use a multiple of {nodes}.")
    gpus = per_node is not None or (cluster_gpus > 0 and not request.cpu)
    if request.backend == "nccl" and not gpus:
        raise LaunchConfigError("backend='nccl' needs GPUs, but the Ray cluster has none (or cpu=True). "
                                "Use backend='gloo' or leave it unset.")
    return RankShape(count, nodes, gpus)


@dataclass(frozen=True)
class PlacedActor:
    """Where Ray started one rank's actor (what ``worker/ray_rank.ActorFacts`` reports)."""

    node_id: str
    address: str
    interface: str | None
    gpu_ids: tuple[str, ...]
    pid: int


def rank_order(placed: Sequence[PlacedActor]) -> list[int]:
    """Actor indices in rank order: node by node (in the order their first actor was started),
    and on a node in start order."""
    nodes: dict[str, list[int]] = {}
    for index, actor in enumerate(placed):
        nodes.setdefault(actor.node_id, []).append(index)
    return [index for indices in nodes.values() for index in indices]


def cluster_plan(placed: Sequence[PlacedActor], shape: RankShape, *, master_port: int, backend: str | None,
                 mixed_precision: str | None = None) -> LaunchPlan:
    """Every rank's spec, given the actors in rank order (see :func:`rank_order`). A launch applies
    its settled options with :meth:`LaunchPlan.with_options`; ``mixed_precision`` is the same for a
    plan made from plain values."""
    world = len(placed)
    node_ids = list(dict.fromkeys(actor.node_id for actor in placed))
    by_node = {node: [a for a in placed if a.node_id == node] for node in node_ids}
    ranks = []
    for rank, actor in enumerate(placed):
        peers = by_node[actor.node_id]
        local_rank = peers.index(actor)
        ranks.append(RankSpec(rank, local_rank, world, len(peers), node_ids.index(actor.node_id),
                              f"cuda:{local_rank}" if shape.gpus else "cpu", None,
                              visible_gpus=tuple(gpu for peer in peers for gpu in peer.gpu_ids),
                              interface=actor.interface or "lo"))
    chosen_backend = backend or ("nccl" if shape.gpus else "gloo")
    the_plan = LaunchPlan(tuple(ranks), chosen_backend, master_addr=placed[0].address, master_port=master_port)
    return the_plan.with_options(RankOptions(mixed_precision=mixed_precision))


def cluster_table(plan: LaunchPlan, placed: Sequence[PlacedActor]) -> str:
    """The rank → node → device mapping shown at the start of a cluster run."""
    nodes = len({actor.node_id for actor in placed})
    lines = [f"accelnb: {len(plan.ranks)} rank(s) on {nodes} Ray node(s), backend {plan.backend}, "
             f"rendezvous {plan.master_addr}:{plan.master_port}"]
    for spec, actor in zip(plan.ranks, placed, strict=True):
        device = spec.device
        if actor.gpu_ids:
            device += f" → GPU {','.join(actor.gpu_ids)} (Ray's id on the node)"
        lines.append(f"  node {actor.address} ({actor.interface or '?'})  rank {spec.rank}  local rank "
                     f"{spec.local_rank}  {device}  (pid {actor.pid})")
    return "\n".join(lines)
