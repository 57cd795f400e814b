"""Fault-tolerance training job: the pattern users write, with a crash switch.

One seeded job (a small classifier on N synthetic samples, ``S`` ranks,
``B`` samples per rank and step) trained with :class:`hvdkit.Checkpointer`
and a :class:`hvdkit.data.ShardSampler`, in one of four ways, resumable at
any point. The tests run it, kill it, run it again, and compare with an
uninterrupted run. The training step itself records which sample ids it
trained on (the ids are part of the input), so the record does not trust
the sampler.

Command line (kept stable; other tests and ``hvdkitrun --max-restarts`` use it)::

    python ft_train.py OUTDIR [--mode fit|sink|loop|data_sink] [--ckpt DIR]
        [--epochs 3] [--samples 96] [--batch 4] [--every 5] [--sink-size 3]
        [--crash-at STEP] [--crash-rank 1] [--crash-how kill|stop|exit]
        [--crash-in-save STEP] [--attempt A] [--hold STEP --hold-until FILE]
        [--step-sleep S [--sleep-while FILE]] [--stop-at STEP [--stop-attempt A]] [--faults JSON]
        [--join-until FILE] [--linger-until FILE] [--mask-padding]

* ``--mode fit``: ``model.fit`` once per epoch with ``ShardPositionCallback``
  and ``ckpt.callback()``; ``sink``: ``hvdkit.sink.train`` with ``sink_size``
  steps per sink (checkpoints at sink boundaries); ``loop``: a custom loop
  with ``DistributedGradientTape`` and ``ckpt.maybe_save``; ``data_sink``:
  ``hvdkit.sink.data_sink`` with ``sink_size`` steps per call.
* ``--every K``: checkpoint every K steps (use a multiple of ``--sink-size``
  in the sink modes; ``N / (S*B)`` steps per epoch must be a multiple of it).
* ``--crash-at STEP``: rank ``--crash-rank`` SIGKILLs itself inside training
  step STEP (after the step's update, before any callback sees it).
* ``--crash-how``: ``kill`` (default) SIGKILL, ``stop`` SIGSTOP (a stall: the
  process stays, frozen), ``exit`` ``os._exit(3)`` (a non-zero exit),
  ``worker`` SIGKILL of the parent (the worker of a scheduler/worker job).
* ``--mode elastic``: ``fit`` inside ``@hvdkit.elastic.run``; after an
  in-process recovery the ids file gets a line ``{"recovered_from": step,
  "size": S, "rank": R}`` and training goes on in the same process.
* ``--crash-in-save STEP``: rank 0 SIGKILLs itself in the middle of writing
  the checkpoint of step STEP (leaving a torn ``.tmp-ckpt-...`` folder).
* Crashes happen only on the first attempt: ``--attempt`` (default
  ``$HVDKIT_RESTART_COUNT``, else 0) is 0 and the job did not resume past STEP.
* ``--ckpt``: checkpoint folder, default ``OUTDIR/ckpt``.
* ``--hold STEP --hold-until FILE``: on the first attempt, every rank writes
  ``OUTDIR/held-r<R>`` (its pid) inside step STEP and waits there until FILE
  exists (the preemption tests send SIGTERM meanwhile).
* ``--step-sleep S``: every step sleeps S seconds after its update, so the
  steps after a hold take at least that long on any machine.
* ``--sleep-while FILE``: steps sleep only while FILE exists (a test that
  paces faults by the job's life removes it to let training end).
* ``--faults JSON``: a list of ``{"step": s, "rank": r, "how": kill|stop|worker|cut}``
  (``cut``: the rank sets its namespace's ``eth0`` down and trains on);
  each fires once in the whole job (a marker file ``OUTDIR/fault-<i>``
  decides, and then holds the fault with its time and round), inside step s,
  on the process that is rank r at that moment.
* ``--join-until FILE``: a program that joins a running elastic job (its
  worker set ``HVDKIT_ELASTIC_JOIN``) waits for FILE before ``hvdkit.init()``,
  so it is not ready to meet the others until the test says so.
* ``--linger-until FILE``: after training (the elastic function returned),
  every rank waits for FILE before it ends, as a script's evaluation or
  final save would keep it.
* ``--mask-padding`` (fit, sink, elastic): the sampler's dataset gives pad
  mode's repeats ``sample_weight`` 0; they neither train nor are recorded.
* ``--no-autotune``: the sampler's dataset with tf.data's autotuner off
  (its epoch-end stops, docs/limits.md, are TensorFlow's, not the job's).
* ``--stop-at STEP`` (fit modes): in attempt ``--stop-attempt`` (default 0),
  after step STEP every rank makes sure it is saved (rank 0 writes it), waits
  for the others, and exits 0 without a result file: the first half of a run
  cut in two.

Output, in OUTDIR, per attempt ``A`` and rank ``R``:

* ``ids-a<A>-r<R>.jsonl``: a first line ``{"resumed_from": step, "size": S}``,
  then one line per training step ``{"epoch": e, "step": s, "ids": [...],
  "round": r, "t": T}`` (the global step after the update, the sample ids
  of this rank's batch, the launcher's round it was trained in, and the
  time it was recorded);
* ``result-a<A>-r<R>.json`` at the end: ``resumed_from``, ``final_step``,
  ``size``, ``weights`` (every model and optimizer variable, flattened, as
  float64) and ``warnings`` (the checkpoint warnings of the restore).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import hvdkit
from hvdkit.fault import checkpoint as checkpoint_module

FEATURES, CLASSES = 6, 3


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("outdir")
    p.add_argument("--mode", choices=["fit", "sink", "loop", "data_sink", "elastic"], default="fit")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--sink-size", type=int, default=3)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--crash-rank", type=int, default=1)
    p.add_argument("--crash-how", choices=["kill", "stop", "exit", "worker"], default="kill")
    p.add_argument("--crash-in-save", type=int, default=None)
    p.add_argument("--attempt", type=int, default=None)
    p.add_argument("--hold", type=int, default=None)
    p.add_argument("--hold-until", default=None)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--sleep-while", default=None)
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--faults", type=json.loads, default=[])
    p.add_argument("--stop-attempt", type=int, default=0)
    p.add_argument("--join-until", default=None)
    p.add_argument("--linger-until", default=None)
    p.add_argument("--mask-padding", action="store_true")
    p.add_argument("--no-autotune", action="store_true")
    return p.parse_args(argv)


def wait_for_file(path, limit_s=600.0):
    """Until ``path`` exists; a test that never makes it fails here, it does not hang."""
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            print(f"ft_train: {path} did not appear within {limit_s:g} s", flush=True)
            os._exit(3)
        time.sleep(0.1)


ARGS = parse_args(sys.argv[1:])
if ARGS.join_until and os.environ.get("HVDKIT_ELASTIC_JOIN"):
    wait_for_file(ARGS.join_until)
hvdkit.init()
RANK, SIZE = hvdkit.rank(), hvdkit.size()
ATTEMPT = (
    ARGS.attempt if ARGS.attempt is not None else int(os.environ.get("HVDKIT_RESTART_COUNT", 0))
)
os.makedirs(ARGS.outdir, exist_ok=True)
CKPT_DIR = ARGS.ckpt or os.path.join(ARGS.outdir, "ckpt")
IDS = open(os.path.join(ARGS.outdir, f"ids-a{ATTEMPT}-r{RANK}.jsonl"), "w")
STATE = {"epoch": 0, "resumed_from": 0}


def kill_self(why: str, how: str = "kill") -> None:
    IDS.flush()
    os.write(2, f"[rank {RANK}] ft_train: crashing on purpose ({how}): {why}\n".encode())
    if how == "exit":
        os._exit(3)
    if how == "worker":  # the worker that started us (we die with it)
        os.kill(os.getppid(), signal.SIGKILL)
        time.sleep(600)
    if how == "cut":  # this host's network (a namespace's eth0) goes down; we go on
        import subprocess

        subprocess.run(["ip", "link", "set", "eth0", "down"], check=True)
        return
    os.kill(os.getpid(), signal.SIGSTOP if how == "stop" else signal.SIGKILL)


def record(step, ids):
    """Host side of the training step: write the step's ids, maybe crash."""
    step = int(step)
    line = {
        "epoch": STATE["epoch"],
        "step": step,
        "ids": ids.numpy().tolist(),
        "round": round_now(),
        "t": time.time(),
    }
    IDS.write(json.dumps(line) + "\n")
    IDS.flush()
    if (
        ARGS.crash_at == step
        and RANK == ARGS.crash_rank
        and ATTEMPT == 0
        and STATE["resumed_from"] < step
    ):
        kill_self(f"inside training step {step}", ARGS.crash_how)
    for i, fault in enumerate(ARGS.faults):
        if fault["step"] == step and fault["rank"] == hvdkit.rank() and first_time(f"fault-{i}"):
            with open(os.path.join(ARGS.outdir, f"fault-{i}"), "w") as f:
                json.dump({**fault, "t": time.time(), "round": round_now()}, f)
            kill_self(f"fault {i} inside training step {step}", fault["how"])
    if ARGS.hold == step and ATTEMPT == 0 and STATE["resumed_from"] < step:
        hold(step)
    if ARGS.step_sleep and (ARGS.sleep_while is None or os.path.exists(ARGS.sleep_while)):
        time.sleep(ARGS.step_sleep)


