"""Code written for other launchers, run unchanged: ``accelnb.spawn``, ``accelnb.torchrun`` and
``%torchrun``, a launch inside a launch, torchrun's environment, ``group_timeout=``.

Real launches of 2 CPU ranks (gloo), and real kernels for the magic and the Stop button. The
scripts are written the way pytorch/examples' ddp-tutorial-series and torchrun users write them
(``init_process_group(backend=...)`` from the environment, argparse, ``if __name__ ==
"__main__":``); the functions the way the PyTorch DDP tutorial writes them. Where a peer exists
it runs on the same code in the same test: ``torchrun`` itself on the script (the variables it
sets are the ones accelnb sets), ``mp.spawn`` from a notebook cell (it cannot unpickle the cell's
function; ``accelnb.spawn`` can).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import accelnb
from accelnb import LaunchConfigError, LaunchInsideLaunchError, RankFailed, ScriptExited, launch
from accelnb.other_launchers import parse_torchrun
from tests.conftest import live_descendants, worker_processes
from tests.test_rank_input import Kernel

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


# ── accelnb.spawn ───────────────────────────────────────────────────────────────────────────
class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(10, 10), nn.ReLU(), nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank: int, world_size: int) -> list[float]:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = ToyModel()
    ddp_model = DDP(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    nn.MSELoss()(ddp_model(torch.randn(20, 10) * (rank + 1)), torch.randn(20, 5)).backward()
    optimizer.step()
    dist.destroy_process_group()
    return [rank, *(round(float(w), 6) for w in model.net2.weight.detach().flatten()[:3])]


@pytest.mark.usefixtures("no_leftovers")
def test_spawn_runs_the_tutorials_function_and_returns_every_ranks_value_in_rank_order() -> None:
    values = accelnb.spawn(demo_basic, args=(2,), nprocs=2, cpu=True, quiet=True)
    assert [v[0] for v in values] == [0, 1]
    assert values[0][1:] == values[1][1:]  # DDP averaged the gradients


@pytest.mark.usefixtures("no_leftovers")
@pytest.mark.parametrize(("keywords", "says"), [
    ({"nprocs": 2, "join": False}, "join=False"),
    ({"nprocs": 0}, "nprocs is the number of ranks"),
    ({"nprocs": 2, "num_processes": 2}, "takes nprocs="),
    ({"nprocs": 2, "timout": 5}, "did you mean 'timeout'"),
])
def test_spawn_refuses_bad_input_before_anything_starts(keywords: dict[str, object], says: str) -> None:
    with pytest.raises(LaunchConfigError, match=says):
        accelnb.spawn(demo_basic, args=(2,), quiet=True, **keywords)  # type: ignore[arg-type]
    assert worker_processes() == []


def run_demo(world_size: int, nprocs: int) -> str:
    import torch.multiprocessing as mp

    mp.spawn(demo_basic, args=(world_size,), nprocs=nprocs, join=True)  # the tutorial's run_demo
    return "done"


@pytest.mark.usefixtures("no_leftovers")
def test_mp_spawn_inside_a_launch_runs_in_place_or_refuses_at_once() -> None:
    assert launch(run_demo, args=(2, 2), num_processes=2, cpu=True, quiet=True).values == {0: "done", 1: "done"}
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(run_demo, args=(4, 4), num_processes=2, cpu=True, quiet=True, timeout=60)
    assert time.monotonic() - started < 30  # at once: not the launch's timeout=60
    assert isinstance(failed.value, LaunchInsideLaunchError)
    assert "nprocs=4" in str(failed.value) and "launch of 2 ranks" in str(failed.value)


def launches_again() -> object:
    return accelnb.launch(int, num_processes=2, cpu=True, quiet=True).values


@pytest.mark.usefixtures("no_leftovers")
def test_accelnb_inside_a_rank_is_refused_at_once_and_starts_nothing() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(launches_again, num_processes=2, cpu=True, quiet=True, timeout=60)
    assert time.monotonic() - started < 30  # at once: not the launch's timeout=60
    assert isinstance(failed.value, LaunchInsideLaunchError)
    assert "a launch inside a launch" in str(failed.value)


# ── torchrun ─────────────────────────────────────────────────────────────────────────────────
TRAIN_SCRIPT = """
import argparse, json, os, sys

import torch
import torch.distributed as dist
from torch.distributed import destroy_process_group, init_process_group

