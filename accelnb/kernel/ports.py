"""The rendezvous port: bound by the launcher on 127.0.0.1 before any worker starts.

Binding here, rather than picking a number and hoping, means a taken ``master_port=`` is a clear
error before launch and a free port cannot be stolen between choice and use: the bound socket is
handed to rank 0's TCPStore (``master_listen_fd``). Nothing listens beyond loopback.
"""

from __future__ import annotations

import errno
import socket

from accelnb.errors import LaunchConfigError, PortInUseError

LOOPBACK = "127.0.0.1"


def bind_rendezvous_socket(port: int | None) -> socket.socket:
    """A listening TCP socket on 127.0.0.1: ``port``, or a free one when None/0."""
    if port is not None and not (0 <= int(port) <= 65535):
        raise LaunchConfigError(f"master_port must be between 1 and 65535, got {port}.")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # Allows reuse of a port whose previous connections linger in TIME_WAIT, never of a port
    # another process is listening on (Linux semantics).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((LOOPBACK, int(port or 0)))
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE and port:
            raise PortInUseError(int(port)) from None
        raise
    sock.listen(1024)
    return sock
