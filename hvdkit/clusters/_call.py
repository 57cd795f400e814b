"""Run a pickled ``fn(*args, **kwargs)`` as one rank, in a process of its own.

``hvdkit.spark.run`` starts one such process per barrier task: a fresh
process is a fresh Horovod world, whatever ran in the Python worker that
Spark reuses, and it ends with its task (it dies with its parent).

    python -m hvdkit.clusters._call CALL RESULT

``CALL`` holds ``cloudpickle.dumps((fn, args, kwargs))``. On return, ``RESULT``
holds ``pickle.dumps(("ok", value))`` and the process exits 0; if ``fn``
raised, ``("raised", kind, text)``: ``kind`` is ``"lost-peer"`` when the
error is hvdkit's or Horovod's collective failing (another rank was lost:
worth a retry), else ``"fn"`` (the function's own error: a retry would raise
it again); the process exits 1.
"""

from __future__ import annotations

import pickle
import signal
import sys
import traceback

RAISED, OK = "raised", "ok"
LOST_PEER, FN_ERROR = "lost-peer", "fn"
# How a rank's report begins when fn never ran or ran but its value could not travel:
# the driver then says "rank N: ..." rather than "fn raised on rank N".
CANNOT_LOAD, CANNOT_RETURN = "cannot load fn", "fn returned a value that cannot be pickled"


def kind_of(exc: BaseException) -> str:
    """``"lost-peer"`` for a collective that failed (hvdkit's or Horovod's error), else ``"fn"``."""
    from ..errors import CollectiveError, CollectiveMismatchError

    if isinstance(exc, CollectiveMismatchError):  # ranks disagree: the program's own error
        return FN_ERROR
    if isinstance(exc, CollectiveError):
        return LOST_PEER
    # Horovod's own (tf.errors.UnknownError/AbortedError from a Gloo op) without hvdkit's wrapper
    text = f"{type(exc).__name__}: {exc}"
    if "Horovod" in text and ("shut down" in text or "Gloo" in text or "connection" in text):
        return LOST_PEER
    return FN_ERROR


def summary(text: str) -> str:
    """The line of a traceback that says what was raised (``Class: message``), shortened."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for line in reversed(lines):
        head = line.split(":", 1)[0]
        if head and " " not in head and head[0].isalpha() and line != head:
            return line[:300]
    return (lines[-1] if lines else "")[:300]


def cannot_load(exc: Exception) -> str:
    """Why this rank could not load ``fn`` and its arguments, and the fix.

    cloudpickle sends a function of the driver script by value, but one
    imported from another module by that module's name: the executor must be
    able to import it (a retry would fail the same way).
    """
    text = f"{CANNOT_LOAD} and its arguments: {type(exc).__name__}: {exc}."
    if isinstance(exc, ImportError):
        text += unimportable_fix(
            "executors", "spark-submit --py-files module.py, or sc.addPyFile", "pyspark"
        )
    return text


def unimportable_fix(workers: str, ship: str, pickler: str) -> str:
    """The fix for fn from a module the cluster's ``workers`` cannot import (Spark's, Ray's).

    ``ship``: how the cluster ships a module with the job; ``pickler``: the
    package whose ``cloudpickle`` can send the module by value instead.
    """
    return (
        f" fn (or an argument) comes from a module the {workers} cannot import: ship it with "
        f"the job ({ship}), or send it by value: {pickler}.cloudpickle."
        "register_pickle_by_value(module) in the driver."
    )


def main(argv: list[str]) -> int:
    from ..launch.processes import die_with_parent

    die_with_parent(signal.SIGKILL)  # the task's process ended: so does its rank
    call, result = argv
    try:
        with open(call, "rb") as f:
            fn, args, kwargs = pickle.load(f)
    except Exception as exc:  # fn refers to a module the executor does not have
        out = (RAISED, FN_ERROR, cannot_load(exc))
        print(out[2], file=sys.stderr)
    else:
        try:
            value = fn(*args, **kwargs)
            out = (OK, value)
        except BaseException as exc:  # the rank's error goes to the driver whole
            traceback.print_exc()
            out = (RAISED, kind_of(exc), "".join(traceback.format_exception(exc)))
    try:
        payload = pickle.dumps(out)
    except Exception as exc:  # the return value cannot travel
        payload = pickle.dumps(
            (
                RAISED,
                FN_ERROR,
                f"{CANNOT_RETURN} ({exc}); return plain data "
                "(numbers, lists, numpy arrays, a path to a saved model) instead.",
            )
        )
        out = (RAISED,)
    with open(result, "wb") as f:
        f.write(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    return 0 if out[0] == OK else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
