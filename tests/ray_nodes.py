"""Ray "nodes" on one machine, each in a network namespace made here (tests and benchmarks).

Ray replaces 127.0.0.1 with the machine's own network address, so a Ray node is only ever
started inside a namespace created here: two namespaces joined by a veth pair whose ends carry
the same interface name inside each (one ``GLOO_SOCKET_IFNAME`` fits both nodes), or one holding
only ``lo``. Each node gets its own ``--temp-dir``; :meth:`NamespaceCluster.stop` kills every
process inside the namespaces (the ``ray start`` processes and whatever they started: GCS,
raylets, workers) by pid, then deletes the namespaces.

    >>> with NamespaceCluster.two_nodes(tmp_path) as cluster:                # doctest: +SKIP
    ...     subprocess.run(cluster.exec_in(0, [sys.executable, "driver.py"]))
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType

REPO = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).with_name("ray"))
INTERFACE = "accel0"  # the veth end's name inside each namespace
NODE_READY_S = 90.0
NODE_START_ATTEMPTS = 3
START_NICENESS = -10  # root only; `nice` runs the node at normal priority otherwise


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"accelnb-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed ({made.stderr.strip() or made.returncode}): tests need root"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ray_unavailable() -> str | None:
    try:
        import ray  # noqa: F401
    except ImportError:
        return "ray is not installed (pip install 'accelnb[ray]')"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class NamespaceCluster:
    """Namespaces, optionally joined by veth, and the Ray nodes started in them."""

    def __init__(self, names: list[str], addresses: list[str], workdir: Path) -> None:
        self.names = names
        self.addresses = addresses
        self.workdir = workdir
        self.nodes: list[subprocess.Popen[bytes]] = []
        self.temp_dirs: list[Path] = []  # the nodes' --temp-dir, removed by stop()

    # ── namespaces ──────────────────────────────────────────────────────────────────────────
    @classmethod
    def lo_only(cls, workdir: Path) -> NamespaceCluster:
        cluster = cls([f"anb{os.getpid()}lo"], ["127.0.0.1"], workdir)
        _ip("netns", "add", cluster.names[0])
        _ip("-n", cluster.names[0], "link", "set", "lo", "up")
        return cluster

    @classmethod
    def two_nodes(cls, workdir: Path) -> NamespaceCluster:
        tag = os.getpid() % 100000
        cluster = cls([f"anb{tag}a", f"anb{tag}b"], ["10.77.0.1", "10.77.0.2"], workdir)
        try:
            for name in cluster.names:
                _ip("netns", "add", name)
            _ip("link", "add", f"anb{tag}va", "type", "veth", "peer", "name", f"anb{tag}vb")
            for end, name, address in zip(("va", "vb"), cluster.names, cluster.addresses, strict=True):
                _ip("link", "set", f"anb{tag}{end}", "netns", name)
                _ip("-n", name, "link", "set", f"anb{tag}{end}", "name", INTERFACE)
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", INTERFACE)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", INTERFACE, "up")
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def exec_in(self, node: int, command: list[str]) -> list[str]:
        """``command`` run inside node ``node``'s namespace."""
        return ["ip", "netns", "exec", self.names[node], *command]

    def env(self) -> dict[str, str]:
        """The environment of everything started in the namespaces: this checkout's accelnb."""
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                "RAY_DEDUP_LOGS": "0", "RAY_USAGE_STATS_ENABLED": "0"}

    # ── Ray nodes ───────────────────────────────────────────────────────────────────────────
    @property
    def head_address(self) -> str:
        return f"{self.addresses[0]}:6379"

    def start_ray(self, cpus: int = 1) -> None:
        """A Ray head in the first namespace and a worker node in each other one."""
        for index in range(len(self.names)):
            where = (["--head", "--port=6379", "--include-dashboard=false"] if index == 0
                     else [f"--address={self.head_address}"])
            # Short, under /tmp: Ray puts its sockets in the temp dir, and a socket's path must fit in
            # 107 bytes (a pytest-xdist worker's tmp_path alone takes 50).
            temp_dir = Path(tempfile.mkdtemp(prefix=f"anb-ray{index}-", dir="/tmp"))
            self.temp_dirs.append(temp_dir)
            # No log monitor: accelnb forwards each rank's output itself.
            command = [RAY, "start", "--block", *where, f"--num-cpus={cpus}", "--num-gpus=0",
                       f"--node-ip-address={self.addresses[index]}", f"--temp-dir={temp_dir}",
                       "--disable-usage-stats", "--object-store-memory=100000000", "--include-log-monitor=false"]
            for attempt in range(NODE_START_ATTEMPTS):
                log = open(self.workdir / f"ray{index}.log", "wb")  # noqa: SIM115  (the node writes it until stopped)
                # Started ahead of everything else on this machine, then back to normal priority
                # once up (what it starts later, the rank actors, inherits that): a node stands for
                # a machine of its own, and on a 2-core machine busy with other tests its processes
                # missed Ray's start-up deadlines (3 of 3 tries failed with 3 test files at a time).
                self.nodes.append(subprocess.Popen(["nice", "-n", str(START_NICENESS), *self.exec_in(index, command)],
                                                   stdout=log, stderr=subprocess.STDOUT, env=self.env(),
                                                   cwd=self.workdir))
                log.close()
                try:
                    self._wait_started(index)
                    self._back_to_normal_priority([self.names[index]])
                    break
                except RuntimeError:
                    # Ray gives a raylet 30 s to register, hard-coded; a loaded 2-core machine can
                    # miss that. Clear the namespace and start this node again.
                    if attempt == NODE_START_ATTEMPTS - 1:
                        raise
                    self._kill_inside([self.names[index]])
                    self.nodes.pop().wait(timeout=10)

    def _wait_started(self, index: int) -> None:
        log = self.workdir / f"ray{index}.log"
        deadline = time.monotonic() + NODE_READY_S
        while b"Ray runtime started" not in log.read_bytes():
            if self.nodes[index].poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"Ray node {index} did not start:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)  # polling a log file another process writes; nothing to wait on

    def _back_to_normal_priority(self, names: list[str]) -> None:
        # Niceness is per thread on Linux: every thread of every process in the namespace.
        for pid in self.pids_inside(names):
            for task in Path(f"/proc/{pid}/task").glob("*"):
                try:
                    os.setpriority(os.PRIO_PROCESS, int(task.name), 0)
                except OSError:
                    pass  # gone since listed, or not ours to change

    # ── the end ─────────────────────────────────────────────────────────────────────────────
    def pids_inside(self, names: list[str] | None = None) -> list[int]:
        pids: list[int] = []
        for name in names or self.names:
            listed = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
            pids += [int(p) for p in listed.stdout.split()]
        return pids

    def stop(self) -> None:
        """Kill every process in the namespaces by pid, then delete them."""
        self._kill_inside(self.names)
        for node in self.nodes:
            node.wait(timeout=10)
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        for temp_dir in self.temp_dirs:
            shutil.rmtree(temp_dir, ignore_errors=True)

    def _kill_inside(self, names: list[str]) -> None:
        for _ in range(100):
            pids = self.pids_inside(names)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)  # SIGKILLed processes leave when the kernel has reaped them

    def __enter__(self) -> NamespaceCluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
