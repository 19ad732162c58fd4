"""The pure planner: selections in, per-rank specs out (no processes, no GPU needed)."""

from __future__ import annotations

import pytest

from accelnb import GpuSelectionError, LaunchConfigError, plan, synthetic_inventory
from accelnb.kernel.inventory import Inventory
from accelnb.kernel.selection import clear_selection, set_selection

EIGHT = synthetic_inventory(8)
NONE = Inventory(source="none", note="no NVIDIA driver found")


def real(inventory: Inventory) -> Inventory:
    """The same GPUs, but not synthetic: plans for them use CUDA devices and nccl."""
    return Inventory(gpus=inventory.gpus, synthetic=False, source="nvml")


def test_selection_3_4_5_7_maps_local_ranks_to_cuda_0_to_3_in_selection_order() -> None:
    p = plan("3,4,5,7", inventory=real(EIGHT))
    assert [(r.rank, r.local_rank, r.device, r.gpu.index) for r in p.ranks if r.gpu] == [
        (0, 0, "cuda:0", 3), (1, 1, "cuda:1", 4), (2, 2, "cuda:2", 5), (3, 3, "cuda:3", 7)]
    for r in p.ranks:
        assert r.env["CUDA_VISIBLE_DEVICES"] == "3,4,5,7"
        assert r.env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert r.env["WORLD_SIZE"] == "4" and r.env["LOCAL_WORLD_SIZE"] == "4"
        assert r.env["RANK"] == str(r.rank) and r.env["LOCAL_RANK"] == str(r.local_rank)
        assert r.env["MASTER_ADDR"] == "127.0.0.1"
    assert p.backend == "nccl"


def test_selection_order_is_kept_not_sorted() -> None:
    p = plan([7, 3], inventory=real(EIGHT))
    assert [r.gpu.index for r in p.ranks if r.gpu] == [7, 3]
    assert p.ranks[0].env["CUDA_VISIBLE_DEVICES"] == "7,3"


def test_two_nodes_of_five_gpus_rank_5_uses_local_device_0() -> None:
    second_node = plan("0,1,2,3,4", inventory=real(synthetic_inventory(5)), nnodes=2, node_rank=1)
    rank5 = second_node.ranks[0]
    assert (rank5.rank, rank5.local_rank, rank5.device, rank5.world_size) == (5, 0, "cuda:0", 10)
    assert [r.rank for r in second_node.ranks] == [5, 6, 7, 8, 9]
    assert rank5.env["NODE_RANK"] == "1" and rank5.env["LOCAL_WORLD_SIZE"] == "5"


def test_uuids_and_all_select_gpus() -> None:
    uuid = EIGHT.gpus[6].uuid
    assert [r.gpu.index for r in plan([uuid, "1"], inventory=real(EIGHT)).ranks if r.gpu] == [6, 1]
    assert len(plan("all", inventory=real(EIGHT)).ranks) == 8


def test_no_selection_means_every_visible_gpu_or_the_picker_selection() -> None:
    assert len(plan(inventory=real(EIGHT)).ranks) == 8
    set_selection(gpus=[2, 5])
    try:
        assert [r.gpu.index for r in plan(inventory=real(EIGHT)).ranks if r.gpu] == [2, 5]
    finally:
        clear_selection()


def test_num_processes_without_gpus_plans_cpu_ranks_on_gloo() -> None:
    p = plan(num_processes=2, inventory=NONE)
    assert [r.device for r in p.ranks] == ["cpu", "cpu"]
    assert p.backend == "gloo"
    assert p.ranks[1].env["CUDA_VISIBLE_DEVICES"] == ""


def test_synthetic_inventory_runs_gpu_plans_on_cpu_and_says_so() -> None:
    p = plan("1,3", inventory=EIGHT)
    assert p.simulated_gpus and p.backend == "gloo"
    assert [r.device for r in p.ranks] == ["cpu", "cpu"]
    assert p.ranks[0].env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "synthetic" in p.table()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpus": "9"}, "GPU 9 does not exist on this machine. GPUs visible to this kernel: 0 ("),
    ({"gpus": "1,1"}, "GPU 1 is selected more than once"),
    ({"gpus": ""}, "The GPU selection is empty"),
    ({"gpus": "0,1", "num_processes": 3}, "gpus= selects 2 GPU(s) but num_processes=3"),
    ({"num_processes": 0}, "num_processes must be at least 1"),
    ({"gpus": "0", "backend": "ncl"}, "Unknown backend 'ncl'"),
    ({"num_processes": 9}, "asks for more GPUs than the 8 visible"),
    ({"gpus": "0", "mixed_precision": "fp32"}, "mixed_precision='fp32' is not one of"),
])
def test_bad_selections_explain_themselves(kwargs: dict, message: str) -> None:
    with pytest.raises(LaunchConfigError) as info:
        plan(inventory=real(EIGHT), **kwargs)
    assert message in str(info.value)


def test_without_gpus_the_error_says_to_pass_num_processes() -> None:
    with pytest.raises(GpuSelectionError, match=r"No GPU is visible .*num_processes=N"):
        plan(inventory=NONE)
    with pytest.raises(LaunchConfigError, match="backend='nccl' needs GPUs"):
        plan(num_processes=2, inventory=NONE, backend="nccl")


def test_gpus_hidden_by_the_kernels_cuda_visible_devices_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from accelnb.kernel.inventory import _kernel_visible_filter

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    filtered = Inventory(gpus=tuple(_kernel_visible_filter(list(EIGHT.gpus))), source="nvml")
    assert [g.index for g in filtered.visible] == [0, 2]
    with pytest.raises(GpuSelectionError, match="hidden from this kernel by its CUDA_VISIBLE_DEVICES"):
        plan("1", inventory=filtered)
