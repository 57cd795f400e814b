"""The scheduler/worker wire format: one JSON object per line over TCP."""

from __future__ import annotations

import json
import socket

MAX_LINE = 64 * 1024


class Channel:
    """A TCP connection carrying newline-terminated JSON messages."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._reader = sock.makefile("r", encoding="utf-8", newline="\n")
        self.peer = sock.getpeername()

    def send(self, **msg) -> None:
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def recv(self) -> dict | None:
        """Next message, or None when the peer closed the connection."""
        line = self._reader.readline(MAX_LINE)
        if not line:
            return None
        try:
            msg = json.loads(line)
        except ValueError:
            return {"type": "garbage", "raw": line[:200]}
        return msg if isinstance(msg, dict) else {"type": "garbage", "raw": line[:200]}

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
