"""Finding Ray and the cluster, with errors that say what to do, before anything starts.

    >>> ray = connected_ray()          # the kernel's connection, made as ray.init() would   # doctest: +SKIP

accelnb never starts a Ray instance of its own: a plain ``ray.init()`` with no cluster running
starts one on this machine, which is not what ``cluster="ray"`` means. So: an existing connection
(the user's ``ray.init(address=...)``) is used as it is; otherwise accelnb connects to
``RAY_ADDRESS`` or, as ``ray.init(address="auto")`` does, to a cluster this machine is a node of.
"""

from __future__ import annotations

import os
from types import ModuleType

from accelnb.errors import LaunchConfigError

INSTALL_HINT = ("Install it with `pip install 'accelnb[ray]'` (or `pip install ray`) in this kernel's "
                "environment and on every node of the cluster, then restart the kernel.")
START_HINT = ("Start a cluster with `ray start --head` on one machine (and `ray start --address=HEAD_IP:6379` "
              "on the others), then connect this kernel before launching: `ray.init(address=\"auto\")` on a "
              "node of the cluster, `ray.init(address=\"ray://HEAD_IP:10001\")` from elsewhere, or set "
              "RAY_ADDRESS. accelnb does not start a Ray instance itself.")


def import_ray() -> ModuleType:
    """The ``ray`` module, or a :class:`LaunchConfigError` saying how to install it."""
    try:
        import ray
    except ImportError as error:
        raise LaunchConfigError(f'cluster="ray" needs Ray, which cannot be imported here ({error}). '
                                f"{INSTALL_HINT}") from None
    return ray


def connected_ray() -> ModuleType:
    """``ray``, connected to a running cluster, or a :class:`LaunchConfigError` saying how to
    start or address one."""
    ray = import_ray()
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as error:
        if ray.is_initialized():
            ray.shutdown()
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LaunchConfigError(f'cluster="ray" found no Ray cluster to connect to (address {address!r}: '
                                f"{reason}). {START_HINT}") from None
    return ray