import sibling  # next to the script: sys.path[0] is the script's folder


def main(args):
    init_process_group(backend="gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    seen = {
        "name": __name__, "argv": sys.argv, "epochs": args.epochs, "cwd": os.getcwd(),
        "sum": total.item(), "elastic": dist.is_torchelastic_launched(), "sibling": sibling.VALUE,
        "env": {k: os.environ.get(k) for k in json.loads(os.environ["WANTED"])},
    }
    with open(f"seen-{rank}.json", "w") as out:
        json.dump(seen, out)
    print(f"rank {rank} done", flush=True)
    destroy_process_group()
    if rank == args.fail_rank:
        sys.exit(args.code)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--code", type=int, default=3)
    main(parser.parse_args())
"""


@pytest.fixture
def script_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "train.py").write_text(TRAIN_SCRIPT)
    (tmp_path / "scripts" / "sibling.py").write_text("VALUE = 7\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANTED", json.dumps(TORCHRUN_VARIABLES))
    return tmp_path


def seen(folder: Path) -> dict[int, dict[str, object]]:
    return {rank: json.loads((folder / f"seen-{rank}.json").read_text()) for rank in (0, 1)}


@pytest.mark.usefixtures("no_leftovers")
def test_a_torchrun_script_runs_as_main_with_its_argv_and_torchruns_environment(script_folder: Path) -> None:
    result = accelnb.torchrun("--nproc-per-node 2 --standalone scripts/train.py --epochs 3", cpu=True, quiet=True)
    assert result.values == {0: None, 1: None}
    ours = seen(script_folder)
    for rank in (0, 1):
        assert ours[rank]["name"] == "__main__" and ours[rank]["argv"] == ["scripts/train.py", "--epochs", "3"]
        assert ours[rank]["epochs"] == 3 and ours[rank]["sum"] == 1.0 and ours[rank]["sibling"] == 7
        assert ours[rank]["cwd"] == str(script_folder) and ours[rank]["elastic"] is True
    env = ours[1]["env"]
    assert isinstance(env, dict)
    assert env["RANK"] == env["ROLE_RANK"] == "1" and env["GROUP_RANK"] == "0" and env["ROLE_NAME"] == "default"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "0"
    assert env["TORCHELASTIC_RUN_ID"] == f"accelnb-{result.plan.master_port}"

    # torchrun itself on the same script: every variable it sets, accelnb sets too.
    for stale in script_folder.glob("seen-*.json"):
        stale.unlink()
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run([str(torchrun), "--nproc-per-node", "2", "--standalone", "scripts/train.py", "--epochs", "3"],
                   check=True, timeout=120, capture_output=True, env={**os.environ, "GLOO_SOCKET_IFNAME": "lo"})
    theirs = seen(script_folder)
    set_by_torchrun = {name for name, value in theirs[1]["env"].items() if value is not None}  # type: ignore[union-attr]
    set_by_accelnb = {name for name, value in env.items() if value is not None}
    assert set_by_torchrun == set(TORCHRUN_VARIABLES) == set_by_accelnb
    assert theirs[1]["argv"] == ours[1]["argv"] and theirs[1]["sum"] == ours[1]["sum"]


@pytest.mark.usefixtures("no_leftovers")
def test_a_module_runs_with_dash_m(script_folder: Path) -> None:
    package = script_folder / "trainer_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "train.py").write_text(TRAIN_SCRIPT.replace("import sibling", "from trainer_pkg import sibling"))
    (package / "sibling.py").write_text("VALUE = 8\n")
    accelnb.torchrun(["--nproc_per_node=2", "-m", "trainer_pkg.train", "--epochs", "2"], cpu=True, quiet=True)
    ours = seen(script_folder)
    assert ours[0]["name"] == "__main__" and ours[0]["sibling"] == 8 and ours[0]["epochs"] == 2
    assert ours[0]["argv"] == [str(package / "train.py"), "--epochs", "2"]  # what python -m puts there


@pytest.mark.usefixtures("no_leftovers", "script_folder")
def test_a_non_zero_exit_code_fails_the_run_with_the_rank_the_code_and_the_line() -> None:
    with pytest.raises(RankFailed) as failed:
        accelnb.torchrun("--nproc-per-node 2 scripts/train.py --fail-rank 1 --code 4", cpu=True, quiet=True)
    assert isinstance(failed.value, ScriptExited)
    message = str(failed.value)
    assert message.startswith("Rank 1 failed") and "scripts/train.py exited with code 4" in message
    assert "sys.exit(args.code)" in message  # the line that exited, from the rank's traceback
    assert "runpy" not in message  # as `python train.py` shows it: the script's frames first


@pytest.mark.usefixtures("no_leftovers", "script_folder")
def test_max_restarts_runs_the_script_again() -> None:
    Path("scripts/flaky.py").write_text(textwrap.dedent("""
        import os, sys
        import torch.distributed as dist
        dist.init_process_group("gloo")
        attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        print(f"attempt {attempt}", flush=True)
        if attempt == 0 and dist.get_rank() == 1:
            sys.exit(1)
    """))
    result = accelnb.torchrun("--max-restarts 1 --nproc-per-node 2 scripts/flaky.py", cpu=True, quiet=True)
    assert result.values == {0: None, 1: None}
    assert "attempt 1" in result.output(0)


@pytest.mark.usefixtures("no_leftovers", "script_folder")
@pytest.mark.parametrize(("command", "says"), [
    ("--nnodes 2 --nproc-per-node 2 scripts/train.py", "--nnodes 2: %torchrun runs the ranks on this machine"),
    ("--nnodes 2:4 scripts/train.py", "--nnodes 2:4"),
    ("--node-rank 1 scripts/train.py", "--node-rank 1"),
    ("--master-addr 10.1.2.3 scripts/train.py", "--master-addr 10.1.2.3"),
    ("--rdzv-endpoint node7:29400 scripts/train.py", "--rdzv-endpoint node7"),
    ("--no-python scripts/train.py", "keep !torchrun --no-python"),
    ("--nproc-per-node many scripts/train.py", "give a number, or gpu, cpu or auto"),
    ("--nproc-per-node 2 scripts/missing.py", "no such file"),
    ("--nproc-per-node 2 -m no_such_module_here", "no module of that name"),
    ("--nproc-per-node 2", "the following arguments are required: script"),
    ("--timeout -1 scripts/train.py", "timeout"),
])
def test_a_flag_that_makes_no_sense_here_is_refused_with_the_reason(command: str, says: str) -> None:
    with pytest.raises(LaunchConfigError, match=None) as refused:
        accelnb.torchrun(command)
    assert says in str(refused.value), str(refused.value)
    assert worker_processes() == []


def test_torchruns_own_flags_and_accelnbs_mix_and_the_script_keeps_its_own() -> None:
    parsed = parse_torchrun("torchrun --standalone --nproc_per_node=2 --rdzv-backend c10d --timeout 30 "
                            "--output all --max_restarts 2 train.py --timeout 5 --lr 0.1")
    assert parsed.target == "train.py" and parsed.arguments == ("--timeout", "5", "--lr", "0.1")
    assert parsed.options == {"num_processes": 2, "timeout": 30.0, "output": "all", "max_restarts": 2}
    assert parse_torchrun("--nproc-per-node cpu x.py").options == {"num_processes": os.cpu_count(), "cpu": True}


# ── %torchrun in a notebook, and its Stop button ──────────────────────────────────────────────
WAITS_SCRIPT = """
import os, subprocess, sys, time
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
# A helper of the script's own, in its own session, as log shippers and data servers start.
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
with open(f"pids-{rank}.txt", "w") as out:
    out.write(f"{os.getpid()} {child.pid}")
