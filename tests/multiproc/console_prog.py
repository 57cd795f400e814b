"""Prints what real programs print, as bytes, for the relay tests (tests/test_console_mp.py).

    python console_prog.py            # under a launcher: the rank comes from its variables

Rank 0: Keras-summary lines (box drawing), bytes that are not UTF-8, a
character split over two writes, a progress bar updated with ``\\b...\\r``,
a 1 MB line, then a last line. Rank 1: plain numbered lines. Every write is
an ``os.write``, so the relay sees the pieces exactly as written here; what
each rank's log must hold is :func:`expected`.
"""

import os
import sys

SUMMARY = "│ conv2d_1 (Conv2D) │ (None, 7, 7, 128) │ 73,856 │"
SUMMARY_LINES = 20_000
LONG = 1_000_000
BAR_STEPS = 10


def bar(i: int) -> str:
    return f"{i}/{BAR_STEPS} " + "━" * i + " " * (BAR_STEPS - i) + f" - loss: {1 / i:.4f}"


def expected(rank: int) -> list[str]:
    """Each line of ``rank``'s log file, as the relay must write it."""
    if rank != 0:
        return [f"rank 1 line {i}" for i in range(2000)]
    lines = [f"{SUMMARY} {i}" for i in range(SUMMARY_LINES)]
    lines += [
        "bad \ufffd\ufffd bytes",
        "split é done",
        bar(BAR_STEPS),
        "L" * LONG,
        "Test accuracy: 1.0",
    ]
    return lines


def main(rank: int) -> None:
    w = lambda b: os.write(1, b)
    if rank != 0:
        for i in range(2000):
            w(f"rank 1 line {i}\n".encode())
        return
    block = []
    for i in range(SUMMARY_LINES):
        block.append(f"{SUMMARY} {i}\n")
        if len(block) == 100:
            w("".join(block).encode())
            block = []
    w(b"bad \xff\xfe bytes\n")
    e = "é".encode()
    w(b"split " + e[:1])
    w(e[1:] + b" done\n")
    width = 0
    for i in range(1, BAR_STEPS + 1):
        w(("\b" * width + "\r" + bar(i)).encode())
        width = len(bar(i))
    w(b"\n")
    w(b"L" * LONG + b"\n")
    w(b"Test accuracy: 1.0\n")


if __name__ == "__main__":
    env = os.environ
    main(int(env.get("OMPI_COMM_WORLD_RANK") or env.get("HOROVOD_RANK") or sys.argv[1]))
