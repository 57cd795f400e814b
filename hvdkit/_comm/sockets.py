"""This process's TCP sockets, found by inode, and shutting some of them down (Linux).

Horovod's Gloo transport connects every rank to the others when Horovod
starts (``hvd.init``) and keeps those connections open. A collective that
waits for data from a peer that is gone waits until Gloo's timeout, unless
the connection it waits on is closed. :func:`opened_since` names the
connections Horovod opened; :func:`shut_down` ends them (``shutdown(2)`` on
the socket, which the owner sees as a closed connection at once).

The sockets are read from ``/proc/self/fd`` and ``/proc/net/tcp{,6}``;
elsewhere (no ``/proc``) nothing is found and nothing is shut down.

Example:
    >>> before = tcp_inodes()
    >>> # ... something opens connections ...
    >>> mine = opened_since(before)
    >>> shut_down(mine)   # how many were still open
    2
"""

from __future__ import annotations

import contextlib
import os
import socket

_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"  # the state column of a listening socket in /proc/net/tcp


def _socket_fds() -> dict[int, int]:
    """``{inode: fd}`` for every socket this process has open."""
    found = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    found[int(target[8:-1])] = int(name)
    return found


def _tcp_connection_inodes() -> set[int]:
    """Inodes of the TCP sockets of this network namespace that are not listening."""
    inodes = set()
    for table in _TCP_TABLES:
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)  # the header
            for line in f:
                cols = line.split()
                if len(cols) > 9 and cols[3] != _LISTEN:
                    inodes.add(int(cols[9]))
    return inodes


def tcp_inodes() -> set[int]:
    """The inodes of this process's TCP connections (listening sockets left out)."""
    return set(_socket_fds()) & _tcp_connection_inodes()


def opened_since(before: set[int]) -> set[int]:
    """This process's TCP connections that were not in ``before`` (a :func:`tcp_inodes`)."""
    return tcp_inodes() - before


def shut_down(inodes: set[int]) -> int:
    """``shutdown(SHUT_RDWR)`` each of ``inodes`` still open here; how many were.

    The file descriptors stay open (their owner closes them); only the
    connections end, so whoever waits on one sees it closed.
    """
    done = 0
    for inode, fd in _socket_fds().items():
        if inode not in inodes:
            continue
        with contextlib.suppress(OSError):
            sock = socket.socket(fileno=os.dup(fd))
            try:
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            finally:
                sock.close()
    return done
