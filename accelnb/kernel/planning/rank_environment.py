"""One function builds a rank's environment: :func:`rank_environment`, for local and cluster ranks alike.

    >>> place = RankPlace(rank=1, local_rank=1, world_size=2, local_world_size=2, node_rank=0, device="cpu",
    ...                   visible_gpus=(), master_addr="127.0.0.1", master_port=29500, interface="lo")
    >>> env = rank_environment(RankOptions(mixed_precision="bf16"), place)
    >>> env["RANK"], env["MASTER_PORT"], env["ACCELERATE_MIXED_PRECISION"], env["ACCELERATE_USE_CPU"]
    ('1', '29500', 'bf16', 'true')

Its two inputs say where each value comes from:

- :class:`RankOptions`: what the launch's options put into every rank. It is a view of the
  settled options (:class:`accelnb.options.SettledOptions`), filled by field name, so an option
  that reaches the environment is one field here plus its line in :func:`rank_environment`;
  nothing between the options and this module copies it.
- :class:`RankPlace`: where the rank runs and how it reaches the others, as the planner placed it
  on this machine (:mod:`accelnb.kernel.planning.rank_plan`) or as Ray placed it on a cluster
  (:mod:`accelnb.cluster.rank_layout`), and what only a start knows: the attempt and the thread
  budget. A plan's own environment (``RankSpec.env``) is built before the start, without those.

The variables a rank gets are those that ``torchrun`` sets for the placement, plus ours
(``ACCELNB_DEVICE``) and Accelerate's, so that code inside a rank finds what it would find under
``torchrun``/``accelerate launch``; which variables, and why each, is written next to each below.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from accelnb.wire.spec import GROUP_TIMEOUT_ENV, LOOPBACK

# Each rank's planned device, "cuda:N" or "cpu", in its environment. Read by
# accelnb.worker.cell_runner (which may not import this module; tests/test_planning.py pins the name).
DEVICE_ENV = "ACCELNB_DEVICE"


@dataclass(frozen=True, kw_only=True)
class RankOptions:
    """What a launch's options put into every rank's environment.

    Filled by field name from the settled options (``SettledOptions.view``): each field is an
    option's name, or a value settling derived (``accelerate_env``). tests/test_options.py keeps
    the names and defaults those of the options.
    """

    mixed_precision: str | None = None
    group_timeout: float | None = None  # seconds; read by the rank from GROUP_TIMEOUT_ENV
    max_restarts: int = 0  # torchrun's --max-restarts, which code reads from TORCHELASTIC_MAX_RESTARTS
    # The Accelerate config file's settings, as `accelerate launch` would set them (see
    # accelnb.kernel.planning.accelerate_config); empty without a config file.
    accelerate_env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class RankPlace:
    """Where one rank runs and how it finds the others; and, once it starts, its attempt and threads."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    device: str  # "cuda:N" as the rank sees it, or "cpu"
    visible_gpus: tuple[str, ...]  # what CUDA_VISIBLE_DEVICES lists, in the order the rank sees them
    gpus_owned: int = 1  # more than one: a model spread over the rank's own GPUs (gpus_per_rank=k)
    master_addr: str = LOOPBACK
    master_port: int = 0  # 0 until the rendezvous port is bound
    # The interface gloo's and NCCL's sockets use. None: this machine, where the kernel's own
    # GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME reach the ranks as set, else loopback.
    interface: str | None = None
    restart_count: int | None = None  # which attempt; None: not started (a plan's own environment)
    threads: int | None = None  # the rank's thread budget where the kernel sets no OMP_NUM_THREADS; None: not started


def rank_environment(options: RankOptions, place: RankPlace) -> dict[str, str]:
    """Every variable accelnb sets in the rank at ``place`` of a launch with ``options``."""
    # The config file's settings first: everything set below is the rank's own and wins over them
    # (a mixed_precision= keyword over the file's, as `accelerate launch` lets its flags win).
    env = dict(options.accelerate_env)
    env.update({
        # What torchrun sets, so that init_process_group("env://"), Accelerate and Lightning find their place.
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": str(place.world_size),
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "NODE_RANK": str(place.node_rank),
        "GROUP_RANK": str(place.node_rank),
        "GROUP_WORLD_SIZE": str(-(-place.world_size // place.local_world_size)),  # the nodes
        # torchrun's one role ("default"): its ranks are the launch's.
        "ROLE_NAME": "default",
        "ROLE_RANK": str(place.rank),
        "ROLE_WORLD_SIZE": str(place.world_size),
        "TORCHELASTIC_MAX_RESTARTS": str(options.max_restarts),
        "MASTER_ADDR": place.master_addr,
        "MASTER_PORT": str(place.master_port),
        # Without these gloo and NCCL bind the address the hostname resolves to, which is not the
        # rendezvous address on many machines (127.0.1.1 on Debian, or the wrong NIC of a node).
        "GLOO_SOCKET_IFNAME": place.interface or os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
        "NCCL_SOCKET_IFNAME": place.interface or os.environ.get("NCCL_SOCKET_IFNAME", "lo"),
        # CUDA then numbers GPUs as nvidia-smi does; CPU ranks see none, so they cannot grab one
        # behind the user's back.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(place.visible_gpus),
        DEVICE_ENV: place.device,
    })
    if place.threads is not None:
        # The kernel's own setting ("4,2" included) reaches the ranks as written.
        env["OMP_NUM_THREADS"] = kernel_omp_setting() or str(place.threads)
    if place.restart_count is not None:
        # What torchelastic sets (torchrun --max-restarts), so code written for it finds its attempt.
        env["TORCHELASTIC_RESTART_COUNT"] = str(place.restart_count)
        # torch.distributed.is_torchelastic_launched() and Lightning's TorchElasticEnvironment look
        # for it: the ranks were started for the code, which must not start them again. The
        # rendezvous port names the launch, as torchrun's run id does.
        env["TORCHELASTIC_RUN_ID"] = f"accelnb-{place.master_port}"
    if options.group_timeout is not None:
        env[GROUP_TIMEOUT_ENV] = repr(float(options.group_timeout))
    if options.mixed_precision is not None:
        env["ACCELERATE_MIXED_PRECISION"] = options.mixed_precision
    if place.device == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"
    if place.gpus_owned > 1:
        # Accelerate (and so HF Trainer) refuses a model spread over GPUs with device_map="auto"
        # "in any distributed mode", which a launched rank always is (LOCAL_RANK is set). This is
        # its own switch for models that own several GPUs: it then wraps them in DDP with
        # device_ids=None, PyTorch's way for a module on several devices.
        env["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    return env


def kernel_omp_setting() -> str | None:
    """The kernel's ``OMP_NUM_THREADS``, or None where it is unset or empty (OpenMP ignores an
    empty one, and so do we)."""
    setting = os.environ.get("OMP_NUM_THREADS", "").strip()
    return setting or None
