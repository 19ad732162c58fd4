"""One tool's measurements, in one fresh process: ``python benchmarks/bench_launch.py --tool T --json``.

``benchmarks/run_all.py`` starts this once per tool, so that no tool's processes, imports or
threads disturb another's numbers, and prints the tables. Run alone, it prints one JSON object
(stdout carries nothing else: the tools' own chatter is moved to stderr).

Tools and what each process measures (2 ranks, gloo, CPU):

``accelnb``
    1. one-shot launch of a trivial function (``notebook_launcher``: the group is set up by
       accelnb; the function does one ``all_reduce`` and returns); the first launch of the process
       (it starts the helper that imports torch) separately, then ``--repeats`` later ones;
    6. RSS of this process before the first launch, after it, and after 20 more launches;
       ``torch.cuda.is_initialized()`` here;
    2. persistent session: ``Session.start`` once, then ``--calls`` round trips of the same
       trivial function in the running workers (process group kept);
    3. a 200-step MLP training launched per call: wall time of the whole ``notebook_launcher``
       call, which includes building the optimizer in a fresh worker;
    5. 100,000 short lines printed by rank 0, timed inside the function: once to ``sys.stdout``
       (relayed by accelnb to this process, which stands in for the notebook), once to
       ``/dev/null``, alternating; the sink counts what arrived;
    1b. last, launches back to back from a long notebook: ``NOTEBOOK_CELLS`` distinct cells in
       ``linecache`` as IPython registers them (no file on disk), and one more before each launch,
       as each launch's cell is new (what grows with a notebook shows here).

``accelerate``
    Accelerate's ``notebook_launcher(fn, args, num_processes=2)``. Called from a script it takes
    its multi-device branch (``in_colab``/``in_kaggle`` are false without a Colab/Kaggle
    kernel), forks workers through ``torch.distributed`` elastic with a static rendezvous on
    ``use_port``. On a machine without CUDA it still calls the device ``cuda``/``MULTI_GPU``
    (``get_current_device_type``'s fallback) and prints "Launching training on 2 CUDAs.": that
    only affects its message; the workers get RANK/WORLD_SIZE/MASTER_* and the function sets up
    its own gloo group with ``init_process_group("gloo")`` (env://), as a user's function (or
    ``Accelerator()``) does. Each launch gets a free ``use_port`` (picked outside the timed
    region): the default fixed 29500 can collide with a previous launch's lingering sockets, and
    a fresh port is what a careful user would pass. Its launcher discards the function's return
    value, so the training's rank 0 result comes back through a temporary file. Accelerate leaves
    the workers' intra-op threads at torch's default (every core, in each rank), unlike accelnb,
    Fabric and the plain baseline (``cpu_count // 2``): the training runs both ways, with the
    function setting the thread count (which isolates the launcher) and as is (what a user gets;
    on a busy 2-core machine the oversubscribed ranks can take minutes, so that variant stops
    repeating after one run longer than ``--slow-cap-s``). Measures 1, 3 and the memory growth
    of 6.

``fabric``
    Lightning Fabric: ``Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook")
    .launch(fn)``, constructed per launch (inside the timed region). ``ddp_notebook`` forks this
    process (``torch.multiprocessing`` "fork"); its interactive-environment check only refuses
    non-fork strategies in notebooks, so it runs unchanged from a script. Fabric sets up the gloo
    group itself (``setup_environment`` in each worker) and returns rank 0's value. Note that
    ``import lightning.fabric`` imports ``torch._dynamo`` in the launching process, so Fabric's
    forked workers inherit it: that is what happens in a real notebook too. Measures 1, 3 and
    the memory growth of 6.

``plain``
    The floor: ``torch.multiprocessing.start_processes(..., start_method="fork")`` of this
    process, each worker joining a gloo group through a TCPStore on a free loopback port
    (env://, ``GLOO_SOCKET_IFNAME=lo``), running the function, destroying the group. Measures 1
    and 3 for reference.

``throughput``
    4. steps/s of the same DDP training loop measured inside the function (20 warm-up steps
    excluded, then 200 timed), under accelnb and under plain fork as above, alternating
    launches (A B A B …) so that the load of this shared machine hits both alike. Both use
    ``cpu_count // 2`` intra-op threads per rank (what accelnb sets; without it two ranks of
    two threads each would oversubscribe two cores and the baseline would be slower for a
    reason that has nothing to do with the launcher). This process imports ``torch._dynamo``
    before forking, so plain workers do not spend seconds of each launch importing it in their
    warm-up (excluded from steps/s anyway); accelnb's workers have it from their helper.

Every function that runs in workers is defined at module level here (``__main__``), so
cloudpickle ships it by value to accelnb's workers and the forking launchers inherit it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import itertools
import json
import linecache
import os
import re
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)  # benchmark this working tree, not an installed copy

import torch  # noqa: E402  (after the path fix; imported up front by every tool alike)
import torch.distributed as dist  # noqa: E402

WORLD_SIZE = 2
TRAIN_STEPS = 200
WARMUP_STEPS = 20
PRINT_LINES = 100_000
# Scenario 1 twice: launches SPACING_S apart (untimed), as cells a person runs, then back to back:
# a launcher that prepares the next launch while idle (accelnb's template forks the next ranks)
# shows it only in the first; what it does in the first pauses (accelnb's template moves its memory
# onto 2 MiB pages) both show, as in a notebook that has run a while.
SPACING_S = 0.5
NOTEBOOK_CELLS = 3000  # a long notebook's distinct cells (each edit of a cell is a new one)
CELL_NUMBERS = itertools.count()


# ── functions that run in the workers ───────────────────────────────────────────────────────
def allreduce_once() -> float:
    """The trivial function: one all_reduce in the group the launcher set up."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return float(t.item())


