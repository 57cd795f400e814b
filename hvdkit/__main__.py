"""The ``hvdkit`` command (also ``python -m hvdkit``).

hvdkit doctor            # what this environment can do, with fixes (hvdkit/tools/doctor.py)
hvdkit install-horovod   # build Horovod for this TensorFlow (hvdkit/tools/install_horovod.py)
"""

from __future__ import annotations

import sys

COMMANDS = {
    "doctor": "what this environment can do, and the fix for each problem",
    "install-horovod": "build Horovod 0.28.1 (MPI, Gloo) for the installed TensorFlow",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in COMMANDS:
        usage = "\n".join(f"  hvdkit {name:<16} {what}" for name, what in COMMANDS.items())
        given = f"unknown command {args[0]!r}\n" if args and args[0] not in ("-h", "--help") else ""
        print(f"{given}usage:\n{usage}", file=sys.stderr if given else sys.stdout)
        return 2 if given or not args else 0
    if args[0] == "doctor":
        from .tools import doctor

        return doctor.main(args[1:])
    from .tools import install_horovod

    return install_horovod.main(args[1:])


if __name__ == "__main__":
    sys.exit(main())
