"""The cell's start table (accelnb.kernel.display.start_table): one line per rank, the GPUs' UUIDs
and bus ids in a detail the user opens, and all of it in ``plan(...).table()``."""

from __future__ import annotations

from dataclasses import replace

from accelnb.kernel.display.start_table import DETAIL_SUMMARY, show_start, start_bundle
from accelnb.kernel.planning.inventory import synthetic_inventory
from accelnb.kernel.planning.rank_plan import plan

REAL_LOOKING = replace(synthetic_inventory(8, name="NVIDIA H100 80GB HBM3"), synthetic=False, source="nvml")


def test_eight_ranks_take_nine_lines_with_device_gpu_index_and_name() -> None:
    the_plan = plan(inventory=REAL_LOOKING)
    lines = the_plan.summary(pids=range(100, 108)).splitlines()
    assert lines[0] == "accelnb: 8 rank(s), backend nccl"
    assert lines[1:] == [f"  rank {n} → cuda:{n} → GPU {n} (NVIDIA H100 80GB HBM3)  (pid {100 + n})"
                         for n in range(8)]


def test_the_full_table_keeps_the_uuids_and_bus_ids() -> None:
    table = plan(gpus=[5], inventory=REAL_LOOKING).table()
    assert "rank 0 → cuda:0 → GPU 5 (NVIDIA H100 80GB HBM3, GPU-00000000-0000-4000-8000-000000000005, " \
           "bus 00000000:1D:00.0)" in table


def test_ranks_of_several_gpus_take_one_line_each() -> None:
    the_plan = plan(gpus=[0, 1, 2, 3], num_processes=2, gpus_per_rank=2, inventory=REAL_LOOKING)
    assert the_plan.summary().splitlines()[1:] == [
        "  rank 0 → cuda:0-1 → GPUs 0,1 (NVIDIA H100 80GB HBM3), its device cuda:0",
        "  rank 1 → cuda:0-1 → GPUs 2,3 (NVIDIA H100 80GB HBM3), its device cuda:1"]


def test_the_notebook_gets_the_summary_and_the_full_table_in_a_closed_detail() -> None:
    the_plan = plan(gpus=[2, 3], inventory=REAL_LOOKING)
    bundle = start_bundle(the_plan, [11, 12])
    assert bundle["text/plain"] == the_plan.summary([11, 12])
    html = bundle["text/html"]
    summary_part, detail_part = html.split("<details", 1)
    assert "GPU-" not in summary_part and "rank 1 → cuda:1 → GPU 3" in summary_part
    assert f"<summary>{DETAIL_SUMMARY}</summary>" in detail_part and " open" not in detail_part.split(">")[0]
    assert "GPU-00000000-0000-4000-8000-000000000003" in detail_part


def test_outside_a_notebook_and_for_cpu_ranks_it_prints_the_summary() -> None:
    written: list[str] = []
    cpu_plan = plan(num_processes=2, inventory=synthetic_inventory(0), cpu=True)
    show_start(cpu_plan, [7, 8], sink=lambda _stream, text: written.append(text))
    assert written == ["accelnb: 2 rank(s), backend gloo\n  rank 0 → cpu  (pid 7)\n  rank 1 → cpu  (pid 8)\n"]
    gpu_plan = plan(gpus=[0], inventory=REAL_LOOKING)  # no IPython kernel in this test process
    show_start(gpu_plan, [9], sink=lambda _stream, text: written.append(text))
    assert written[-1] == gpu_plan.summary([9]) + "\n"