def allreduce_fabric(fabric: Any) -> float:
    return allreduce_once()


def allreduce_env_group() -> float:
    """For Accelerate: the function joins the group from the launcher's environment."""
    dist.init_process_group("gloo")
    try:
        return allreduce_once()
    finally:
        dist.destroy_process_group()


def mlp_training(steps: int = TRAIN_STEPS, warmup: int = 0) -> dict[str, float]:
    """A 200-step DDP training of Linear(64,256)-ReLU-Linear(256,10), batch 64, Adam.

    Returns the timed loop's steps/s (after ``warmup`` untimed steps) and the final loss.
    """
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(1234 + dist.get_rank())
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.CrossEntropyLoss()
    x = torch.randn(64, 64)
    y = torch.randint(0, 10, (64,))

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    for _ in range(warmup):
        step()
    started = time.perf_counter()
    for _ in range(steps):
        loss = step()
    elapsed = time.perf_counter() - started
    return {"steps_per_s": steps / elapsed, "loop_s": elapsed, "loss": float(loss.item())}


def mlp_training_env_group(result_path: str, set_threads: bool) -> None:
    """For Accelerate (which discards return values): join the group, train, rank 0 writes.

    ``set_threads``: use ``cpu_count // 2`` intra-op threads, as accelnb, Fabric and the plain
    baseline do; without it torch's default (every core, per rank) is what Accelerate gives.
    """
    if set_threads:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD_SIZE))
    dist.init_process_group("gloo")
    try:
        result = mlp_training()
        if dist.get_rank() == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
    finally:
        dist.destroy_process_group()


def mlp_training_fabric(fabric: Any) -> dict[str, float]:
    return mlp_training()


def print_lines(count: int, to_devnull: bool) -> float | None:
    """Rank 0 prints ``count`` short lines; returns the seconds the loop took (incl. flush)."""
    if dist.get_rank() != 0:
        return None
    stream = open(os.devnull, "w") if to_devnull else sys.stdout  # noqa: SIM115
    try:
        started = time.perf_counter()
        for i in range(count):
            print(f"step {i} loss 0.{i:06d}", file=stream)
        stream.flush()
        return time.perf_counter() - started
    finally:
        if to_devnull:
            stream.close()


# ── plain torch.multiprocessing (fork), the floor ───────────────────────────────────────────
def _plain_worker(index: int, fn: Callable[..., Any], args: tuple[Any, ...], port: int,
                  results: Any) -> None:
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), WORLD_SIZE=str(WORLD_SIZE),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD_SIZE))
    dist.init_process_group("gloo", rank=index, world_size=WORLD_SIZE)
    try:
        value = fn(*args)
    finally:
        dist.destroy_process_group()
    if index == 0:
        results.put(value)


