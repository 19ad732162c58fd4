"""Finding Ray and the cluster, with errors that say what to do, before anything starts.

    >>> ray = connected_ray()          # the kernel's connection, made as ray.init() would   # doctest: +SKIP

accelnb never starts a Ray instance of its own: a plain ``ray.init()`` with no cluster running
starts one on this machine, which is not what ``cluster="ray"`` means. So: an existing connection
(the user's ``ray.init(address=...)``) is used as it is; otherwise accelnb connects to
``RAY_ADDRESS`` or, as ``ray.init(address="auto")`` does, to a cluster this machine is a node of.
"""

from __future__ import annotations

import os
import socket
from types import ModuleType

from accelnb.errors import LaunchConfigError

REACH_TIMEOUT_S = 5.0
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
        _check_reachable(_resolved_address(address))
        ray.init(address=address, ignore_reinit_error=True)
    except (ConnectionError, RuntimeError, ValueError) as error:
        if ray.is_initialized():
            ray.shutdown()
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise LaunchConfigError(f'cluster="ray" found no Ray cluster to connect to (address {address!r}: '
                                f"{reason}). {START_HINT}") from None
    return ray


def _resolved_address(address: str) -> str | None:
    """The GCS address ``ray.init(address)`` would connect to (``"auto"``: the last ``ray start``
    on this machine, or a GCS process running here), or None when Ray's own lookup is unavailable.
    Raises ConnectionError when there is none, as ``ray.init`` would."""
    try:
        from ray._private.services import get_ray_address_from_environment
    except ImportError:  # a Ray whose private lookup moved: ray.init finds it itself
        return None
    found = get_ray_address_from_environment(address, None)
    return str(found) if found else None


def _check_reachable(address: str | None) -> None:
    """Fail in seconds, not minutes, when the cluster's address does not answer (ray.init would
    retry its GCS connection for a long time): a cluster seen on this machine but not reachable
    from this kernel's network, or a stale RAY_ADDRESS."""
    if address is None or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S):
            pass
    except (OSError, ValueError) as error:
        raise ConnectionError(f"{address} does not answer: {error}") from None