dist.barrier()
if rank == 0:
    print("every rank is running", flush=True)
while True:
    time.sleep(0.1)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    from tests.conftest import start_repo_kernel

    folder = tmp_path_factory.mktemp("torchrun")
    (folder / "train.py").write_text(TRAIN_SCRIPT)
    (folder / "sibling.py").write_text("VALUE = 7\n")
    (folder / "waits.py").write_text(WAITS_SCRIPT)
    manager, client = start_repo_kernel(WANTED=json.dumps(TORCHRUN_VARIABLES))
    session = Kernel(manager, client)
    msg_id = session.execute(f"%load_ext accelnb\nimport os, json\nos.chdir({str(folder)!r})\n"
                             "print(json.dumps({'kernel': os.getpid()}))")
    assert session.finish(msg_id, timeout=120)["content"]["status"] == "ok"
    session.kernel_pid = json.loads(session.stream(msg_id))["kernel"]
    try:
        yield session
    finally:
        session.client.stop_channels()
        manager.shutdown_kernel(now=True)


def test_percent_torchrun_is_bang_torchrun_with_one_character_changed(kernel: Kernel) -> None:
    msg_id = kernel.execute("%torchrun --cpu --nproc-per-node 2 train.py --epochs 2")
    assert kernel.finish(msg_id, timeout=120)["content"]["status"] == "ok"
    assert "rank 0 done" in kernel.stream(msg_id)  # rank 0's output, live in the cell
    assert not any(m["header"]["msg_type"] == "execute_result" and m["parent_header"].get("msg_id") == msg_id
                   for m in kernel.iopub)  # like !torchrun, the cell has no Out[]
    msg_id = kernel.execute("%torchrun --nnodes 2 train.py")
    reply = kernel.finish(msg_id)["content"]
    assert reply["status"] == "error" and reply["ename"] == "UsageError"  # a short message, no traceback
    assert "runs the ranks on this machine" in reply["evalue"]


