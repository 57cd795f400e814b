"""Time from a rank's death to training again under ``hvdkitrun --max-restarts``.

    python benchmarks/restart.py [--repeats 2] [--transports gloo,mpi]

Runs ``hvdkitrun -np 2 --max-restarts 1`` on this file in worker mode: a small
Keras model trained in a custom loop with ``hvdkit.DistributedOptimizer``;
on the first attempt rank 1 SIGKILLs itself at step 20 (its death time is
written to a file first). On the restarted attempt every rank notes when its
process started, when TensorFlow was imported, when ``hvdkit.init()``
returned and when its first training step finished. Prints a table (seconds
after the death) and writes ``bench_results/restart.json``. The phases:

* ``detected``: death -> hvdkitrun prints its restart line (horovodrun or
  mpirun notices the death and stops the other rank; hvdkitrun collects the
  output and names the cause);
* ``relaunched``: restart line -> the new process runs (the 1 s back-off,
  then starting ``horovodrun`` and through it the ranks);
* ``tf_import``: importing TensorFlow and Keras in the new process;
* ``init``: ``hvdkit.init()`` (Horovod's start-up and rendezvous);
* ``first_step``: building the model and the first distributed step;
* ``total``: death -> the first step of the restarted job is done.

Wall-clock times on a shared machine; never a pass/fail gate.
"""

from __future__ import annotations

import time

_T_START = time.time()  # before any import: when this process began running Python

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DIE_AT = 20
PHASES = ["detected", "relaunched", "tf_import", "init", "first_step", "total"]


def worker(outdir: Path) -> None:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    t_tf = time.time()
    import hvdkit

    hvdkit.init()
    t_init = time.time()
    r = hvdkit.rank()
    attempt = int(os.environ.get("HVDKIT_RESTART_COUNT", "0"))
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)]
    )
    opt = hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.01))
    x = np.random.default_rng(r).normal(size=(16, 32)).astype("float32")
    y = x.sum(-1, keepdims=True)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    for s in range(DIE_AT + 5 if attempt == 0 else 3):
        if attempt == 0 and r == 1 and s == DIE_AT:
            (outdir / "death").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        float(step())
        if attempt == 1 and s == 0:
            times = dict(start=_T_START, tf=t_tf, init=t_init, first_step=time.time())
            (outdir / f"restart.rank{r}.json").write_text(json.dumps(times))


def one_run(transport: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="hvdkit-restart-bench-") as tmp:
        outdir = Path(tmp)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
        env["TF_CPP_MIN_LOG_LEVEL"] = "2"
        hvdkitrun = str(Path(sys.executable).parent / "hvdkitrun")
        cmd = [hvdkitrun, "-np", "2", f"--{transport}", "--max-restarts", "1"]
        cmd += [sys.executable, __file__, "--worker", str(outdir)]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
        )
        restart_line_at, tail = None, []
        for line in proc.stderr:  # the launcher's lines, time-stamped as they come
            tail = [*tail[-40:], line]
            if restart_line_at is None and "hvdkitrun: restart 1/1 after" in line:
                restart_line_at = time.time()
        proc.wait(timeout=900)
        if proc.returncode != 0 or restart_line_at is None or not (outdir / "death").exists():
            raise SystemExit(f"the {transport} run failed:\n{''.join(tail)}")
        death = float((outdir / "death").read_text())
        ranks = [json.loads((outdir / f"restart.rank{r}.json").read_text()) for r in (0, 1)]
    # The job trains again when its slowest rank has taken its first step.
    latest = max(ranks, key=lambda t: t["first_step"])
    return {
        "detected": restart_line_at - death,
        "relaunched": min(t["start"] for t in ranks) - restart_line_at,
        "tf_import": statistics.mean(t["tf"] - t["start"] for t in ranks),
        "init": statistics.mean(t["init"] - t["tf"] for t in ranks),
        "first_step": statistics.mean(t["first_step"] - t["init"] for t in ranks),
        "total": latest["first_step"] - death,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", metavar="OUTDIR", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--transports", default="gloo,mpi")
    args = p.parse_args()
    if args.worker:
        worker(Path(args.worker))
        return
    results: dict[str, list[dict]] = {}
    t0 = time.time()
    for transport in args.transports.split(","):
        results[transport] = [one_run(transport) for _ in range(args.repeats)]
    print(f"\nseconds after a rank's death (2 ranks, {args.repeats} runs each, median)")
    print(f"{'transport':10}" + "".join(f"{ph:>12}" for ph in PHASES))
    summary = {}
    for transport, runs in results.items():
        med = {ph: statistics.median(run[ph] for run in runs) for ph in PHASES}
        summary[transport] = med
        print(f"{transport:10}" + "".join(f"{med[ph]:12.1f}" for ph in PHASES))
    payload = {
        "what": "seconds from a rank's SIGKILL to the restarted job's first training step",
        "machine": f"{os.cpu_count()} cores, shared",
        "phases": PHASES,
        "median": summary,
        "runs": results,
    }
    from _common import write_results  # here, not above: imports are timed in the ranks

    out = write_results("restart", payload)
    print(f"\nwrote {out} in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
