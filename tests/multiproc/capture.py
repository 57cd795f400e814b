"""Record every frame seen in this network namespace (run as root inside it).

    ip netns exec NS python capture.py OUT_FILE MAX_SECONDS

A raw AF_PACKET socket sees every interface of the namespace (loopback too),
in both directions. Each frame is written as a 4-byte big-endian length and
the frame, flushed at once, so a test can read the file while it grows. Stops
on SIGTERM, after MAX_SECONDS, or after 256 MiB. Prints "capturing" when
ready. :func:`tests.test_security_mp.packets` parses the file.
"""

import signal
import socket
import struct
import sys
import time

ETH_P_ALL = 0x0003
MAX_BYTES = 256 << 20

out, max_seconds = sys.argv[1], float(sys.argv[2])
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
sock.settimeout(0.2)
deadline = time.monotonic() + max_seconds
written = 0
with open(out, "wb") as f:
    print("capturing", flush=True)
    while not stop and time.monotonic() < deadline and written < MAX_BYTES:
        try:
            frame = sock.recv(1 << 18)
        except (TimeoutError, InterruptedError):
            continue
        f.write(struct.pack(">I", len(frame)) + frame)
        f.flush()
        written += 4 + len(frame)