def round_now() -> int:
    """The launcher's round this process trains in now (hvdkit.elastic changes it)."""
    return int(os.environ.get("HVDKIT_RESTART_COUNT", 0))


def first_time(name: str) -> bool:
    """True for the one process (of the whole job, on this machine) that creates OUTDIR/name."""
    try:
        os.close(os.open(os.path.join(ARGS.outdir, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def hold(step):
    """Say where we are (pid in OUTDIR/held-r<R>), then wait for --hold-until to exist."""
    with open(os.path.join(ARGS.outdir, f"held-r{RANK}"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + 600  # only a broken test gets near this
    while not os.path.exists(ARGS.hold_until):
        if time.monotonic() > deadline:
            kill_self(f"held at step {step} for 600 s without {ARGS.hold_until}", "exit")
        time.sleep(0.05)


def record_op(step, ids, updated):
    """Record the step once its update is applied.

    Reading the updated variables orders the record after their assignment,
    which needs this step's allreduced gradients: a rank never records a step
    whose allreduce did not complete (without it, the record could run while
    the allreduce still waited for a peer that had died).
    """
    with tf.control_dependencies([tf.identity(v) for v in updated]):
        tf.py_function(record, [step, ids], [])


def crash_in_save(stage, step):
    if step == ARGS.crash_in_save and ATTEMPT == 0 and STATE["resumed_from"] < step:
        kill_self(f"while writing the checkpoint of step {step} ({stage})")


checkpoint_module._write_hook = crash_in_save

# ---------------------------------------------------------------- data and model
rng = np.random.default_rng(0)
X = rng.normal(size=(ARGS.samples, FEATURES)).astype("float32")
Y = (X @ rng.normal(size=(FEATURES, CLASSES))).argmax(1).astype("int32")
IDS_ALL = np.arange(ARGS.samples, dtype=np.int64)
DATA = ({"x": X, "id": IDS_ALL}, Y)
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class Net(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="tanh")
        self.drop = keras.layers.Dropout(0.2, seed=3)
        self.out = keras.layers.Dense(CLASSES)

    def call(self, x, training=False):
        return self.out(self.drop(self.hidden(x), training=training))

    def train_step(self, data):
        inputs, y, weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            loss = LOSS(y, self(inputs["x"], training=True), sample_weight=weight)
        grads = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(grads, self.trainable_variables)
        ids = inputs["id"] if weight is None else tf.boolean_mask(inputs["id"], weight > 0)
        record_op(self.optimizer.iterations, ids, self.trainable_variables)
        return {"loss": loss}


keras.utils.set_random_seed(1)
model = Net()
model(np.zeros((1, FEATURES), "float32"))
sampler = hvdkit.data.ShardSampler(ARGS.samples, shuffle=True, seed=7)
B = ARGS.batch

if ARGS.mode in ("fit", "sink", "elastic"):
    model.compile(
        optimizer=hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.05, momentum=0.9)),
        loss=LOSS,
        jit_compile=False,
    )
    optimizer = model.optimizer
else:
    optimizer = keras.optimizers.SGD(0.05, momentum=0.9)

ckpt = hvdkit.Checkpointer(
    CKPT_DIR, model=model, optimizer=optimizer, sampler=sampler, every_steps=ARGS.every
)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always", checkpoint_module.CheckpointWarning)
    resumed = ckpt.restore()
restore_warnings = [str(w.message) for w in caught]
for message in restore_warnings:
    print(f"[rank {RANK}] {message}", file=sys.stderr)
STATE["resumed_from"] = resumed
IDS.write(json.dumps({"resumed_from": resumed, "size": SIZE}) + "\n")
IDS.flush()


# ---------------------------------------------------------------- the four ways to train
def custom_step(inputs, y):
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(inputs["x"], training=True))
    tape = hvdkit.DistributedGradientTape(tape)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    record_op(optimizer.iterations, inputs["id"], model.trainable_variables)
    return loss


step_fn = tf.function(custom_step)


def train_epochs(mode):
    for epoch in range(sampler.epoch, ARGS.epochs):
        sampler.set_epoch(epoch)
        STATE["epoch"] = epoch
        train_epoch(mode, epoch)


CALLS = []


@hvdkit.elastic.run
def train_elastic(state):
    # hvdkit.barrier() in every world, a joined rank's first one included
    hvdkit.barrier()
    if CALLS:  # an in-process recovery rolled the state back to its last save
        STATE["resumed_from"] = state.step
        line = {"recovered_from": state.step, "size": hvdkit.size(), "rank": hvdkit.rank()}
        line["round"] = round_now()
        IDS.write(json.dumps(line) + "\n")
        IDS.flush()
    CALLS.append(state.step)
    train_epochs("fit")


class StopAt(keras.callbacks.Callback):
    """--stop-at: save the step (if the schedule did not), wait for every rank, exit 0."""

    def on_train_batch_end(self, batch, logs=None):
        if ckpt.step != ARGS.stop_at or ATTEMPT != ARGS.stop_attempt:
            return
        if ckpt.step % ARGS.every:
            ckpt.save(ckpt.step)
        ckpt.wait()  # on disk before os._exit
        hvdkit.broadcast_object(None, 0)  # rank 0's write is done
        IDS.close()
        print(f"[rank {RANK}] ft_train: stopped after step {ckpt.step}", flush=True)
        os._exit(0)


def train_epoch(mode, epoch):
    ds = sampler.dataset(DATA, mask_padding=ARGS.mask_padding).batch(B)
    if ARGS.no_autotune:  # TensorFlow's epoch-end stops (docs/limits.md) left out
        options = tf.data.Options()
        options.autotune.enabled = False
        ds = ds.with_options(options)
    if mode == "fit":
        stop = [StopAt()] if ARGS.stop_at is not None else []
        model.fit(
            ds,
            initial_epoch=epoch,
            epochs=epoch + 1,
            verbose=0,
            shuffle=False,
            callbacks=[hvdkit.data.ShardPositionCallback(sampler, B), ckpt.callback(), *stop],
        )
    elif mode == "sink":
        hvdkit.sink.train(
            model,
            len(ds) // ARGS.sink_size,
            ds,
            callbacks=[hvdkit.data.ShardPositionCallback(sampler, B), ckpt.callback()],
            sink_size=ARGS.sink_size,
            verbose=0,
        )
    elif mode == "loop":
        step = ckpt.step
        for inputs, y in ds:
            step_fn(inputs, y)
            sampler.advance(int(tf.shape(y)[0]))
            step += 1
            ckpt.maybe_save(step)
    else:  # data_sink
        step = ckpt.step
        sink = hvdkit.sink.data_sink(custom_step, ds, sink_size=ARGS.sink_size)
        for _ in range(len(ds) // ARGS.sink_size):
            sink()
            sampler.advance(ARGS.sink_size * B)
            step += ARGS.sink_size
            ckpt.maybe_save(step)


if ARGS.mode == "elastic":
    train_elastic(ckpt)
else:
    train_epochs(ARGS.mode)
if ARGS.linger_until:
    print(f"[rank {RANK}] ft_train: trained; lingers", flush=True)
    wait_for_file(ARGS.linger_until)

IDS.close()
flat = np.concatenate(
    [np.asarray(v.numpy(), np.float64).ravel() for v in model.variables + optimizer.variables]
)
result = {
    "resumed_from": resumed,
    "final_step": int(ckpt.step),
    "iterations": int(optimizer.iterations.numpy()),
    "size": SIZE,
    "weights": flat.tolist(),
    "warnings": restore_warnings,
}
with open(os.path.join(ARGS.outdir, f"result-a{ATTEMPT}-r{RANK}.json"), "w") as f:
    json.dump(result, f)
print(f"[rank {RANK}] ft_train done: resumed from {resumed}, final step {ckpt.step}")
