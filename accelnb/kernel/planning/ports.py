"""The rendezvous port: bound by the launcher on 127.0.0.1 before any worker starts.

Binding here, rather than picking a number and hoping, means a taken ``master_port=`` is a clear
error before launch and a free port cannot be stolen between choice and use: the bound socket is
handed to rank 0's TCPStore (``master_listen_fd``). Nothing listens beyond loopback.

    >>> sock = bind_rendezvous_socket(None)        # a free port
    >>> sock.getsockname()[1] > 0
    True
    >>> sock.close()
"""

from __future__ import annotations

import errno
import socket

from accelnb.errors import LaunchConfigError, PortInUseError
from accelnb.wire.spec import LOOPBACK


def check_port(port: object) -> None:
    """Refuse anything but a TCP port number, 1 to 65535 (callers say "a free one" with None)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise LaunchConfigError(f"master_port must be a port number from 1 to 65535, got {port!r}. "
                                "Leave it unset to let accelnb pick a free port.")


def bind_rendezvous_socket(port: int | None) -> socket.socket:
    """A listening TCP socket on 127.0.0.1: ``port``, or a free one when None."""
    if port is not None:
        check_port(port)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Allows reuse of a port whose previous connections linger in TIME_WAIT, never of a port
    # another process is listening on (Linux semantics).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, port or 0))  # 0: the OS picks a free port
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE and port:
            raise PortInUseError(port) from None
        raise
    sock.listen(1024)
    return sock