REPORTS_SCRIPT = """
import torch.distributed as dist
import accelnb

dist.init_process_group("gloo")
for step in range(3):
    accelnb.report(step=step, loss=1.0 / (step + 1))
dist.destroy_process_group()
"""


def test_percent_torchrun_writes_the_scripts_reports_to_log_dir(kernel: Kernel) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = Path(kernel_cwd(kernel))
    (folder / "reports.py").write_text(REPORTS_SCRIPT)
    msg_id = kernel.execute("%torchrun --cpu --nproc-per-node 2 --log-dir runs/script reports.py")
    assert kernel.finish(msg_id, timeout=120)["content"]["status"] == "ok", kernel.stream(msg_id)
    events = EventAccumulator(str(folder / "runs" / "script"))
    events.Reload()
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("loss")] == [(0, 1.0), (1, 0.5), (2, 0.333)]


def _processes_left(pids: list[int], bound_s: float) -> list[int]:
    """The pids still alive once ``bound_s`` is up (or at once, when none is)."""
    deadline = time.monotonic() + bound_s
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _running(pid)]
        time.sleep(0.05)
    return alive


@pytest.mark.parametrize("when", ["starting", "running"])
def test_stop_during_percent_torchrun_leaves_no_process(kernel: Kernel, when: str) -> None:
    before = {p.pid for p in live_descendants(kernel.kernel_pid)}
    for stale in Path(kernel_cwd(kernel)).glob("pids-*.txt"):
        stale.unlink()
    msg_id = kernel.execute("%torchrun --cpu --nproc-per-node 2 waits.py")
    if when == "running":
        kernel.stdout_until(msg_id, lambda text: "every rank is running" in text, timeout=60)
    else:  # as soon as accelnb says it starts the ranks (earlier, the interrupt is ipykernel's
        # alone: it can land before the cell runs, and ipykernel then never answers the request)
        kernel.stdout_until(msg_id, lambda text: "rank 1 → cpu" in text, timeout=60)
    kernel.manager.interrupt_kernel()  # the notebook's Stop button
    reply = kernel.finish(msg_id, timeout=60)
    assert reply["content"]["status"] == "error"
    started = [int(pid) for path in Path(kernel_cwd(kernel)).glob("pids-*.txt") for pid in path.read_text().split()]
    if when == "running":
        assert len(started) == 4  # both ranks and both of their children
    assert _processes_left(started, bound_s=3.0) == []
    new = [p.pid for p in live_descendants(kernel.kernel_pid) if p.pid not in before]
    assert _processes_left(new, bound_s=3.0) == []


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kernel_cwd(kernel: Kernel) -> str:
    return psutil.Process(kernel.kernel_pid).cwd()


# ── group_timeout= ──────────────────────────────────────────────────────────────────────────
def skips_the_barrier_on_rank_0() -> None:
    if dist.get_rank() == 1:
        dist.barrier()  # rank 0 never comes: only the group's timeout ends this


@pytest.mark.usefixtures("no_leftovers")
def test_group_timeout_is_the_timeout_of_the_group_accelnb_makes() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as failed:
        launch(skips_the_barrier_on_rank_0, num_processes=2, cpu=True, quiet=True, group_timeout=2, timeout=120)
    took = time.monotonic() - started
    assert failed.value.failures[0].rank == 1
    assert took < 60, f"the barrier waited {took:.0f} s, not group_timeout=2"
