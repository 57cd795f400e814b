"""``horovodrun`` as hvdkitrun runs it, with these changes.

    python -m hvdkit.launch.guarded_horovodrun ADDRS [--btl VALUE] -- <horovodrun arguments>

(``ADDRS``: the Gloo job's other hosts' addresses, comma-separated; may be "";
``--btl``: what ``horovodrun --mpi`` passes to mpirun as ``-mca btl``, "" for
nothing, from :func:`hvdkit.launch.transport.mpirun_btl`.)

Runs Horovod's own ``horovodrun`` in this process, but

* its Gloo rendezvous server is a :class:`~hvdkit.launch.guard.GuardedRendezvous`:
  bound to the address horovodrun tells the ranks to dial (127.0.0.1 when
  every host is this machine) instead of every interface, and answering only
  the listed addresses and that one;
* its check that Horovod was built with the transport does not import
  TensorFlow (:func:`hvdkit._compat.use_quick_build_checks`): about 1 s
  instead of 7 s of CPU at every launch and restart;
* under MPI, the ``-mca btl`` flag it gives mpirun is ``--btl``'s value
  (:func:`hvdkit._compat.use_mpirun_btl`), when given;
* its Gloo output relay is :func:`~hvdkit.launch.output.tag_pipe`, which
  takes any bytes (Horovod's stops at the first byte that is not UTF-8 and
  the rank then blocks on a full pipe).
"""

from __future__ import annotations

import sys

from .. import _compat
from .guard import GuardedRendezvous
from .output import tag_pipe


def main(argv: list[str]) -> int:
    btl = None
    if len(argv) >= 3 and argv[1] == "--btl":
        btl, argv = argv[2], [argv[0], *argv[3:]]
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    allowed = {a for a in argv[0].split(",") if a}

    def factory(server_ip: str, verbose: int = 0) -> GuardedRendezvous:
        return GuardedRendezvous(server_ip, allowed | {server_ip}, verbose)

    _compat.use_horovodrun_rendezvous(factory)
    _compat.use_quick_build_checks()
    _compat.use_robust_output_relay(tag_pipe)
    if btl is not None:
        _compat.use_mpirun_btl(btl)
    from horovod.runner.launch import run_commandline

    sys.argv = ["horovodrun", *argv[2:]]
    try:
        return run_commandline()
    except RuntimeError as exc:
        # A rank that exited non-zero (a failure, or 75 after a preemption) is
        # hvdkitrun's to explain: Horovod's message without its traceback.
        message = _compat.horovodrun_rank_failure(exc)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
