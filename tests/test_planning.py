"""The pure planner: selections in, per-rank specs out (no processes, no GPU needed).

``accelnb.kernel.planning.rank_plan.plan`` takes plain values and an inventory, and reads nothing else; the
public ``accelnb.plan`` is what a launch plans (options checked, the picker's selection resolved).
Inventories are injected: synthetic ones, or ones built here with the GPUs a test needs.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

import accelnb
from accelnb import GpuSelectionError, LaunchConfigError, synthetic_inventory
from accelnb.kernel.planning.inventory import Inventory
from accelnb.kernel.planning.rank_environment import DEVICE_ENV
from accelnb.kernel.planning.rank_plan import plan
from accelnb.kernel.watched_state.selection import clear_selection, set_selection
from accelnb.wire.spec import MAX_LOCAL_RANKS
from accelnb.worker import cell_runner

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
        assert r.env["MASTER_ADDR"] == "127.0.0.1" and r.env["NODE_RANK"] == "0"
    assert p.backend == "nccl"


def test_selection_order_is_kept_not_sorted() -> None:
    p = plan([7, 3], inventory=real(EIGHT))
    assert [r.gpu.index for r in p.ranks if r.gpu] == [7, 3]
    assert p.ranks[0].env["CUDA_VISIBLE_DEVICES"] == "7,3"


def test_the_device_is_decided_once_and_handed_to_each_rank() -> None:
    assert cell_runner.DEVICE_ENV == DEVICE_ENV  # the worker side reads the name the planner writes
    for p in (plan("2,6", inventory=real(EIGHT)), plan("2,6", inventory=EIGHT),
              plan(num_processes=3, inventory=NONE), plan(num_processes=2, inventory=real(EIGHT), cpu=True)):
        assert [r.env[DEVICE_ENV] for r in p.ranks] == [r.device for r in p.ranks]
    assert [r.device for r in plan("2,6", inventory=real(EIGHT)).ranks] == ["cuda:0", "cuda:1"]


def test_uuids_and_all_select_gpus() -> None:
    uuid = EIGHT.gpus[6].uuid
    assert [r.gpu.index for r in plan([uuid, "1"], inventory=real(EIGHT)).ranks if r.gpu] == [6, 1]
    assert len(plan("all", inventory=real(EIGHT)).ranks) == 8


def test_the_planner_reads_no_notebook_state_the_public_plan_uses_the_pickers_selection() -> None:
    set_selection(gpus=[2, 5])
    try:
        assert len(plan(inventory=real(EIGHT)).ranks) == 8  # pure: every visible GPU
        assert [r.gpu.index for r in accelnb.plan(inventory=real(EIGHT)).ranks if r.gpu] == [2, 5]
        # An explicit choice wins over the picker.
        assert len(accelnb.plan(num_processes=3, inventory=real(EIGHT)).ranks) == 3
    finally:
        clear_selection()
    assert len(accelnb.plan(inventory=real(EIGHT)).ranks) == 8


def test_num_processes_without_gpus_plans_cpu_ranks_on_gloo() -> None:
    p = plan(num_processes=2, inventory=NONE)
    assert [r.device for r in p.ranks] == ["cpu", "cpu"]
    assert p.backend == "gloo"
    assert p.ranks[1].env["CUDA_VISIBLE_DEVICES"] == ""


def test_more_ranks_than_one_machine_takes_are_refused_before_anything_opens() -> None:
    assert len(plan(num_processes=MAX_LOCAL_RANKS, inventory=NONE, cpu=True).ranks) == MAX_LOCAL_RANKS
    with pytest.raises(LaunchConfigError, match=f"{MAX_LOCAL_RANKS + 1} ranks on this machine: accelnb starts at "
                                                f"most {MAX_LOCAL_RANKS} ranks on one machine"):
        plan(num_processes=MAX_LOCAL_RANKS + 1, inventory=NONE, cpu=True)


def test_synthetic_inventory_runs_gpu_plans_on_cpu_and_says_so() -> None:
    p = plan("1,3", inventory=EIGHT)
    assert p.simulated_gpus and p.backend == "gloo"
    assert [r.device for r in p.ranks] == ["cpu", "cpu"]
    assert p.ranks[0].env["CUDA_VISIBLE_DEVICES"] == "1,3"
    assert "synthetic" in p.table()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpus": "9"}, "GPU 9 does not exist on this machine. GPUs visible to this kernel: 0 ("),
    ({"gpus": "1,1"}, "GPU 1 is selected more than once"),
    ({"gpus": "2,1,2,1,3"}, "GPU 1, 2 is selected more than once"),
    ({"gpus": ""}, "The GPU selection is empty"),
    ({"gpus": "0,1", "num_processes": 3}, "gpus= selects 2 GPU(s) but num_processes=3"),
    ({"num_processes": 9}, "asks for more GPUs than the 8 visible"),
])
def test_bad_selections_explain_themselves(kwargs: dict, message: str) -> None:
    with pytest.raises(LaunchConfigError) as info:
        plan(inventory=real(EIGHT), **kwargs)
    assert message in str(info.value)


def test_the_public_plan_checks_the_options_first() -> None:
    with pytest.raises(LaunchConfigError, match="backend='ncl' must be"):
        accelnb.plan(gpus="0", backend="ncl", inventory=real(EIGHT))
    with pytest.raises(LaunchConfigError, match="num_processes must be at least 1"):
        accelnb.plan(num_processes=0, inventory=real(EIGHT))


def test_without_gpus_the_error_says_to_pass_num_processes() -> None:
    with pytest.raises(GpuSelectionError, match=r"No GPU is visible .*num_processes=N"):
        plan(inventory=NONE)
    with pytest.raises(LaunchConfigError, match="backend='nccl' needs GPUs"):
        plan(num_processes=2, inventory=NONE, backend="nccl")


def test_gpus_hidden_by_the_kernels_cuda_visible_devices_are_refused() -> None:
    # What read_inventory() returns under CUDA_VISIBLE_DEVICES=0,2: every GPU, 1 and 3+ hidden.
    hidden = Inventory(gpus=tuple(replace(g, visible=g.index in (0, 2)) for g in EIGHT.gpus), source="nvml")
    assert [r.gpu.index for r in plan("2,0", inventory=hidden).ranks if r.gpu] == [2, 0]
    assert len(plan(inventory=hidden).ranks) == 2
    with pytest.raises(GpuSelectionError, match="GPU 1 exists but is hidden from this kernel by its "
                                                r"CUDA_VISIBLE_DEVICES. Visible: 0 \(.*\), 2 \("):
        plan("1", inventory=hidden)


# ── ranks that own several GPUs (gpus_per_rank) ──────────────────────────────────────────────
def test_8_gpus_as_2_ranks_of_4_each_see_only_their_own_in_selection_order() -> None:
    p = plan("all", gpus_per_rank=4, inventory=real(EIGHT))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.ranks] == ["0,1,2,3", "4,5,6,7"]
    assert [[g.index for g in r.gpus] for r in p.ranks] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [r.env["WORLD_SIZE"] for r in p.ranks] == ["2", "2"] and p.backend == "nccl"
    # Each rank's device is what Accelerator() and `rank % device_count()` compute in it.
    assert [(r.device, r.gpu.index if r.gpu else None) for r in p.ranks] == [("cuda:0", 0), ("cuda:1", 5)]
    assert [r.env[DEVICE_ENV] for r in p.ranks] == ["cuda:0", "cuda:1"]
    assert all(r.env["ACCELERATE_BYPASS_DEVICE_MAP"] == "true" for r in p.ranks)


def test_selection_order_is_kept_within_each_rank() -> None:
    p = plan("6,2,7,3", gpus_per_rank=2, inventory=real(EIGHT))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.ranks] == ["6,2", "7,3"]


def test_two_gpus_one_rank_sees_both_as_cuda_0_and_1() -> None:
    p = plan("0,1", gpus_per_rank=2, inventory=real(EIGHT))
    assert len(p.ranks) == 1 and p.ranks[0].env["CUDA_VISIBLE_DEVICES"] == "0,1"
    assert p.ranks[0].device == "cuda:0" and p.ranks[0].env["WORLD_SIZE"] == "1"
    table = p.table(pids=[4242])
    assert "rank 0 → GPUs 0,1 as cuda:0-1, its device cuda:0  (pid 4242)" in table
    assert "cuda:0 → GPU 0 (" in table and "cuda:1 → GPU 1 (" in table


def test_num_processes_counts_ranks_of_several_gpus() -> None:
    p = plan(num_processes=3, gpus_per_rank=2, inventory=real(EIGHT))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.ranks] == ["0,1", "2,3", "4,5"]
    assert len(plan("0,1,2,3", num_processes=2, gpus_per_rank=2, inventory=real(EIGHT)).ranks) == 2


def test_one_gpu_per_rank_keeps_the_shared_layout() -> None:
    shared = plan("3,4", inventory=real(EIGHT))
    assert shared == plan("3,4", gpus_per_rank=1, inventory=real(EIGHT))
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in shared.ranks] == ["3,4", "3,4"]
    assert "ACCELERATE_BYPASS_DEVICE_MAP" not in shared.ranks[0].env


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"gpus": "0,1,2,3,4", "gpus_per_rank": 2},
     "gpus_per_rank=2 cannot divide the 5 selected GPU(s) (0, 1, 2, 3, 4) into whole ranks"),
    ({"gpus_per_rank": 3}, "gpus_per_rank=3 cannot divide the 8 selected GPU(s)"),
    ({"gpus": "0,1,2,3", "num_processes": 3, "gpus_per_rank": 2},
     "gpus= selects 4 GPU(s) but num_processes=3 × gpus_per_rank=2"),
    ({"num_processes": 5, "gpus_per_rank": 2}, "num_processes=5 × gpus_per_rank=2 asks for more GPUs than the 8"),
    ({"num_processes": 2, "gpus_per_rank": 2, "cpu": True}, "gpus_per_rank=2 needs GPUs"),
])
def test_layouts_that_do_not_divide_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(LaunchConfigError) as info:
        plan(inventory=real(EIGHT), **kwargs)
    assert message in str(info.value)


def test_several_gpus_per_rank_without_gpus_is_refused() -> None:
    with pytest.raises(GpuSelectionError, match="gpus_per_rank=2 needs GPUs, but no GPU is visible"):
        plan(num_processes=1, gpus_per_rank=2, inventory=NONE)


def test_a_synthetic_inventory_plans_the_layout_and_runs_it_on_cpu() -> None:
    p = accelnb.plan(gpus="0,1,2,3", gpus_per_rank=2, inventory=EIGHT)
    assert [r.device for r in p.ranks] == ["cpu", "cpu"] and p.backend == "gloo"
    assert [r.env["CUDA_VISIBLE_DEVICES"] for r in p.ranks] == ["0,1", "2,3"]
    assert "rank 1 → cpu, simulating GPUs 2,3" in p.table()
