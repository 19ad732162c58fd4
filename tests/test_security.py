"""Security of a single-node launch, checked on the live processes of a real run.

- Nothing listens on a non-loopback address: the sockets of this process (the kernel), the helper
  and every worker are listed during a run.
- Pickles travel only over pipes and one AF_UNIX socketpair: none has a name, none listens, so an
  outsider has nothing to connect to. What does listen (the c10d TCPStore on the bound rendezvous
  port, gloo's pairs) is on loopback and does not unpickle: an outsider connects to each and sends
  a pickle that would create a file when loaded; nothing is created and the run still finishes.
- No file readable by other users appears in the temporary directories, from the helper's start
  to the end of a run.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import pickle
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

import accelnb
from accelnb.kernel.helper import template as helper_template

sys.path.insert(0, str(Path(__file__).parent / "faults"))
from faultkit import descendants, report, wait_for_report

SO_ACCEPTCON = 0x10000  # /proc/net/unix flag of a listening socket
TEMP_DIRS = sorted({tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm"})


def hold(report_dir: str) -> Any:
    """Run on each rank: one collective, then wait until the test has looked around."""
    import os

    import torch
    import torch.distributed as dist

    tensor = torch.ones(1)
    dist.all_reduce(tensor)
    print("holding")
    report(report_dir, dist.get_rank(), pid=os.getpid(), port=int(os.environ["MASTER_PORT"]))
    wait_for_report(report_dir, dist.get_rank(), "released")
    return torch.full((4,), tensor.item())


def during_a_run(report_dir: Path, look: Callable[[list[int]], None]) -> accelnb.LaunchResult:
    """Launch ``hold`` and call ``look(worker pids)`` while both ranks wait."""
    failure: list[BaseException] = []

    def inspect() -> None:
        try:
            pids = [wait_for_report(str(report_dir), rank, "pid") for rank in (0, 1)]
            look(pids)
        except BaseException as error:
            failure.append(error)
        finally:
            for rank in (0, 1):
                report(str(report_dir), rank, released=True)

    thread = threading.Thread(target=inspect)
    thread.start()
    result = accelnb.launch(hold, (str(report_dir),), num_processes=2, cpu=True, quiet=True)
    thread.join()
    if failure:
        raise failure[0]
    assert [t.tolist() for _, t in sorted(result.values.items())] == [[2.0] * 4] * 2
    return result


def our_processes(worker_pids: list[int]) -> list[int]:
    helper = helper_template.shared_helper().pid
    return sorted({os.getpid(), helper, *worker_pids, *(p.pid for p in descendants(helper))})


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def socket_inodes(pid: int) -> set[int]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                found.add(int(link[8:-1]))
    return found


def unix_sockets() -> dict[int, tuple[int, str]]:
    """inode → (flags, path) of every AF_UNIX socket in this network namespace."""
    table = {}
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        table[int(fields[6])] = (int(fields[3], 16), fields[7] if len(fields) > 7 else "")
    return table


def test_nothing_listens_beyond_loopback(tmp_path: Path) -> None:
    seen: list[tuple[int, Any]] = []

    def look(worker_pids: list[int]) -> None:
        for pid in our_processes(worker_pids):
            seen.extend((pid, c) for c in psutil.Process(pid).net_connections(kind="inet"))

    result = during_a_run(tmp_path, look)
    listening = [(pid, c) for pid, c in seen if c.status == psutil.CONN_LISTEN]
    bound_udp = [(pid, c) for pid, c in seen if c.type == socket.SOCK_DGRAM and c.laddr]
    print("listening during the run:", *(f"pid {pid} {c.laddr.ip}:{c.laddr.port}" for pid, c in listening),
          sep="\n  ")
    assert any(c.laddr.port == result.plan.master_port for _, c in listening), "the store was not seen"
    exposed = [(pid, c) for pid, c in listening + bound_udp if not is_loopback(c.laddr.ip)]
    assert not exposed, f"sockets on a non-loopback address: {exposed}"


def test_pickle_channels_cannot_be_reached(tmp_path: Path) -> None:
    """No listening or named unix socket anywhere in the launch; the channels are pipes."""
    found: dict[str, Any] = {}

    def look(worker_pids: list[int]) -> None:
        table = unix_sockets()
        found["unix"] = {pid: [table[i] for i in socket_inodes(pid) if i in table]
                         for pid in our_processes(worker_pids)}
        found["streams"] = {pid: [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in (1, 2)]
                            for pid in worker_pids}

    during_a_run(tmp_path, look)
    helper = helper_template.shared_helper().pid
    assert found["unix"][helper], "the helper's control socketpair was not seen"
    for pid, sockets in found["unix"].items():
        for flags, path in sockets:
            if path.startswith("@cuda-uvmfd-"):
                continue  # the CUDA driver's own, in a process that initialised CUDA: no channel of ours
            assert not flags & SO_ACCEPTCON, f"pid {pid} has a listening unix socket {path!r}"
            assert not path, f"pid {pid} has a unix socket with a name: {path!r}"
    for pid, targets in found["streams"].items():
        assert all(t.startswith("pipe:[") for t in targets), f"worker {pid}: stdout/stderr are {targets}"


class Planted:
    """Unpickling this creates a directory: the proof that something unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.marker,))


