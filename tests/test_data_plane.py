"""Big values in and out of a launch through shared memory (issue 12), with real workers on CPU.

Tensors and arrays over ``channel.INLINE_LIMIT_BYTES`` travel in a memfd that every rank maps
copy-on-write; what comes back is rebuilt over a mapping in the kernel. Leftovers are looked for
where they would be: the kernel's and the helper's ``/proc/PID/fd`` and ``/proc/PID/maps``
(a memfd shows as ``/memfd:accelnb (deleted)``, a file of ``/dev/shm`` by its path).
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import accelnb
from accelnb.kernel.helper.template import running_helper_pid
from accelnb.kernel.run import run_state
from accelnb.wire.channel import INLINE_LIMIT_BYTES
from tests.conftest import InterruptWhenRunning, run_notebook, stream_text, worker_processes

BIG = 256 << 20  # bytes: the size, and the most a test here may hold
SHARED = 4 * INLINE_LIMIT_BYTES  # big enough to go through a memfd, small enough to be quick


def memfd_traces(pid: int) -> list[str]:
    """accelnb's memfds, and any file of /dev/shm, that ``pid`` holds open or mapped."""
    found = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own fd)
            continue
        if "memfd:accelnb" in target or target.startswith("/dev/shm/"):
            found.append(f"fd {fd}")
    with open(f"/proc/{pid}/maps") as maps:
        found += [line.strip() for line in maps if "memfd:accelnb" in line or " /dev/shm/" in line]
    return found


def leftovers() -> dict[str, list[str]]:
    """Every trace of shared memory in this process (the kernel) and in the helper.

    (Not a listing of /dev/shm: other processes on the machine may use it; what accelnb's
    processes hold there would show in their fds and maps.)
    """
    gc.collect()
    helper = running_helper_pid()
    return {"kernel": memfd_traces(os.getpid()), "helper": memfd_traces(helper) if helper is not None else []}


def forget_last_result() -> None:
    """``last_result()`` keeps the latest values: replace them with a run that returns nothing."""
    accelnb.launch(nothing, num_processes=2, cpu=True, quiet=True)


def nothing() -> None:
    return None


# ── functions that run on the ranks ─────────────────────────────────────────────────────────
def first_and_last(x: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    return float(x[0]), float(x[-1]), x  # x comes back too: a second trip through shared memory


def write_into_the_argument_on_rank_0(x: torch.Tensor, a: np.ndarray, small: torch.Tensor) -> tuple[float, ...]:
    import torch.distributed as dist

    if dist.get_rank() == 0:
        x.add_(1)
        a[:] = 5
        small.add_(1)
    dist.barrier()  # rank 1 looks only once rank 0 has written
    return float(x[0]), float(a[0]), float(small[0]), float(x.sum())


def train_one_step(state: dict[str, object]) -> dict[str, object]:
    model = torch.nn.Linear(512, 512)
    model.load_state_dict(state["model"])  # type: ignore[arg-type]
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 512)).sum().backward()
    optimizer.step()
    return {"model": model, "state": model.state_dict(), "optimizer": optimizer.state_dict(),
            "arrays": [a * 2 for a in state["arrays"]]}  # type: ignore[attr-defined]


