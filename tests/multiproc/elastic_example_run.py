"""Run examples/horovod/keras_mnist_elastic.py unchanged, with the test's hooks around it.

    python elastic_example_run.py OUTDIR --crash-at I --crash-rank R --hold-until FILE
        [--step-sleep S] -- [the example's arguments]

The hooks ride on a Keras callback added to every ``fit`` the example calls
(the example's file is not touched):

* ``--crash-at I``: the process that is rank ``R`` when its optimizer reaches
  step ``I`` SIGKILLs its worker (the parent), once in the whole job (a
  marker file decides).
* ``--hold-until FILE``: the first time a rank trains in a world smaller than
  the one it started in (after the crash), it writes ``OUTDIR/held-<pid>`` and
  waits for FILE, so a newcomer can be made ready before training goes on.
* ``--step-sleep S``: every step after the hold sleeps S seconds, so the job
  is still training when the ranks decide to admit the newcomer.

At the end each process writes ``OUTDIR/result-<pid>.json``: its first and
last rank and size, the optimizer's step, the state's epoch and batch, and
every model and optimizer variable (float64, flattened). ``OUTDIR/start-<pid>``
holds the rank and size it started as.
"""

import argparse
import json
import os
import runpy
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

import hvdkit

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "examples", "horovod", "keras_mnist_elastic.py")

p = argparse.ArgumentParser()
p.add_argument("outdir")
p.add_argument("--crash-at", type=int, default=None)
p.add_argument("--crash-rank", type=int, default=2)
p.add_argument("--hold-until", default=None)
p.add_argument("--step-sleep", type=float, default=0.0)
ARGS, EXAMPLE_ARGS = p.parse_known_args()
EXAMPLE_ARGS = [a for a in EXAMPLE_ARGS if a != "--"]
PID = os.getpid()
FIRST: dict = {}


def first_time(name: str) -> bool:
    """True for the one process of the whole job that creates OUTDIR/name."""
    try:
        with open(os.path.join(ARGS.outdir, name), "x"):
            return True
    except FileExistsError:
        return False


class Hooks(keras.callbacks.Callback):
    held = False

    def on_train_batch_end(self, batch, logs=None):
        if not FIRST:
            FIRST.update(rank=hvdkit.rank(), size=hvdkit.size())
            with open(os.path.join(ARGS.outdir, f"start-{PID}"), "w") as f:
                json.dump(FIRST, f)
        step = int(self.model.optimizer.iterations.numpy())
        if step == ARGS.crash_at and hvdkit.rank() == ARGS.crash_rank and first_time("crashed"):
            os.write(2, f"elastic_example_run: killing my worker at step {step}\n".encode())
            os.kill(os.getppid(), signal.SIGKILL)
            time.sleep(600)
        if ARGS.hold_until and hvdkit.size() < FIRST["size"] and not Hooks.held:
            Hooks.held = True
            with open(os.path.join(ARGS.outdir, f"held-{PID}"), "w") as f:
                f.write(str(step))
            deadline = time.monotonic() + 600  # only a broken test gets near this
            while not os.path.exists(ARGS.hold_until):
                if time.monotonic() > deadline:
                    os._exit(3)
                time.sleep(0.05)
        if Hooks.held and ARGS.step_sleep:
            time.sleep(ARGS.step_sleep)


_fit = keras.Model.fit


def fit_with_hooks(self, *a, callbacks=None, **kw):
    return _fit(self, *a, callbacks=[*(callbacks or []), Hooks()], **kw)


keras.Model.fit = fit_with_hooks
sys.argv = [EXAMPLE, *EXAMPLE_ARGS]
scope = runpy.run_path(EXAMPLE, run_name="__main__")

model, state = scope["model"], scope["state"]
flat = np.concatenate(
    [np.asarray(v.numpy(), np.float64).ravel() for v in model.variables + model.optimizer.variables]
)
result = {
    "first": FIRST,
    "rank": hvdkit.rank(),
    "size": hvdkit.size(),
    "iterations": int(model.optimizer.iterations.numpy()),
    "epoch": state.epoch,
    "batch": state.batch,
    "learning_rate": float(model.optimizer.learning_rate.numpy()),
    "weights": flat.tolist(),
}
with open(os.path.join(ARGS.outdir, f"result-{PID}.json"), "w") as f:
    json.dump(result, f)
print(f"elastic_example_run: rank {hvdkit.rank()} of {hvdkit.size()} done", flush=True)