def plain_fork_launch(fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> Any:
    import torch.multiprocessing as mp

    results = mp.get_context("fork").SimpleQueue()
    mp.start_processes(_plain_worker, args=(fn, args, free_port(), results), nprocs=WORLD_SIZE,
                       start_method="fork")
    return results.get()


# ── helpers ─────────────────────────────────────────────────────────────────────────────────
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mb() -> float:
    import psutil

    gc.collect()
    return float(psutil.Process().memory_info().rss / 2**20)


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = call()
    return time.perf_counter() - started, value


def add_notebook_cell() -> None:
    """One more distinct cell of ~240 characters in ``linecache``, as IPython registers a cell it runs."""
    number = next(CELL_NUMBERS)
    name = f"/tmp/ipykernel_{os.getpid()}/{number}.py"
    text = f"y{number} = 1  # a distinct cell, " + "as a notebook's are " * 10 + "\n"
    linecache.cache[name] = (len(text), None, [text], name)


def repeat(call: Callable[[], Any], times: int) -> list[float]:
    return [timed(call)[0] for _ in range(times)]


def spaced(call: Callable[[], Any], times: int) -> list[float]:
    """``times`` timed calls, each after SPACING_S of idleness (not timed)."""
    durations = []
    for _ in range(times):
        time.sleep(SPACING_S)  # the pause between two cells is what is measured against, not a wait for anything
        durations.append(timed(call)[0])
    return durations


def scenario(results: dict[str, Any], name: str, body: Callable[[], dict[str, Any]]) -> None:
    """Run one scenario; a failure is recorded as the scenario's reason, not raised."""
    try:
        results[name] = body()
    except BaseException as error:  # report it, keep measuring the rest
        if isinstance(error, KeyboardInterrupt):
            raise
        results[name] = {"error": f"{type(error).__name__}: {error}".strip()[:500]}
        traceback.print_exc()


class CountingSink:
    """Stands in for the notebook: counts the lines accelnb's router delivers."""

    _skipped = re.compile(r"\[accelnb: skipped ([\d,]+) lines")

    def __init__(self) -> None:
        self.lines = 0
        self.skipped = 0
        self.bytes = 0

    def write(self, text: str) -> int:
        self.bytes += len(text)
        self.lines += text.count("\n")
        for match in self._skipped.finditer(text):
            self.skipped += int(match.group(1).replace(",", ""))
            self.lines -= 1  # the marker line itself
        return len(text)

    def flush(self) -> None:
        pass


# ── per tool ────────────────────────────────────────────────────────────────────────────────
def bench_accelnb(opts: argparse.Namespace) -> dict[str, Any]:
    import accelnb
    from accelnb.session import Session

    out: dict[str, Any] = {}

    def launch_trivial() -> float:
        return float(accelnb.notebook_launcher(allreduce_once, num_processes=WORLD_SIZE, quiet=True))

    rss_before_first = rss_mb()

    def one_shot() -> dict[str, Any]:
        first, value = timed(launch_trivial)
        assert value == WORLD_SIZE, value
        apart = spaced(launch_trivial, opts.repeats)  # first: as a notebook's cells come (module docstring)
        return {"first_s": first, "later_s": repeat(launch_trivial, opts.repeats),
                "spaced_s": apart, "spacing_s": SPACING_S}

    scenario(out, "launch", one_shot)

    def memory() -> dict[str, Any]:
        after_first = rss_mb()
        for _ in range(opts.memory_launches):
            launch_trivial()
        after = rss_mb()
        return {"rss_before_first_mb": rss_before_first, "rss_after_first_mb": after_first,
                "rss_after_mb": after, "launches": opts.memory_launches,
                "growth_mb": after - after_first, "cuda_initialized": torch.cuda.is_initialized()}

    scenario(out, "memory", memory)

    def session() -> dict[str, Any]:
        start_s, s = timed(lambda: Session.start(num_processes=WORLD_SIZE, quiet=True))
        try:
            for _ in range(3):  # warm-up: first calls unpickle and touch code paths once
                s.run(allreduce_once)
            calls = []
            for _ in range(opts.calls):
                seconds, result = timed(lambda: s.run(allreduce_once))
                assert result.values == {0: 2.0, 1: 2.0}, result.values
                calls.append(seconds)
        finally:
            s.stop()
        return {"start_s": start_s, "call_s": calls}

    scenario(out, "session", session)

    scenario(out, "training", lambda: training_runs(
        lambda: timed(lambda: accelnb.notebook_launcher(mlp_training, num_processes=WORLD_SIZE, quiet=True)),
        opts.train_repeats))

    def output() -> dict[str, Any]:
        runs: dict[str, list[float]] = {"stdout": [], "devnull": []}
        delivered, skipped, retained, launch_s = [], [], [], []
        for _ in range(opts.output_pairs):
            for mode in ("devnull", "stdout"):
                sink = CountingSink()
                with contextlib.redirect_stdout(sink):  # type: ignore[type-var]
                    seconds, result = timed(functools.partial(
                        accelnb.launch, print_lines, (opts.print_lines, mode == "devnull"),
                        num_processes=WORLD_SIZE, quiet=True, collect="rank0"))
                runs[mode].append(result.value)
                if mode == "stdout":
                    delivered.append(sink.lines)
                    skipped.append(sink.skipped)
                    retained.append(result.output(0).count("\n"))
                    launch_s.append(seconds)
        return {"lines": opts.print_lines, "stdout_s": runs["stdout"], "devnull_s": runs["devnull"],
                "shown_lines": delivered, "skipped_lines": skipped, "retained_lines": retained,
                "launch_s": launch_s}

    scenario(out, "output", output)

    def launch_from_a_new_cell() -> float:
        add_notebook_cell()
        return launch_trivial()

    def long_notebook() -> dict[str, Any]:
        for _ in range(NOTEBOOK_CELLS):
            add_notebook_cell()
        return {"cells": NOTEBOOK_CELLS, "later_s": repeat(launch_from_a_new_cell, opts.repeats)}

    scenario(out, "long_notebook", long_notebook)
    out.setdefault("memory", {})["cuda_initialized_at_end"] = torch.cuda.is_initialized()
    return out


def bench_accelerate(opts: argparse.Namespace) -> dict[str, Any]:
    from accelerate import notebook_launcher

    out: dict[str, Any] = {}

    def launch_trivial() -> None:
        port = str(free_port())
        notebook_launcher(allreduce_env_group, (), num_processes=WORLD_SIZE, use_port=port)

    _peer(out, opts, launch_trivial, lambda: _accelerate_training(notebook_launcher, True))

    def default_threads() -> dict[str, Any]:
        # As a user gets it: torch's default intra-op threads (all cores in each rank). On a busy
        # 2-core machine this can take minutes, so stop repeating once one run exceeds the cap.
        runs = []
        for _ in range(opts.train_repeats):
            runs.append(_accelerate_training(notebook_launcher, False))
            if runs[-1][0] > opts.slow_cap_s:
                break
        return {"total_s": [seconds for seconds, _ in runs], "loop_s": [v["loop_s"] for _, v in runs],
                "capped_at_s": opts.slow_cap_s}

    scenario(out, "training_default_threads", default_threads)
    return out


def _accelerate_training(notebook_launcher: Callable[..., Any],
                         set_threads: bool) -> tuple[float, dict[str, float]]:
    port = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        seconds, _ = timed(lambda: notebook_launcher(mlp_training_env_group, (path, set_threads),
                                                     num_processes=WORLD_SIZE, use_port=port))
        with open(path) as f:
            return seconds, json.load(f)  # the file is also proof that rank 0 finished


def bench_fabric(opts: argparse.Namespace) -> dict[str, Any]:
    from lightning.fabric import Fabric

    def launch_trivial() -> None:
        fabric = Fabric(accelerator="cpu", devices=WORLD_SIZE, strategy="ddp_notebook")
        value = fabric.launch(allreduce_fabric)
        assert value == WORLD_SIZE, value

    def training() -> tuple[float, dict[str, float]]:
        return timed(lambda: Fabric(accelerator="cpu", devices=WORLD_SIZE,
                                    strategy="ddp_notebook").launch(mlp_training_fabric))

    return _peer({}, opts, launch_trivial, training)


def bench_plain(opts: argparse.Namespace) -> dict[str, Any]:
    def launch_trivial() -> None:
        assert plain_fork_launch(allreduce_once) == WORLD_SIZE

    def training() -> tuple[float, dict[str, float]]:
        return timed(lambda: plain_fork_launch(mlp_training))

    out: dict[str, Any] = {}
    scenario(out, "launch", lambda: {"first_s": timed(launch_trivial)[0],
                                     "later_s": repeat(launch_trivial, opts.repeats),
                                     "spaced_s": spaced(launch_trivial, opts.repeats), "spacing_s": SPACING_S})
    scenario(out, "training", lambda: training_runs(training, opts.train_repeats))
    return out


def _peer(out: dict[str, Any], opts: argparse.Namespace, launch_trivial: Callable[[], None],
          training: Callable[[], tuple[float, dict[str, float]]]) -> dict[str, Any]:
    """Scenarios 1, 6 (memory growth) and 3 for a launcher that forks this process."""
    rss_before_first = rss_mb()

    def one_shot() -> dict[str, Any]:
        first = timed(launch_trivial)[0]
        apart = spaced(launch_trivial, opts.repeats)  # in the same order as accelnb's
        return {"first_s": first, "later_s": repeat(launch_trivial, opts.repeats), "spaced_s": apart,
                "spacing_s": SPACING_S}

    def memory() -> dict[str, Any]:
        before = rss_mb()
        for _ in range(opts.memory_launches):
            launch_trivial()
        after = rss_mb()
        return {"rss_before_first_mb": rss_before_first, "rss_after_first_mb": before,
                "rss_after_mb": after, "launches": opts.memory_launches,
                "growth_mb": after - before, "cuda_initialized": torch.cuda.is_initialized()}

    scenario(out, "launch", one_shot)
    scenario(out, "memory", memory)
    scenario(out, "training", lambda: training_runs(training, opts.train_repeats))
    return out


def training_runs(training: Callable[[], tuple[float, dict[str, float]]], times: int) -> dict[str, Any]:
    """``times`` launches of the 200-step training: wall time of each, and its inner loop time."""
    runs = [training() for _ in range(times)]
    return {"total_s": [seconds for seconds, _ in runs], "loop_s": [value["loop_s"] for _, value in runs]}


def bench_throughput(opts: argparse.Namespace) -> dict[str, Any]:
    import torch._dynamo  # noqa: F401  (plain fork's workers inherit it, as accelnb's do; see above)

    import accelnb

    out: dict[str, Any] = {}

    def pairs() -> dict[str, Any]:
        accelnb.notebook_launcher(allreduce_once, num_processes=WORLD_SIZE, quiet=True)  # start the helper
        runs: dict[str, list[float]] = {"accelnb": [], "plain": []}
        for _ in range(opts.throughput_pairs):
            value = accelnb.notebook_launcher(mlp_training, (TRAIN_STEPS, WARMUP_STEPS),
                                              num_processes=WORLD_SIZE, quiet=True)
            runs["accelnb"].append(value["steps_per_s"])
            value = plain_fork_launch(mlp_training, (TRAIN_STEPS, WARMUP_STEPS))
            runs["plain"].append(value["steps_per_s"])
        return {"steps_per_s": runs, "steps": TRAIN_STEPS, "warmup": WARMUP_STEPS}

    scenario(out, "throughput", pairs)
    return out


TOOLS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "accelnb": bench_accelnb,
    "accelerate": bench_accelerate,
    "fabric": bench_fabric,
    "plain": bench_plain,
    "throughput": bench_throughput,
}


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name in ("accelerate", "lightning"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=sorted(TOOLS), required=True)
    parser.add_argument("--json", action="store_true", help="print only a JSON object on stdout")
    # 30, not 10: on a 2-core VM a median of 10 launches back to back moved by a third between runs.
    parser.add_argument("--repeats", type=int, default=30, help="later one-shot launches")
    parser.add_argument("--calls", type=int, default=50, help="session round trips")
    parser.add_argument("--train-repeats", type=int, default=3)
    parser.add_argument("--throughput-pairs", type=int, default=10)
    parser.add_argument("--output-pairs", type=int, default=5)
    parser.add_argument("--print-lines", type=int, default=PRINT_LINES)
    parser.add_argument("--memory-launches", type=int, default=20)
    parser.add_argument("--slow-cap-s", type=float, default=20.0,
                        help="Accelerate with default threads: no more runs once one takes longer")
    opts = parser.parse_args(argv)

    # stdout is reserved for the result: the tools print banners and the forked workers inherit
    # fd 1, so point fd 1 (and sys.stdout) at stderr and keep a private copy for the JSON.
    result_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)

    started = time.perf_counter()
    data = TOOLS[opts.tool](opts)
    data["meta"] = {"tool": opts.tool, "seconds": time.perf_counter() - started, "versions": versions()}
    text = json.dumps(data, indent=None if opts.json else 2)
    with os.fdopen(result_fd, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