def fail_on_rank_1(x: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError(f"boom with {x.numel()} elements")
    return x.clone()


def block_forever(x: torch.Tensor) -> None:
    import time

    float(x[0])
    time.sleep(600)


# ── tests ───────────────────────────────────────────────────────────────────────────────────
def test_a_256_mb_tensor_goes_in_and_comes_back_over_a_mapping() -> None:
    forget_last_result()
    before = leftovers()
    x = torch.arange(BIG // 4, dtype=torch.float32)
    first, last, back = accelnb.notebook_launcher(first_and_last, (x,), num_processes=2, cpu=True, quiet=True)

    assert (first, last) == (0.0, float(x[-1]))
    assert torch.equal(back, x)
    traces = leftovers()
    # (/dev/shm entries already there, such as a semaphore an earlier test's DataLoader mapped,
    # are not ours: compare with before)
    new = [t for t in traces["kernel"] if t not in before["kernel"]]
    assert not [t for t in new if t.startswith("fd")], traces  # mapped, fd closed
    assert len(new) == 1 and "memfd:accelnb" in new[0] and traces["helper"] == before["helper"], traces
    del back
    forget_last_result()
    assert leftovers() == before


def test_numpy_arrays_a_state_dict_and_an_optimizer_travel_both_ways() -> None:
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights: through a memfd
    arrays = [np.arange(SHARED // 8, dtype=np.float64), np.arange(6, dtype=np.int16).reshape(2, 3)]
    result = accelnb.launch(train_one_step, ({"model": model.state_dict(), "arrays": arrays},),
                            num_processes=2, cpu=True, quiet=True).values[0]

    assert isinstance(result["model"].weight, torch.nn.Parameter) and result["model"].weight.requires_grad
    assert torch.equal(result["state"]["weight"], result["model"].weight.detach())
    assert not torch.equal(result["state"]["weight"], model.weight.detach())  # it trained
    assert set(result["optimizer"]["state"][0]) == {"step", "exp_avg", "exp_avg_sq"}
    np.testing.assert_array_equal(result["arrays"][0], arrays[0] * 2)
    assert result["arrays"][1].dtype == np.int16 and result["arrays"][1].tolist() == [[0, 2, 4], [6, 8, 10]]
    assert result["arrays"][0].flags.writeable
    del result
    forget_last_result()


@pytest.mark.parametrize("size", [SHARED, 1024], ids=["shared-memory", "inline"])
def test_a_rank_writing_into_its_argument_changes_nothing_for_the_others(size: int) -> None:
    x = torch.zeros(size // 4)
    a = np.zeros(size // 8)
    small = torch.zeros(4)
    values = accelnb.launch(write_into_the_argument_on_rank_0, (x, a, small), num_processes=2, cpu=True,
                            quiet=True).values

    assert values[0] == (1.0, 5.0, 1.0, float(size // 4))  # rank 0 sees its own writes
    assert values[1] == (0.0, 0.0, 0.0, 0.0)  # rank 1 still sees the original
    assert float(x.sum()) == 0.0 and float(a.sum()) == 0.0 and float(small.sum()) == 0.0  # so does the kernel


def test_nothing_is_left_behind_after_a_failure() -> None:
    forget_last_result()
    before = leftovers()
    with pytest.raises(ValueError, match="boom with"):
        accelnb.launch(fail_on_rank_1, (torch.ones(SHARED // 4),), num_processes=2, cpu=True, quiet=True)
    assert worker_processes() == []
    assert leftovers() == before


def test_nothing_is_left_behind_after_an_interrupt() -> None:
    forget_last_result()
    before = leftovers()
    remove_hook = run_state.add_wait_hook(InterruptWhenRunning())
    try:
        with pytest.raises(KeyboardInterrupt):
            accelnb.launch(block_forever, (torch.ones(SHARED // 4),), num_processes=2, cpu=True, quiet=True)
    finally:
        remove_hook()
    assert worker_processes() == []
    assert leftovers() == before


def test_a_persistent_session_frees_each_calls_arguments() -> None:
    with accelnb.Session.start(num_processes=2, cpu=True) as session:
        for _ in range(3):
            session.run(first_and_last, (torch.ones(SHARED // 4),), output="none")
        forget = session.run(nothing, output="none")
        del forget
        helper = running_helper_pid()
        assert helper is not None
        workers = [p.pid for p in worker_processes()]
        assert all(memfd_traces(pid) == [] for pid in workers)  # each call's pages went with it
    forget_last_result()


def test_a_256_mb_tensor_in_and_out_of_a_distributed_cell() -> None:
    cells = ["%load_ext accelnb",
             f"import torch\nX = torch.arange({BIG // 4}, dtype=torch.int32)",
             "%%distributed --procs 2 --cpu\ny = X\nif rank == 0:\n    y[0] = -1\nint(X[1] + X[-1])",
             ("import gc; gc.collect()\n"
              "maps = [l for l in open('/proc/self/maps') if 'memfd:accelnb' in l]\n"
              "print(int(y[0]), int(X[0]), torch.equal(y[1:], X[1:]), len(maps))")]
    outputs = run_notebook(cells, timeout=300)

    results = [o["data"]["text/plain"] for o in outputs[2] if o["output_type"] == "execute_result"]
    assert results == [str(BIG // 4)], outputs[2]
    # y came back over one mapping; rank 0's write reached neither rank 1 nor the notebook's X.
    assert stream_text(outputs[3]).split() == ["-1", "0", "True", "1"], outputs[3]
