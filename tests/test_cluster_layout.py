"""The pure half of ``cluster="ray"``: rank shapes, bundles, and each rank's place once Ray has
placed the actors (no Ray needed: ``accelnb/cluster/rank_layout.py`` takes plain facts)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from accelnb import LaunchConfigError
from accelnb.cluster import ClusterRequest
from accelnb.cluster.rank_layout import PlacedActor, RankShape, cluster_plan, cluster_table, rank_order, rank_shape
from accelnb.kernel.planning import rank_environment as rank_environment_module
from accelnb.kernel.planning.inventory import Inventory
from accelnb.kernel.planning.rank_environment import RankOptions, RankPlace, rank_environment
from accelnb.kernel.planning.rank_plan import plan
from accelnb.kernel.planning.worker_specs import worker_specs

PACKAGE = Path(__file__).resolve().parent.parent / "accelnb"


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


# ── one function builds a rank's environment, for the ranks of this machine and a cluster's ──
def test_local_and_cluster_ranks_placed_alike_get_the_same_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    options = RankOptions(mixed_precision="bf16")
    # Two CPU ranks on one node reached on loopback: planned here, or placed there by Ray.
    here = plan(None, 2, inventory=Inventory(source="none"), cpu=True).with_options(options).with_port(29400)
    there = cluster_plan([PlacedActor("n", "127.0.0.1", "lo", (), 11), PlacedActor("n", "127.0.0.1", "lo", (), 12)],
                         RankShape(2, None, False), master_port=29400, backend=None).with_options(options)
    local = [spec.env for spec in worker_specs(here, False, 1, threads=2)]
    remote = [spec.env for spec in worker_specs(there, True, 1, threads=2, store_on_rank0=False)]
    assert local == remote == [rank_environment(options, RankPlace(
        rank=rank, local_rank=rank, world_size=2, local_world_size=2, node_rank=0, device="cpu", visible_gpus=(),
        master_addr="127.0.0.1", master_port=29400, interface="lo", restart_count=1, threads=2)) for rank in (0, 1)]
    assert local[1]["ACCELERATE_MIXED_PRECISION"] == "bf16" and local[1]["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert [env["RANK"] for env in local] == ["0", "1"] and local[0]["OMP_NUM_THREADS"] == "2"


def test_only_rank_environment_writes_a_ranks_variables() -> None:
    """Every variable accelnb sets in a rank is written in one place: a new one (torchrun's set)
    goes there, and local and cluster ranks get it alike."""
    written = set(rank_environment(RankOptions(mixed_precision="fp16"), RankPlace(
        rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0, device="cpu", visible_gpus=(),
        gpus_owned=2, restart_count=0, threads=1)))
    writers = {}
    # The doctor names these variables too, in its table of what the kernel's environment risks.
    for path in sorted(p for p in PACKAGE.rglob("*.py") if "doctor" not in p.parts):
        for node in ast.walk(ast.parse(path.read_text())):
            keys = []
            if isinstance(node, ast.Dict):
                keys = node.keys
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
                keys = [node.slice]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "setdefault":
                keys = node.args[:1]
            for key in keys:
                if isinstance(key, ast.Constant) and key.value in written:
                    writers.setdefault(key.value, set()).add(path.relative_to(PACKAGE).as_posix())
    assert rank_environment_module.__file__ is not None
    mine = Path(rank_environment_module.__file__).relative_to(PACKAGE).as_posix()
    assert {name: places for name, places in writers.items() if places != {mine}} == {}
    assert set(writers) >= {"RANK", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RESTART_COUNT"}