def test_outsider_pickles_are_never_loaded(tmp_path: Path) -> None:
    """An outsider connects to every port the launch listens on and sends pickles."""
    marker = tmp_path / "unpickled"
    reports = tmp_path / "reports"
    reports.mkdir()
    payload = pickle.dumps(Planted(marker))
    framed = len(payload).to_bytes(8, "big") + payload  # accelnb's own channel framing, too
    tried: list[int] = []

    def look(worker_pids: list[int]) -> None:
        ports = {c.laddr.port for pid in our_processes(worker_pids)
                 for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        for port in sorted(ports):
            for data in (payload, framed, payload * 64):
                with socket.create_connection(("127.0.0.1", port), timeout=2) as outsider:
                    outsider.sendall(data)
                    outsider.settimeout(0.2)
                    with contextlib.suppress(OSError):
                        outsider.recv(4096)
            tried.append(port)

    result = during_a_run(reports, look)
    assert result.plan.master_port in tried and len(tried) >= 2, tried  # the store and gloo's pairs
    assert not marker.exists(), "a pickle sent by an outsider was loaded"
    assert accelnb.launch(hold_free, num_processes=2, cpu=True, quiet=True).values == {0: 0, 1: 1}


def hold_free() -> int:
    import torch.distributed as dist

    return dist.get_rank()


KERNEL = """
import os, sys
sys.path.insert(0, sys.argv[1])
import accelnb
from faultkit import fault_target, ok_target
assert accelnb.launch(ok_target, num_processes=2, cpu=True, quiet=True).values == {0: 2.0, 1: 2.0}
try:
    accelnb.launch(fault_target, ("segfault", 1, "after", sys.argv[2]), num_processes=2, cpu=True, quiet=True)
except accelnb.RankCrashed:
    pass
else:
    raise SystemExit("the segfault was not reported")
"""
STRACE = ["strace", "-f", "-qq", "-e", "trace=open,openat,creat,mknod,mknodat,bind"]
CREATION = re.compile(r'^\d+\s+(open|openat|creat|mknod|mknodat|bind)\((?:AT_FDCWD, |\d+, )?'
                      r'(?:\{sa_family=AF_UNIX, sun_path=)?"([^"]+)"(.*)$')
INET_BIND = re.compile(r'bind\(\d+, \{sa_family=AF_INET6?, .*inet_(?:addr|pton)\((?:AF_INET6, )?"([^"]+)"')


def strace_works() -> bool:
    return shutil.which("strace") is not None and subprocess.run(
        [*STRACE, "-o", os.devnull, "true"], capture_output=True).returncode == 0


def created_files(trace: str, umask: int) -> dict[str, int]:
    """path → permission bits of every file (not directory) a traced process created."""
    files: dict[str, int] = {}
    for line in trace.splitlines():
        match = CREATION.match(line)
        if not match or "= -1 " in line:
            continue
        call, path, rest = match.groups()
        if call in ("open", "openat") and "O_CREAT" not in rest:
            continue
        mode = re.search(r", (0[0-7]{3,4})\b", rest)
        requested = 0o777 if call == "bind" else int(mode.group(1), 8) if mode else 0o666
        files[path] = requested & ~umask & 0o777
    return files


def exposed(path: str, mode: int, roots: list[str]) -> bool:
    """Readable by other users: the file itself, and every directory on the way from its root."""
    if not mode & stat.S_IROTH:
        return False
    root = next(r for r in roots if path.startswith(r.rstrip("/") + "/"))
    directory = os.path.dirname(path)
    while len(directory) > len(root):
        with contextlib.suppress(OSError):
            if not os.stat(directory).st_mode & stat.S_IXOTH:
                return False
        directory = os.path.dirname(directory)
    return True


def world_readable_under(root: str) -> dict[str, float]:
    found: dict[str, float] = {}
    for directory, _, files in os.walk(root, onerror=lambda _: None):
        for name in files:
            path = os.path.join(directory, name)
            with contextlib.suppress(OSError):
                info = os.lstat(path)
                if stat.S_ISREG(info.st_mode) and exposed(path, info.st_mode, [root]):
                    found[path] = info.st_mtime
    return found


@dataclass
class TracedRun:
    roots: list[str]  # the temp dirs, the run's own TMPDIR included
    umask: int
    trace: str | None  # strace's output; None where strace cannot run
    before: dict[str, dict[str, float]]  # without strace: world-readable files before the run


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory: pytest.TempPathFactory) -> TracedRun:
    """A fresh kernel process (so the helper's start is included) launches a good and a failing
    run, traced with strace: every file created and every address bound, by it, the helper and
    the workers. TMPDIR points at an open (0755) directory of its own, so a careless tempfile
    would show. Without strace: before/after snapshots (other processes can disturb those)."""
    base = tmp_path_factory.mktemp("traced")
    private = base / "tmpdir"
    private.mkdir()
    private.chmod(0o755)
    reports = base / "reports"
    reports.mkdir()
    repo = Path(__file__).parents[1]
    env = {**os.environ, "TMPDIR": str(private),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")]))}
    umask = 0o022
    roots = [*TEMP_DIRS, str(private)]
    command = [sys.executable, "-c", KERNEL, str(Path(__file__).parent / "faults"), str(reports)]
    traced = strace_works()
    before = {} if traced else {root: world_readable_under(root) for root in roots}
    if traced:
        command = [*STRACE, "-o", str(base / "trace"), *command]
    run = subprocess.run(command, env=env, cwd=repo, capture_output=True, text=True, timeout=240,
                         preexec_fn=lambda: os.umask(umask))
    assert run.returncode == 0, run.stderr[-3000:]
    return TracedRun(roots, umask, (base / "trace").read_text() if traced else None, before)


def snapshot_roots(traced_run: TracedRun) -> list[str]:
    """The temp dirs a before/after snapshot can vouch for. Beside other tests (pytest-xdist), the
    shared ones fill with their files (torch.compile's cache in /tmp was taken for ours on a GPU
    machine without strace): there only the traced kernel's own TMPDIR is compared."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return traced_run.roots
    print("no strace and other tests running: only the kernel's own TMPDIR is compared")
    return [traced_run.roots[-1]]


def test_no_world_readable_temp_files(traced_run: TracedRun) -> None:
    roots = traced_run.roots
    if traced_run.trace is not None:
        created = {path: mode for path, mode in created_files(traced_run.trace, traced_run.umask).items()
                   if any(path.startswith(r.rstrip("/") + "/") for r in roots)}
        print("files created in temp dirs:", *(f"{oct(m)} {p}" for p, m in created.items()), sep="\n  ")
        bad = {p: oct(m) for p, m in created.items() if exposed(p, m, roots)}
    else:
        bad = {p: "new" for root in snapshot_roots(traced_run) for p, mtime in world_readable_under(root).items()
               if traced_run.before[root].get(p) != mtime}
    assert not bad, f"world-readable files written to temp dirs: {bad}"


def test_every_bind_is_to_loopback(traced_run: TracedRun) -> None:
    """Over the whole life of a kernel's launches, not only at one moment of a run."""
    if traced_run.trace is None:
        pytest.skip("strace cannot run here")
    addresses = INET_BIND.findall(traced_run.trace)
    print("inet addresses bound:", sorted(set(addresses)))
    assert addresses, "no bind was traced"
    assert all(is_loopback(a) for a in addresses), addresses


def test_workers_do_not_hold_each_others_channels(tmp_path: Path) -> None:
    """Each worker holds only its own pipes; only rank 0 holds the store's listening socket.

    (Otherwise the rendezvous port stays bound until every rank is gone, not just rank 0, and a
    rank's pipes outlive it in its peers.)
    """
    found: dict[int, dict[str, set[str]]] = {}

    def look(worker_pids: list[int]) -> None:
        for rank, pid in enumerate(worker_pids):
            links = set()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    links.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
            listening = {c.laddr.port for c in psutil.Process(pid).net_connections(kind="inet")
                         if c.status == psutil.CONN_LISTEN}
            found[rank] = {"pipes": {link for link in links if link.startswith("pipe:")},
                           "listening": {str(port) for port in listening}}

    result = during_a_run(tmp_path, look)
    store = str(result.plan.master_port)
    assert store in found[0]["listening"]
    assert store not in found[1]["listening"], "rank 1 also holds the store's listening socket"
    shared = found[0]["pipes"] & found[1]["pipes"]
    assert not shared, f"ranks 0 and 1 share {len(shared)} pipes (each holds the other's channel ends)"
