"""What joining a launch's group ahead gains a launch, and what it costs (issue 35).

    python benchmarks/bench_group_ahead.py [--rounds 3] [--write]

The template's waiting children join the next launch's group while they wait
(``wire/group_ahead.py``, ``worker/template/standby_ranks.py``), where the kernel bets that the
next launch is like the last. A launch on a port the user chose makes no such bet: its waiting
children join at launch, as every launch did before. So the two configurations are the same
launch with ``master_port`` unset (**joined ahead**) and with a free port passed as
``master_port=`` (**joined at launch**; the port is picked outside the timed region).

From this process (a script), 2 CPU ranks, ``quiet=True``, a function that does one
``all_reduce`` and says whether its group was joined ahead; in each round, each configuration:

- **apart**: launches 0.5 s apart (the pause untimed), as cells a person runs;
- **back to back**: launches one after the other, where the waiting children have no idle
  moment to be forked in (they are let go, and the ranks join at launch).

The first launch after a change of configuration is not counted (it meets the other
configuration's waiting children). Configurations alternate within each round, so a burst of
load hits both. Also timed: the kernel's own part of the bet, per launch (the specs built once
more, the group compared, a socket bound for the next group). A benchmark, not a test: nothing
is asserted. ``--write`` replaces this script's section of ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

from results_file import replace_section, run_header  # benchmarks/ is on sys.path as the script's folder

import accelnb
from accelnb.kernel.planning.ports import bind_rendezvous_socket
from accelnb.kernel.planning.worker_specs import worker_specs
from accelnb.wire.group_ahead import group_ahead

HEADING = "## Joining a launch's group ahead: what it gains a launch (issue 35)"
LAUNCHES, PAUSE_S = 12, 0.5
CONFIGS = ("joined ahead", "joined at launch")


def one_all_reduce() -> bool:
    import torch
    import torch.distributed as dist

    from accelnb.worker.other_launchers import process_group

    total = torch.ones(1)
    dist.all_reduce(total)
    return process_group.joined_ahead()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def launches(config: str, pause_s: float) -> tuple[list[float], int]:
    """Wall seconds of LAUNCHES launches (after one not counted), and how many were joined ahead."""
    walls, ahead = [], 0
    for index in range(LAUNCHES + 1):
        options: dict[str, Any] = {} if config == "joined ahead" else {"master_port": free_port()}
        time.sleep(pause_s)
        started = time.perf_counter()
        result = accelnb.launch(one_all_reduce, num_processes=2, cpu=True, quiet=True, **options)
        took = time.perf_counter() - started
        if index:
            walls.append(took)
            ahead += bool(result.values[0])
    return walls, ahead


def kernel_part_us(repeats: int = 2000) -> float:
    """µs per launch of what the bet adds in the kernel: the specs once more, the comparison, the bind."""
    from accelnb.kernel.planning.inventory import read_inventory
    from accelnb.kernel.planning.rank_plan import plan

    the_plan = plan(num_processes=2, cpu=True, inventory=read_inventory())
    started = time.perf_counter()
    for _ in range(repeats):
        group_ahead(worker_specs(the_plan))
        bind_rendezvous_socket(None).close()
    return (time.perf_counter() - started) / repeats * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="replace this benchmark's section of RESULTS.md")
    options = parser.parse_args()
    load_before = os.getloadavg()
    began = time.monotonic()
    accelnb.launch(one_all_reduce, num_processes=2, cpu=True, quiet=True)  # the template is warm
    walls: dict[tuple[str, str], list[float]] = {}
    ahead: dict[tuple[str, str], int] = {}
    for round_index in range(options.rounds):
        for how, pause in (("apart", PAUSE_S), ("back to back", 0.0)):
            for config in CONFIGS[round_index % 2:] + CONFIGS[:round_index % 2]:
                taken, joined = launches(config, pause)
                walls.setdefault((how, config), []).extend(taken)
                ahead[(how, config)] = ahead.get((how, config), 0) + joined
                print(f"round {round_index + 1} {how} {config}: median {statistics.median(taken) * 1e3:.1f} ms, "
                      f"{joined} joined ahead", file=sys.stderr, flush=True)
    kernel_us = kernel_part_us()
    rows = ["| launches | configuration | min, ms | median, ms | max, ms | joined ahead |",
            "| --- | --- | --: | --: | --: | --: |"]
    for how in ("apart", "back to back"):
        for config in CONFIGS:
            seen = sorted(walls[(how, config)])
            rows.append(f"| {how} | {config} | {seen[0] * 1e3:.1f} | {statistics.median(seen) * 1e3:.1f} "
                        f"| {seen[-1] * 1e3:.1f} | {ahead[(how, config)]} of {len(seen)} |")
    gain = {how: statistics.median(walls[(how, "joined at launch")]) - statistics.median(walls[(how, "joined ahead")])
            for how in ("apart", "back to back")}
    text = "\n".join([
        *run_header(HEADING, "2 CPU ranks (gloo), from a script", load_before, time.monotonic() - began,
                    f"python benchmarks/bench_group_ahead.py --rounds {options.rounds}; "
                    f"{LAUNCHES} launches per configuration and round"),
        "",
        "The same 2-rank launch of a function that does one `all_reduce`: with `master_port` unset, the template's "
        "waiting children join the next launch's group ahead (`wire/group_ahead.py`); with a free port passed as "
        f"`master_port=`, they join at launch, as every launch did before. *apart*: {PAUSE_S:g} s between launches "
        "(untimed); *back to back*: none, where the children have no idle moment to be forked in before the next "
        "launch.",
        "",
        *rows, "",
        f"Joined ahead takes {gain['apart'] * 1e3:.1f} ms off the median launch apart. Back to back, a launch "
        "nearly always comes before the next group's children are forked (the last column), so both configurations "
        f"join at launch; their medians differ by {gain['back to back'] * 1e3:+.1f} ms, within each row's min–max. The "
        f"kernel's own part of the bet costs at most {kernel_us:.0f} µs a launch (the specs built once more to "
        "compare their group, and a socket bound for the next group).", "",
    ])
    print(text)
    if options.write:
        replace_section(HEADING, text)


if __name__ == "__main__":
    main()
