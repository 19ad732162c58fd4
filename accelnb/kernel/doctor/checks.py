"""``accelnb.doctor()``: the environment problems that break distributed runs, found before launch.

Half of the NCCL failures users report come from the machine, not the code: a 64 MB ``/dev/shm``
in Docker, GPUs held by another process, stray ``NCCL_*`` variables, too few open files. Each
check here says ok, warn or fail, what it saw, and how to fix it::

    >>> import accelnb
    >>> report = accelnb.doctor()                    # prints the table     # doctest: +SKIP
    >>> report.by_name("/dev/shm").status                                     # doctest: +SKIP
    'warn'

Reading and judging are apart: :func:`read_machine_facts` reads this machine into a
:class:`MachineFacts` (NVML through :func:`~accelnb.kernel.doctor.gpu_health.read_gpu_facts`), and
:func:`run_checks` judges any ``MachineFacts``, one function per check, so tests hand it a small
``/dev/shm``, a low file limit or a GPU held by another process. Nothing here initialises CUDA
or imports torch; without a GPU it all takes a few milliseconds.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import resource
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from accelnb.kernel.doctor.gpu_health import GpuFacts, read_gpu_facts
from accelnb.kernel.doctor.report import Check, DoctorReport
from accelnb.kernel.helper.template import running_helper_pid
from accelnb.kernel.run.run_state import current_run
from accelnb.kernel.watched_state.selection import current_selection

GiB = 2**30
SHM_MIN_TOTAL = 1 * GiB  # NCCL's shared-memory transport and DataLoader workers both live there
SHM_MIN_FREE = GiB // 2
OPEN_FILES_MIN = 4096  # every rank holds sockets to every other, plus pipes, plus DataLoader fds
OTHER_LAUNCHERS_PORT = 29500  # torchrun's and Accelerate's default MASTER_PORT
# torch's TCPStore client (every rank's, under torchrun too) connects to 127.0.0.1 as the IPv6
# address ::ffff:127.0.0.1 and asks for that address's name first (c10d formats each socket's peer
# with getnameinfo). /etc/hosts rarely lists it, so the question goes to the name server: about
# 1-3 ms here, seconds per rank where the name server drops queries.
MAPPED_LOOPBACK = "::ffff:127.0.0.1"
RENDEZVOUS_LOOKUP_SLOW_S = 0.1
RENDEZVOUS_LOOKUP_WAIT_S = 3.0  # the doctor's own wait; the lookup may go on, in a daemon thread

# Variables that change how NCCL/CUDA behave and are often left over from an old workaround.
RISKY_VARIABLES = {
    "NCCL_P2P_DISABLE": "turns off NVLink/PCIe peer-to-peer between GPUs: collectives go through host memory",
    "NCCL_SHM_DISABLE": "turns off NCCL's shared-memory transport: ranks on one machine talk over sockets",
    "NCCL_IB_DISABLE": "turns off InfiniBand/RoCE: multi-node runs fall back to TCP sockets",
    "CUDA_LAUNCH_BLOCKING": "makes every CUDA kernel launch synchronous: a debugging switch, many times slower",
    "CUDA_VISIBLE_DEVICES": "hides GPUs from this kernel, so the picker and gpus= cannot use them "
                            "(accelnb gives each rank its own CUDA_VISIBLE_DEVICES anyway)",
}
BEHAVIOUR_PREFIXES = ("NCCL_", "CUDA_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


@dataclass(frozen=True)
class ShmSpace:
    total: int  # bytes
    free: int  # bytes


@dataclass(frozen=True)
class MachineFacts:
    """Everything the checks judge; :func:`read_machine_facts` reads it from this machine."""

    shm: ShmSpace | None  # None: there is no /dev/shm
    open_files: tuple[int, int]  # soft and hard RLIMIT_NOFILE; resource.RLIM_INFINITY is -1
    environ: Mapping[str, str]
    torch_module: Any  # sys.modules.get("torch"): never imported here
    gpus: GpuFacts
    own_pids: frozenset[int]  # this kernel and its ranks: their GPU memory is not "another process"
    versions: Mapping[str, str | None]  # distribution name → version, None when not installed
    loopback_error: str | None  # None: 127.0.0.1 accepts a connection
    free_port: int | None  # one the OS handed out on 127.0.0.1, None when none could be bound
    other_launchers_port_free: bool
    helper_pid: int | None
    # Seconds one lookup of MAPPED_LOOPBACK's name took, math.inf when it had no answer within the
    # wait; None: not timed (the preflight times it at a process's first launch only).
    rendezvous_lookup_s: float | None = None


def doctor(*, gpus: Sequence[int] | None = None, show: bool = True) -> DoctorReport:
    """Check this machine for what breaks distributed training; print the table and return it.

    Args:
        gpus: the GPUs to check (nvidia-smi numbers); by default the picker's selection, else all.
        show: print the table (``False`` returns it silently).

    Returns:
        A :class:`DoctorReport`: a list of :class:`Check` (name, status, detail, fix).
    """
    report = run_checks(read_machine_facts(gpus))
    if show:
        print(report)
    return report


def run_checks(facts: MachineFacts) -> DoctorReport:
    """Judge ``facts``: one :class:`Check` per concern, in a stable order."""
    report = DoctorReport()
    for check in CHECKS:
        report.extend(check(facts))
    return report


# ── the checks: each takes the facts and returns its findings ──────────────────────────────
def check_shm(facts: MachineFacts) -> list[Check]:
    shm = facts.shm
    fix = ("give the container more: `docker run --shm-size=16g …` (or `--ipc=host`); in "
           "Kubernetes mount an emptyDir with medium: Memory at /dev/shm")
    if shm is None:
        return [Check("/dev/shm", "warn", "there is no /dev/shm: NCCL's shared-memory transport and "
                      "DataLoader workers cannot use it", fix)]
    seen = f"{_gib(shm.total)} in all, {_gib(shm.free)} free"
    if shm.total < SHM_MIN_TOTAL:
        return [Check("/dev/shm", "warn", f"{seen}: under {_gib(SHM_MIN_TOTAL)}, NCCL fails with "
                      "'Error while creating shared memory segment' or hangs (Docker's default is 64 MB)", fix)]
    if shm.free < SHM_MIN_FREE:
        return [Check("/dev/shm", "warn", f"{seen}: nearly full, often by segments a crashed run left",
                      "remove stale files: `ls -la /dev/shm`, then delete what no running process uses")]
    return [Check("/dev/shm", "ok", seen)]


def check_open_files(facts: MachineFacts) -> list[Check]:
    soft, hard = facts.open_files
    if soft == -1 or soft >= OPEN_FILES_MIN:
        return [Check("open files", "ok", f"soft limit {'unlimited' if soft == -1 else soft}")]
    target = "unlimited" if hard == -1 else str(hard)
    return [Check("open files", "warn",
                  f"soft limit {soft} (hard {target}): under {OPEN_FILES_MIN}, 'Too many open files' ends "
                  "runs with many ranks or DataLoader workers",
                  f"start Jupyter after `ulimit -n {target}` (the soft limit may rise to the hard one), or "
                  "raise it in this kernel: resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))")]


def check_environment(facts: MachineFacts) -> list[Check]:
    found = sorted(name for name in facts.environ if name.startswith(BEHAVIOUR_PREFIXES))
    risky = [name for name in found if name in RISKY_VARIABLES]
    checks = [Check(f"${name}", "warn", f"= {facts.environ[name]!r}: {RISKY_VARIABLES[name]}",
                    f"unset it unless you need it: del os.environ[{name!r}] (or remove it from the "
                    "environment Jupyter starts with)") for name in risky]
    others = [f"{name}={facts.environ[name]}" for name in found if name not in RISKY_VARIABLES]
    if others:
        checks.append(Check("NCCL/CUDA variables", "ok", "set, passed to every rank: " + ", ".join(others)))
    elif not risky:
        checks.append(Check("NCCL/CUDA variables", "ok", "none set"))
    return checks


def check_cuda_in_kernel(facts: MachineFacts) -> list[Check]:
    torch = facts.torch_module
    initialised = False
    if torch is not None:
        try:
            initialised = bool(torch.cuda.is_initialized())  # reads a flag; never initialises CUDA
        except Exception:
            initialised = False
    if not initialised:
        return [Check("CUDA in this kernel", "ok", "not initialised")]
    return [Check("CUDA in this kernel", "ok",
                  "initialised: fine for accelnb (ranks fork from a clean helper process), but fork-based "
                  "launchers (Accelerate's notebook_launcher, Lightning's ddp_notebook) will refuse to start",
                  "only if you use another launcher: restart the kernel and launch before touching CUDA")]


def check_gpus(facts: MachineFacts) -> list[Check]:
    gpu_facts = facts.gpus
    if gpu_facts.driver is None:
        why = f"; {gpu_facts.note}" if gpu_facts.note else ""
        return [Check("GPUs", "ok", f"no NVIDIA GPU/driver: CPU ranks only{why}")]
    names = ", ".join(f"{g.index} ({g.name})" for g in gpu_facts.gpus) or "none"
    checks = [Check("GPUs", "ok", f"driver {gpu_facts.driver}; checked: {names}")]
    for gpu in gpu_facts.gpus:
        if gpu.mig_enabled:
            checks.append(Check(f"GPU {gpu.index} MIG", "warn",
                                "MIG mode is on: each instance is a slice, and NCCL cannot run collectives "
                                "across MIG instances",
                                f"use GPUs without MIG, or turn it off: `sudo nvidia-smi -i {gpu.index} -mig 0`"))
        if gpu.ecc_uncorrected:
            checks.append(Check(f"GPU {gpu.index} ECC", "warn",
                                f"{gpu.ecc_uncorrected} uncorrected ECC error(s) since the driver loaded: "
                                "results and collectives on it may fail",
                                f"check `nvidia-smi -q -d ECC -i {gpu.index}`; avoid this GPU or reset it"))
        others = [pid for pid in gpu.process_pids if pid not in facts.own_pids]
        if others:
            checks.append(Check(f"GPU {gpu.index} in use", "warn",
                                f"held by other process(es) {', '.join(map(str, others))}: less memory, "
                                "and NCCL may wait on them",
                                "end them (`nvidia-smi` lists them) or pick other GPUs (accelnb.Panel())"))
    no_p2p = [f"{a}↔{b}" for (a, b), ok in sorted(gpu_facts.peer_to_peer.items()) if not ok]
    if no_p2p:
        checks.append(Check("peer-to-peer", "warn",
                            f"no P2P between {', '.join(no_p2p)}: NCCL copies through host memory (slower)",
                            "expected across PCIe root complexes or in some VMs; if collectives hang "
                            "instead, try NCCL_P2P_DISABLE=1 and report the topology (`nvidia-smi topo -m`)"))
    elif gpu_facts.peer_to_peer:
        checks.append(Check("peer-to-peer", "ok", f"every pair of the {len(gpu_facts.gpus)} GPUs"))
    return checks


def check_network(facts: MachineFacts) -> list[Check]:
    if facts.loopback_error is not None:
        return [Check("loopback", "fail", f"127.0.0.1 refused a connection ({facts.loopback_error}): ranks "
                      "cannot meet", "bring up the loopback interface (`ip link set lo up`) or allow it "
                      "in the firewall")]
    checks = [Check("loopback", "ok", "127.0.0.1 accepts connections")]
    if facts.free_port is None:
        checks.append(Check("free ports", "fail", "no port could be bound on 127.0.0.1",
                            "free some ports (`ss -tlnp` lists them) or widen net.ipv4.ip_local_port_range"))
    else:
        checks.append(Check("free ports", "ok", f"e.g. {facts.free_port} (accelnb picks one per launch)"))
    checks.extend(_rendezvous_lookup_checks(facts.rendezvous_lookup_s))
    if not facts.other_launchers_port_free:
        checks.append(Check(f"port {OTHER_LAUNCHERS_PORT}", "ok",
                            "taken: fine for accelnb, but torchrun and Accelerate default to it and would "
                            "fail with 'Address already in use'",
                            "for those tools only: pass --master_port / main_process_port"))
    return checks


def _rendezvous_lookup_checks(seconds: float | None) -> list[Check]:
    if seconds is None:
        return []
    if seconds < RENDEZVOUS_LOOKUP_SLOW_S:
        return [Check("name lookup", "ok", f"{MAPPED_LOOPBACK}'s name in {seconds * 1e3:.1f} ms "
                      "(each rank asks once as it joins)")]
    took = "had no answer while accelnb waited" if math.isinf(seconds) else f"took {seconds:.2f} s"
    return [Check("name lookup", "warn",
                  f"looking up the name of {MAPPED_LOOPBACK} {took}: torch's rendezvous store (under "
                  "accelnb, torchrun or Accelerate alike) does this once per rank before it joins, so every "
                  "launch waits as long (torch says why only when the lookup fails: 'The hostname of the "
                  "client socket cannot be retrieved')",
                  f"list the address in /etc/hosts: `echo '{MAPPED_LOOPBACK} localhost-mapped' | sudo tee -a "
                  "/etc/hosts` (or fix the name server in /etc/resolv.conf)")]


def check_versions(facts: MachineFacts) -> list[Check]:
    torch = facts.versions.get("torch")
    if torch is None:
        return [Check("versions", "fail", "torch is not installed", "pip install torch")]
    nccl = facts.versions.get("nccl") or "bundled with torch"
    accelerate = facts.versions.get("accelerate") or "not installed (optional)"
    return [Check("versions", "ok", f"torch {torch}, NCCL {nccl}, Accelerate {accelerate}")]


def check_accelerate_config(facts: MachineFacts) -> list[Check]:
    path = accelerate_config_path(facts.environ)
    if not os.path.exists(path):
        return [Check("Accelerate config", "ok", "none found")]
    return [Check("Accelerate config", "ok",
                  f"{path} found: Accelerate(...) inside ranks reads its mixed_precision and plugins; "
                  "accelnb's own options (gpus, mixed_precision=…) decide the launch")]


def check_helper(facts: MachineFacts) -> list[Check]:
    if facts.helper_pid is None:
        return [Check("accelnb helper", "ok", "not running; it starts with %load_ext accelnb or the first launch")]
    return [Check("accelnb helper", "ok", f"running (pid {facts.helper_pid}), torch pre-imported")]


CHECKS: tuple[Callable[[MachineFacts], list[Check]], ...] = (
    check_shm, check_open_files, check_environment, check_cuda_in_kernel, check_gpus,
    check_network, check_versions, check_accelerate_config, check_helper)


# ── reading this machine ────────────────────────────────────────────────────────────────────
def read_machine_facts(gpus: Sequence[int] | None = None) -> MachineFacts:
    """Read this machine. ``gpus``: which GPUs to look at (default: the picker's, else all)."""
    selection = current_selection()
    selected = gpus if gpus is not None else (selection.gpus if selection is not None else None)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    loopback_error, free_port = probe_loopback()
    return MachineFacts(
        shm=read_shm(),
        open_files=(resource_limit(soft), resource_limit(hard)),
        environ=dict(os.environ),
        torch_module=sys.modules.get("torch"),
        gpus=read_gpu_facts(selected),
        own_pids=own_pids(),
        versions={name: _version(name) for name in ("torch", "accelerate")} | {"nccl": _nccl_version()},
        loopback_error=loopback_error,
        free_port=free_port,
        other_launchers_port_free=_port_free(OTHER_LAUNCHERS_PORT),
        helper_pid=running_helper_pid(),
        rendezvous_lookup_s=time_rendezvous_lookup(),
    )


def accelerate_config_path(environ: Mapping[str, str]) -> str:
    """Where ``accelerate config`` writes its default file (Accelerate's own rule)."""
    cache = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return os.path.join(os.path.expanduser(cache), "accelerate", "default_config.yaml")


def own_pids() -> frozenset[int]:
    """This kernel and the ranks of its running session: GPU memory they hold is not a problem."""
    run = current_run()
    ranks = {r.pid for r in run.ranks if r.pid is not None} if run is not None and not run.finished else set()
    return frozenset({os.getpid(), *ranks})


def read_shm() -> ShmSpace | None:
    try:
        stats = os.statvfs("/dev/shm")
    except OSError:
        return None
    return ShmSpace(total=stats.f_blocks * stats.f_frsize, free=stats.f_bavail * stats.f_frsize)


def resource_limit(value: int) -> int:
    """A limit from ``resource.getrlimit``, with -1 for unlimited."""
    return -1 if value == resource.RLIM_INFINITY else value


def probe_loopback() -> tuple[str | None, int | None]:
    """Connect to a listening socket on 127.0.0.1: the error, or None and the port it got."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            port = server.getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                pass
        return None, port
    except OSError as error:
        return str(error), None


def time_rendezvous_lookup(wait_s: float = RENDEZVOUS_LOOKUP_WAIT_S) -> float:
    """Seconds the lookup of :data:`MAPPED_LOOPBACK`'s name takes, as torch's store makes it;
    ``math.inf`` when it has not finished within ``wait_s`` (it goes on in a daemon thread:
    getnameinfo cannot be cancelled, and the resolver gives up on its own).

    A slow answer is timed once more, and the faster counts: a name server that is slow is slow
    both times, where one query lost on the way (the resolver then waits its 5 s) is chance. On
    a VM whose name server dropped about one query in fifty when asked in a loop, the first
    launch of a notebook's kernel said that every launch waits 5 s, once in a test suite's run."""
    first = _time_one_lookup(wait_s)
    if first < RENDEZVOUS_LOOKUP_SLOW_S:
        return first
    return min(first, _time_one_lookup(wait_s))


def _time_one_lookup(wait_s: float) -> float:
    """The lookup's own seconds, timed in its thread (a loaded machine's wait for the thread to
    start is not the name server's); ``math.inf`` when it has not finished within ``wait_s``."""
    took: list[float] = []
    done = threading.Event()

    def look_up() -> None:
        start = time.monotonic()
        try:
            socket.getnameinfo((MAPPED_LOOPBACK, 0), 0)
        except OSError:
            pass  # an unanswered query fails after the wait this measures
        took.append(time.monotonic() - start)
        done.set()

    threading.Thread(target=look_up, name="accelnb-doctor-lookup", daemon=True).start()
    if not done.wait(wait_s):
        return math.inf
    return took[0]


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))  # no SO_REUSEADDR: torchrun's own bind would be refused the same way
        except OSError:
            return False
    return True


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nccl_version() -> str | None:
    # The NCCL that torch's CUDA wheels depend on; without importing torch (seconds, and CUDA).
    return _version("nvidia-nccl-cu12") or _version("nvidia-nccl-cu11")


def _gib(size: int) -> str:
    return f"{size / GiB:.1f} GB" if size >= GiB // 10 else f"{size / 2**20:.0f} MB"
