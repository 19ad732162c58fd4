"""The pure half of ``cluster="ray"``: rank shapes, bundles, and each rank's place once Ray has
placed the actors (no Ray needed: ``accelnb/cluster/rank_layout.py`` takes plain facts)."""

from __future__ import annotations

import pytest

from accelnb import LaunchConfigError
from accelnb.cluster import ClusterRequest
from accelnb.cluster.rank_layout import PlacedActor, RankShape, cluster_plan, cluster_table, rank_order, rank_shape


def request(**given: object) -> ClusterRequest:
    return ClusterRequest(**{"num_processes": None, "nodes": None, "gpus_per_node": None, **given})  # type: ignore[arg-type]


def test_nodes_give_one_bundle_per_node_spread_over_distinct_nodes() -> None:
    shape = rank_shape(request(nodes=2, gpus_per_node=4), cluster_gpus=8)
    assert (shape.ranks, shape.nodes, shape.gpus, shape.strategy) == (8, 2, True, "STRICT_SPREAD")
    assert shape.bundles() == [{"CPU": 4.0, "GPU": 4.0}, {"CPU": 4.0, "GPU": 4.0}]
    assert [shape.bundle_of(slot) for slot in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_a_rank_count_alone_packs_one_bundle_per_rank() -> None:
    shape = rank_shape(request(num_processes=3), cluster_gpus=0)
    assert (shape.strategy, shape.gpus, shape.bundles()) == ("PACK", False, [{"CPU": 1.0}] * 3)
    assert rank_shape(request(num_processes=2), cluster_gpus=4).gpus  # GPUs where the cluster has them
    assert not rank_shape(request(num_processes=2, cpu=True), cluster_gpus=4).gpus


@pytest.mark.parametrize(("given", "message"), [
    ({}, "needs to know how many ranks"),
    ({"num_processes": 3, "nodes": 2}, "cannot be spread evenly over nodes=2"),
    ({"num_processes": 6, "gpus_per_node": 4}, "not a whole number of nodes of gpus_per_node=4"),
    ({"nodes": 2, "gpus_per_node": 2, "num_processes": 3}, "nodes=2 × gpus_per_node=2 is 4 ranks"),
    ({"gpus_per_node": 2, "cpu": True}, "cpu=True runs CPU ranks"),
    ({"num_processes": 2, "backend": "nccl"}, "backend='nccl' needs GPUs"),
])
def test_shapes_that_cannot_be_are_refused(given: dict[str, object], message: str) -> None:
    with pytest.raises(LaunchConfigError, match=message):
        rank_shape(request(**given), cluster_gpus=0)


def test_ranks_are_numbered_node_by_node_and_local_rank_is_the_place_on_the_node() -> None:
    # Ray packed the bundles A, B, A, B: ranks must still be consecutive per node.
    started = [PlacedActor("A", "10.0.0.1", "eth0", ("3",), 11), PlacedActor("B", "10.0.0.2", "ib0", ("0",), 12),
               PlacedActor("A", "10.0.0.1", "eth0", ("5",), 13), PlacedActor("B", "10.0.0.2", "ib0", ("1",), 14)]
    placed = [started[i] for i in rank_order(started)]
    assert [a.pid for a in placed] == [11, 13, 12, 14]
    plan = cluster_plan(placed, RankShape(4, None, True), master_port=29400, backend=None, mixed_precision="bf16")
    env = [r.env for r in plan.ranks]
    assert [(e["RANK"], e["LOCAL_RANK"], e["NODE_RANK"], e["LOCAL_WORLD_SIZE"]) for e in env] == [
        ("0", "0", "0", "2"), ("1", "1", "0", "2"), ("2", "0", "1", "2"), ("3", "1", "1", "2")]
    assert {e["MASTER_ADDR"] for e in env} == {"10.0.0.1"} and {e["MASTER_PORT"] for e in env} == {"29400"}
    assert [e["GLOO_SOCKET_IFNAME"] for e in env] == ["eth0", "eth0", "ib0", "ib0"]
    assert [e["NCCL_SOCKET_IFNAME"] for e in env] == ["eth0", "eth0", "ib0", "ib0"]
    # Each node's ranks see the GPUs Ray gave that node's ranks, in local-rank order: cuda:LOCAL_RANK is one's own.
    assert [e["CUDA_VISIBLE_DEVICES"] for e in env] == ["3,5", "3,5", "0,1", "0,1"]
    assert [r.device for r in plan.ranks] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert plan.backend == "nccl" and env[0]["ACCELERATE_MIXED_PRECISION"] == "bf16"
    table = cluster_table(plan, placed)
    assert "4 rank(s) on 2 Ray node(s), backend nccl, rendezvous 10.0.0.1:29400" in table
    assert "node 10.0.0.2 (ib0)  rank 3  local rank 1  cuda:1 → GPU 1 (Ray's id on the node)  (pid 14)" in table
