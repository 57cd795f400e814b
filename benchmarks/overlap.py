"""The gradient allreduce overlapping the backward pass: real training between simulated hosts.

    sudo .venv/bin/python benchmarks/overlap.py                       # 1 and 10 Gbit/s, Gloo, MPI
    sudo .venv/bin/python benchmarks/overlap.py --links 1gbit --transports gloo --rounds 2

Needs root, ``ip`` and ``tc``; refuses with exit status 2 otherwise. Two hosts
(network namespaces, ``tbf``-shaped links, the lab of ``benchmarks/multihost.py``),
one rank each, pinned to its own core. Gloo runs through hvdkit's
scheduler/worker launch, MPI through ``mpirun`` with a namespace launch agent.

The model: ``LAYERS`` Dense layers of ``WIDTH`` units on ``WIDTH`` inputs
(33.6 MB of float32 gradients in 16 tensors), SGD, a fixed batch of ``BATCH``
rows. In the same job, round after round (every variant once per round,
``--steps`` steps each; medians over ``--rounds``):

* ``forward``          the forward pass and loss alone;
* ``compute``          a training step without any allreduce;
* ``allreduce``        hvdkit's gradient allreduce alone (one bucket, fixed
                       tensors: the full gradient list and a quarter of it);
* ``tape_single``      a ``tf.function`` step with ``hvdkit.DistributedGradientTape``
                       and one bucket (hvdkit before buckets: nothing overlaps);
* ``tape_default``     the same with hvdkit's default buckets;
* ``tape_b<size>``     the same with other ``bucket_bytes`` (the default's choice);
* ``raw_horovod``      the same step with ``horovod.tensorflow.DistributedGradientTape``
                       (one allreduce per gradient, Horovod fusing what is ready),
                       Horovod's threads on the normal policy, as Horovod ships;
                       ``raw_horovod_b`` a second instance of it, the control;
                       ``raw_horovod_rr`` the same with ``HVDKIT_COMM_PRIORITY=1``;
* ``tape_default_rr``  hvdkit's default buckets with ``HVDKIT_COMM_PRIORITY=1``
                       (Horovod's threads on ``SCHED_RR``, ``hvdkit/_comm/threads.py``;
                       every variant not named ``_rr`` or ``_auto`` runs with the
                       threads on the normal policy; under MPI the setting does
                       nothing, so ``_rr`` rows equal the others);
* ``tape_auto``        hvdkit's default buckets with what ``HVDKIT_COMM_PRIORITY=auto``
                       (the default across hosts) kept: the job starts with it,
                       and before any variant runs, ``tape_default`` steps are
                       taken until its trial (``hvdkit/_comm/priority_trial.py``) decided;
* ``fit_single``, ``fit_default``, ``fit_auto``  ``model.fit`` with
                       ``hvdkit.DistributedOptimizer`` (one bucket / default /
                       default with auto's choice), per-step time from batch-end times;
* ``fit_compute``      ``model.fit`` with plain SGD: fit's step without any allreduce
                       (Keras's own per-step work included);
* ``fit_raw_horovod``  ``model.fit`` with an SGD that calls ``hvd.allreduce`` on each
                       gradient: raw Horovod's per-tensor step in ``fit``.

Hidden fraction of a step ``T``: ``(T_compute + T_allreduce - T) / min(T_allreduce,
T_backward)`` with ``T_backward = T_compute - T_forward``; 1 is perfect overlap.
For the ``fit_`` rows ``T_compute`` is ``fit_compute`` and "x raw" is the ratio
to ``fit_raw_horovod``; "x tape" is every row's ratio to the tape ``raw_horovod``.
A timeline of one step with the default buckets (``tf.timestamp`` ops after
the loss, after every gradient and after every reduced gradient) shows each
bucket's gradients ready and reduced against the backward pass.

The prediction refits ``multihost.py``'s ring model from this run's two
allreduce sizes per link and predicts a ResNet-50-sized job (100 MB of
gradients, a 0.25 s step, backward 2/3 of it) at 8/32/128 hosts on 10 Gbit/s
line rate, with the hidden fraction measured here at 1 Gbit/s (where the wire,
not the single core, bounds the allreduce).

Each job also records the share of its time the virtual machine's host gave
the cores to others (steal, from ``/proc/stat``); a job with more than
``STEAL_LIMIT`` of it, or whose raw Horovod step over its control's falls
outside ``CONTROL_BAND``, is reported as "not a measurement", with why
(runs 8-10 of docs/performance-record.md were such runs).

Prints tables, writes bench_results/overlap.json and docs/overlap_bench.svg
(``--from-json`` writes only what ``--json``/``--plot`` name). Runs the docs
cite are kept in benchmarks/records/.
A benchmark, not a test: nothing here fails on a slow machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parent))

import multihost as mh
from _common import steal_share
from _svg import document

from hvdkit.launch.transport import cpu_ticks

REPO = mh.REPO
LINKS = ("1gbit", "10gbit")
WIDTH, LAYERS, BATCH = 1024, 8, 1024
BUCKET_SWEEP = (0, 1 << 20, 16 << 20)  # besides one bucket and the default
MODEL_HOSTS = mh.MODEL_HOSTS
LINE_RATE_10G = 10e9 / 8  # bytes/s
SCHED_PORT = 29820
STEAL_LIMIT = 0.05  # share of a job's time the host ran other guests on our cores
CONTROL_BAND = (0.95, 1.05)  # raw Horovod's step over its control's, a quiet machine's range


# ----------------------------------------------------------------- analysis (pure)
def hidden_fraction(compute: float, allreduce: float, backward: float, step: float) -> float:
    """Share of the hideable time that a step of ``step`` seconds hid (1 = all of it)."""
    hideable = min(allreduce, backward)
    if hideable <= 0:
        raise ValueError(f"hidden_fraction: allreduce={allreduce}, backward={backward}; need > 0")
    return (compute + allreduce - step) / hideable


def last_bucket_bound(
    allreduce: float, backward: float, last_bytes: int, ranks: int, gbit_s: float
) -> float:
    """The highest hidden fraction any implementation can reach on this model and link.

    The bucket with the first layer's gradients (``last_bytes``), which the
    backward pass produces last, can only be reduced once the backward pass
    has ended, and a ring allreduce sends ``2 (ranks - 1) / ranks`` of its
    bytes from every rank: at least that long on a ``gbit_s`` link stays
    exposed, whatever the overlap.

    Example:
        >>> round(last_bucket_bound(0.307, 0.431, 4_198_400, 2, 0.956), 2)   # run 7, 1 Gbit/s
        0.89
    """
    hideable = min(allreduce, backward)
    if hideable <= 0 or ranks < 2 or gbit_s <= 0:
        raise ValueError(
            f"last_bucket_bound: allreduce={allreduce}, backward={backward}, ranks={ranks}, "
            f"gbit_s={gbit_s}; need times > 0, ranks >= 2 and a rate > 0"
        )
    wire = 2 * (ranks - 1) / ranks * last_bytes * 8 / (gbit_s * 1e9)
    return min(1.0, (allreduce - wire) / hideable)


def predict(fit: dict, hidden: float, nbytes: float, step_s: float, backward_s: float) -> dict:
    """Efficiency at ``MODEL_HOSTS`` on 10 Gbit/s line rate with ``hidden`` of the overlap."""
    per_call = max(0.0, fit["per_call"])
    row = {"hidden": hidden, "efficiency": {}, "allreduce_s": {}, "exposed_s": {}}
    for n in MODEL_HOSTS:
        comm = mh.step_allreduce_seconds(nbytes, n, LINE_RATE_10G, fit["alpha"], per_call)
        overlap = hidden * min(comm, backward_s)
        row["allreduce_s"][n] = comm
        row["exposed_s"][n] = max(0.0, comm - overlap)
        row["efficiency"][n] = mh.scaling_efficiency(step_s, comm, overlap)
    return row


def summarise(job: dict) -> dict:
    """Medians over rounds; hidden fractions and ratios to raw Horovod per round, then median.

    Each round has its own compute and allreduce-alone times, so a slow round
    (the machine is shared) moves a variant and its reference together.
    """
    rounds = job["rounds"]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    out = {"median_s": med, "backward_s": med["compute"] - med["forward"], "hidden": {}}
    out["over_raw"], out["over_raw_tape"] = {}, {}
    with_fit_controls = "fit_compute" in rounds[0]  # runs before 2026-11-26 lack them
    for k in med:
        if not k.startswith(("tape_", "fit_", "raw_")) or k == "fit_compute":
            continue
        # a fit step is set against fit's own compute step and raw Horovod in fit
        fit = k.startswith("fit_") and with_fit_controls
        compute, raw = ("fit_compute", "fit_raw_horovod") if fit else ("compute", "raw_horovod")
        out["hidden"][k] = statistics.median(
            hidden_fraction(r[compute], r["allreduce"], r["compute"] - r["forward"], r[k])
            for r in rounds
        )
        # step rate relative to raw Horovod's, >= 1 is at least as fast
        out["over_raw"][k] = statistics.median(r[raw] / r[k] for r in rounds)
        out["over_raw_tape"][k] = statistics.median(r["raw_horovod"] / r[k] for r in rounds)
    return out


def doubts(summary: dict, steal: float | None) -> list[str]:
    """Why a job's ratios are not a measurement (empty: no reason found).

    ``summary`` is :func:`summarise`'s; ``steal`` the job's steal share
    (``None``: unknown, not a reason). Runs before the control existed have
    no control to judge by.

    Example:
        >>> doubts({"over_raw": {"raw_horovod_b": 1.14}}, 0.3)
        ['the host took 30 % of the time (steal)', 'raw Horovod and its control 1.14x apart']
    """
    why = []
    if steal is not None and steal > STEAL_LIMIT:
        why.append(f"the host took {steal * 100:.0f} % of the time (steal)")
    control = summary["over_raw"].get("raw_horovod_b")
    if control is not None and not CONTROL_BAND[0] <= control <= CONTROL_BAND[1]:
        why.append(f"raw Horovod and its control {control:.2f}x apart")
    return why


# ----------------------------------------------------------------- the job (one rank)
def worker(steps: int, rounds: int, out: str) -> None:
    rank = int(os.environ.get("HOROVOD_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or 0)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})  # one core per simulated host
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import horovod.tensorflow as raw
    import keras
    import numpy as np
    import tensorflow as tf

    import hvdkit
    from hvdkit import _compat, runtime
    from hvdkit._comm import buckets as _buckets
    from hvdkit._comm import threads as _threads

    hvdkit.init(intra_op_threads=1)  # HVDKIT_COMM_PRIORITY=auto: the trial starts
    backend = runtime.backend()
    default_bytes = _buckets.resolve_bucket_bytes(None, "overlap.py")

    def build():
        keras.utils.set_random_seed(0)
        layers = [keras.layers.Dense(WIDTH, activation="relu") for _ in range(LAYERS - 1)]
        return keras.Sequential([keras.Input((WIDTH,)), *layers, keras.layers.Dense(WIDTH)])

    rng = np.random.default_rng(rank)
    x = tf.constant(rng.normal(size=(BATCH, WIDTH)).astype("float32"))
    y = tf.constant(rng.integers(0, WIDTH, size=BATCH).astype("int32"))
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = build()
    tvars = model.trainable_variables
    nbytes = sum(int(np.prod(v.shape)) * 4 for v in tvars)

    def step_with(gradients):
        opt = keras.optimizers.SGD(1e-4)

        @tf.function
        def step():
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            opt.apply(gradients(tape, loss), tvars)
            return loss

        return step

    @tf.function
    def forward():
        return loss_fn(y, model(x, training=True))

    pieces = [tf.random.uniform(v.shape) for v in tvars if len(v.shape) == 2]
    quarter = pieces[: len(pieces) // 4]

    def allreduce_of(tensors):
        @tf.function
        def reduce():
            return hvdkit.reduce_gradients(tensors, bucket_bytes=1 << 40)[0][0, 0]

        return reduce

    def tape(bucket_bytes):
        return step_with(
            lambda t, loss: hvdkit.DistributedGradientTape(t, bucket_bytes=bucket_bytes).gradient(
                loss, tvars
            )
        )

    raw_sources = [_compat.tf_variable(v) for v in tvars]

    def raw_gradients(t, loss):
        # Horovod's tape keys sources by tf.Variable.ref(): the tf.Variables inside
        return raw.DistributedGradientTape(t).gradient(loss, raw_sources)

    tape_variants = {
        "forward": forward,
        "compute": step_with(lambda t, loss: t.gradient(loss, tvars)),
        "allreduce": allreduce_of(pieces),
        "allreduce_quarter": allreduce_of(quarter),
        "raw_horovod": step_with(raw_gradients),
        # the control: a second, separately built raw Horovod step; its ratio to the
        # first is the noise this machine adds to every ratio in the table
        "raw_horovod_b": step_with(raw_gradients),
        "raw_horovod_rr": step_with(raw_gradients),  # Horovod with HVDKIT_COMM_PRIORITY=1
        "tape_single": tape(1 << 40),
        "tape_default": tape(None),
        "tape_default_rr": tape(None),  # hvdkit's default with HVDKIT_COMM_PRIORITY=1
        "tape_auto": tape(None),  # hvdkit's default with what the trial kept
        **{f"tape_b{b}": tape(b) for b in BUCKET_SWEEP if b != default_bytes},
    }

    class BatchEnds(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.ends = []

        def on_train_batch_end(self, batch, logs=None):
            self.ends.append(time.perf_counter())

    class RawHorovodSGD(keras.optimizers.SGD):
        """SGD that averages each gradient with its own ``hvd.allreduce`` first.

        What raw Horovod's per-tensor step is in ``fit``: Horovod's own Keras
        ``DistributedOptimizer`` does not average under Keras 3 (hvdkit's docs),
        so the allreduce goes where Keras 3 hands the gradients over. In the
        traced step each allreduce waits only for its own gradient.
        """

        def apply(self, grads, trainable_variables=None):
            grads = [raw.allreduce(g, op=raw.Average) for g in grads]
            return super().apply(grads, trainable_variables)

    data = tf.data.Dataset.from_tensors((x, y)).repeat()
    fit_models = {}
    fit_optimizers = {
        "fit_compute": keras.optimizers.SGD(1e-4),  # fit's step, no allreduce
        "fit_raw_horovod": RawHorovodSGD(1e-4),
        "fit_single": hvdkit.DistributedOptimizer(keras.optimizers.SGD(1e-4), bucket_bytes=1 << 40),
        "fit_default": hvdkit.DistributedOptimizer(keras.optimizers.SGD(1e-4), bucket_bytes=None),
        "fit_auto": hvdkit.DistributedOptimizer(keras.optimizers.SGD(1e-4), bucket_bytes=None),
    }
    for name, opt in fit_optimizers.items():
        m = build()
        m.compile(optimizer=opt, loss=loss_fn)
        fit_models[name] = m

    def run_tape(fn) -> tuple[float, float]:
        """Seconds per step, and CPU seconds of this process (all its threads) per step."""
        hvdkit.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(steps):
            last = fn()
        np.asarray(last)
        c1 = time.process_time()
        hvdkit.barrier()
        return (time.perf_counter() - t0) / steps, (c1 - c0) / steps

    def run_fit(m) -> float:
        ends = BatchEnds()
        hvdkit.barrier()
        m.fit(data, epochs=1, steps_per_epoch=steps + 1, verbose=0, callbacks=[ends])
        return statistics.median(b - a for a, b in zip(ends.ends, ends.ends[1:], strict=False))

    trial = backend._trial  # None under MPI: nothing to try
    trial_steps = 0
    while trial is not None:  # until every rank's trial decided
        tape_variants["tape_default"]()
        trial_steps += 1
        undecided = hvdkit.allreduce(tf.constant([float(trial.decision is None)]), op=hvdkit.Sum)
        if float(undecided[0]) == 0.0:
            break
    permitted = trial is not None and bool(trial.windows)  # SCHED_RR could be set
    auto_rr = bool(trial is not None and trial.decision)
    auto_line = backend.comm_priority
    if rank == 0:
        print(f"  auto after {trial_steps} steps: {auto_line}", flush=True)
    _threads.unfavour(backend.comm_threads)  # each variant sets its own below
    for fn in tape_variants.values():  # trace and warm up
        run_tape(fn)
    for m in fit_models.values():
        run_fit(m)
    measured = []
    for k in range(rounds):
        row = {}
        for name, fn in tape_variants.items():
            rr = permitted and (name.endswith("_rr") or (auto_rr and name.endswith("_auto")))
            if rr:
                _threads.favour(backend.comm_threads)
            row[name], row[f"cpu_{name}"] = run_tape(fn)
            if rr:
                _threads.unfavour(backend.comm_threads)
        for name, m in fit_models.items():
            rr = auto_rr and name.endswith("_auto")
            if rr:
                _threads.favour(backend.comm_threads)
            row[name] = run_fit(m)
            if rr:
                _threads.unfavour(backend.comm_threads)
        # the slowest rank's time: the step of the job
        names = sorted(row)
        slowest = hvdkit.allreduce(tf.constant([row[n] for n in names], tf.float64), op=hvdkit.Max)
        measured.append(dict(zip(names, map(float, slowest.numpy()), strict=True)))
        if rank == 0:
            shown = " ".join(f"{n}={measured[-1][n] * 1e3:.0f}" for n in names if "cpu" not in n)
            print(f"  round {k + 1}/{rounds} (ms): {shown}", flush=True)

    timeline = step_timeline(tf, hvdkit, _buckets, model, x, y, loss_fn, tvars, default_bytes)
    if rank == 0:
        info = {
            "size": hvdkit.size(),
            "gradient_bytes": nbytes,
            "gradient_tensors": len(tvars),
            "allreduce_bytes": {
                "allreduce": sum(int(np.prod(p.shape)) * 4 for p in pieces),
                "allreduce_quarter": sum(int(np.prod(p.shape)) * 4 for p in quarter),
            },
            "default_bucket_bytes": default_bytes,
            "comm_priority": auto_line,
            "auto_kept_sched_rr": auto_rr,
            "trial_steps": trial_steps,
            "trial_windows": [] if trial is None else trial.windows,
            "rounds": measured,
            "timeline": timeline,
        }
        Path(out).write_text(json.dumps(info))


def step_timeline(tf, hvdkit, _buckets, model, x, y, loss_fn, tvars, bucket_bytes) -> dict:
    """Seconds from the step's start: loss, each gradient, each reduced gradient (best of 6).

    ``tf.timestamp`` ops after each of them. They are stateful, and
    ``tf.function`` would run them in the order they were written (automatic
    control dependencies), each waiting for the one before: the graph is built
    with ``tf.compat.v1.wrap_function`` instead, which adds none, and Grappler's
    dependency optimizer (which drops control inputs of such ops) is off.
    """
    tf.config.optimizer.set_experimental_options({"dependency_optimization": False})

    def step():
        start = tf.timestamp()
        with tf.control_dependencies([start]):
            xs = tf.identity(x)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(xs, training=True))
        with tf.control_dependencies([loss]):
            t_loss = tf.timestamp()
        grads = tape.gradient(loss, tvars)
        stamps = []
        for g in grads:
            with tf.control_dependencies([g]):
                stamps.append(tf.timestamp())
        # no step check: each reduced gradient is available when its bucket is done
        reduced = hvdkit.reduce_gradients(grads, bucket_bytes=bucket_bytes)
        done = []
        for g in reduced:
            with tf.control_dependencies([g]):
                done.append(tf.timestamp())
        return tf.stack([t_loss, *stamps, *done]) - start

    timed = tf.compat.v1.wrap_function(step, [])
    best = None
    for _ in range(6):
        hvdkit.barrier()
        t = timed().numpy()
        if best is None or t.max() < best.max():
            best = t
    n = len(tvars)
    sizes = [int(v.shape.num_elements()) * 4 for v in tvars]
    buckets = _buckets.by_bytes(sizes, bucket_bytes)
    grad_t, done_t = best[1 : 1 + n], best[1 + n :]
    return {
        "loss_s": float(best[0]),
        "gradients_s": [float(t) for t in grad_t],
        "backward_end_s": float(grad_t.max()),
        "buckets": [
            {
                "tensors": b,
                "bytes": sum(sizes[i] for i in b),
                "ready_s": float(max(grad_t[i] for i in b)),
                "done_s": float(max(done_t[i] for i in b)),
            }
            for b in buckets
        ],
    }


# ----------------------------------------------------------------- driving the lab
def _worker_argv(steps: int, rounds: int, out: Path) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--worker",
        *("--steps", str(steps), "--rounds", str(rounds), "--out", str(out)),
    ]


def measure(args: argparse.Namespace) -> tuple[dict, list[dict]]:
    links = [s.strip() for s in args.links.split(",")]
    transports = [t.strip() for t in args.transports.split(",")]
    bad = [x for x in links if x not in mh.LINKS] + [
        t for t in transports if t not in mh.TRANSPORTS
    ]
    if bad or args.steps < 2 or args.rounds < 1:
        mh.refuse(
            f"overlap.py: bad value(s) {bad or ''} --steps {args.steps} --rounds {args.rounds}; "
            f"links are {', '.join(mh.LINKS)}, transports {', '.join(mh.TRANSPORTS)}, "
            "--steps >= 2, --rounds >= 1"
        )
    if (os.cpu_count() or 1) < 2:
        mh.refuse("overlap.py: needs 2 cores (one per simulated host)")
    mh.preflight(transports)
    os.environ["HVDKIT_COMM_PRIORITY"] = "auto"  # the default across hosts (one namespace each)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, mh._interrupted)
    mh.remove_stale_namespaces()
    tmp = REPO / "bench_results" / f"overlap-{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    jobs = []
    try:
        with mh.Lab(2) as lab:
            for link in links:
                lab.shape(link)
                pr = mh.probe(lab, tmp)
                print(f"{link}: probe {pr['rtt_s'] * 1e6:.0f} us, {pr['gbit_s']:.2f} Gbit/s")
                for transport in transports:
                    out = tmp / "job.json"
                    argv = _worker_argv(args.steps, args.rounds, out)
                    print(f"  {transport}:", flush=True)
                    ticks = cpu_ticks()
                    if transport == "gloo":
                        got = mh.run_job(lab, argv, out, tmp, SCHED_PORT + len(jobs))
                    else:
                        got = mh.run_job_mpi(lab, argv, out, tmp)
                    got["transport"] = transport
                    got["steal"] = steal_share(ticks, cpu_ticks())
                    jobs.append({"link": link, "probe": pr, **got})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    config = {
        "links": links,
        "transports": transports,
        "steps": args.steps,
        "rounds": args.rounds,
        "model": {"width": WIDTH, "layers": LAYERS, "batch": BATCH},
        "cores": os.cpu_count(),
        "load_avg_start": load_start,
        "load_avg_end": os.getloadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    return config, jobs


def analyse(jobs: list[dict]) -> dict:
    out: dict = {"jobs": [], "predictions": []}
    for job in jobs:
        s = summarise(job)
        med = s["median_s"]
        xs = [float(job["allreduce_bytes"][k]) for k in ("allreduce_quarter", "allreduce")]
        ys = [med["allreduce_quarter"], med["allreduce"]]
        alpha = job["probe"]["rtt_s"] / 2
        try:
            fit = mh.fit_alpha_beta(xs, ys, 2, alpha)
        except ValueError:
            fit = None
        why = doubts(s, job.get("steal"))  # runs before 2026-11-27 did not record steal
        first_layer = next(b for b in job["timeline"]["buckets"] if 0 in b["tensors"])
        s["last_bucket_bytes"] = first_layer["bytes"]
        s["bound"] = last_bucket_bound(
            med["allreduce"],
            s["backward_s"],
            first_layer["bytes"],
            job["size"],
            job["probe"]["gbit_s"],
        )
        row = {"link": job["link"], "transport": job["transport"], **s, "fit": fit}
        out["jobs"].append({**row, "steal": job.get("steal"), "doubts": why})
    nbytes = 4 * mh.MODEL_PARAMS
    backward = mh.BACKWARD_SHARE * mh.STEP_TIME_S
    for transport in sorted({j["transport"] for j in out["jobs"]}):
        by_link = {j["link"]: j for j in out["jobs"] if j["transport"] == transport}
        if not ({"1gbit", "10gbit"} <= set(by_link)) or by_link["10gbit"]["fit"] is None:
            continue
        fit = by_link["10gbit"]["fit"]
        variants = ("tape_auto", "fit_auto", "tape_default", "tape_default_rr", "fit_default")
        variants += ("raw_horovod", "tape_single")
        for variant in variants:
            hidden = max(0.0, min(1.0, by_link["1gbit"]["hidden"][variant]))
            row = predict(fit, hidden, nbytes, mh.STEP_TIME_S, backward)
            out["predictions"].append({"transport": transport, "variant": variant, **row})
        perfect = predict(fit, 1.0, nbytes, mh.STEP_TIME_S, backward)
        out["predictions"].append({"transport": transport, "variant": "perfect overlap", **perfect})
        comm = perfect["allreduce_s"][32]
        out.setdefault("hidden_needed_for_90pct_at_32", {})[transport] = hidden_needed(
            0.9, comm, mh.STEP_TIME_S, backward
        )
    return out


def hidden_needed(target: float, comm: float, step_s: float, backward_s: float) -> float:
    """Hidden fraction at which ``scaling_efficiency`` reaches ``target`` (0 if it already does)."""
    allowed = step_s / target - step_s  # exposed seconds that still give ``target``
    return max(0.0, (comm - allowed) / min(comm, backward_s))


def print_report(jobs: list[dict], analysis: dict) -> None:
    print("\nms per step (median of rounds, slowest rank); hidden = (Tc + Ta - T) / min(Ta, Tb)")
    for job, a in zip(jobs, analysis["jobs"], strict=True):
        med = a["median_s"]
        print(
            f"\n{job['link']} {job['transport']}: forward {med['forward'] * 1e3:.0f}, compute "
            f"{med['compute'] * 1e3:.0f} (backward {a['backward_s'] * 1e3:.0f}), allreduce "
            f"{med['allreduce'] * 1e3:.0f} ms ({job['gradient_bytes'] / 1e6:.1f} MB)"
        )
        if "cpu_allreduce" in med:
            print(
                f"  CPU per step in the process: compute {med['cpu_compute'] * 1e3:.0f} ms, "
                f"allreduce alone {med['cpu_allreduce'] * 1e3:.0f} ms, with default buckets "
                f"{med['cpu_tape_default'] * 1e3:.0f} ms (one core per host)"
            )
        print(f"  {'variant':18s}{'ms':>8s}{'hidden':>8s}{'x raw':>8s}{'x tape':>8s}")
        if "fit_compute" in med:
            print(f"  {'fit_compute':18s}{med['fit_compute'] * 1e3:8.1f}")
        for k in sorted(a["hidden"]):
            print(
                f"  {k:18s}{med[k] * 1e3:8.1f}{a['hidden'][k]:8.2f}{a['over_raw'][k]:8.2f}"
                f"{a['over_raw_tape'][k]:8.2f}"
            )
        print(
            f"  bound on the hidden fraction: {a['bound']:.2f} (the first layer's "
            f"{a['last_bucket_bytes'] / 1e6:.1f} MB, produced last, cross the wire after the "
            "backward pass)"
        )
        if a["steal"] is not None:
            print(f"  steal (the host running others on these cores): {a['steal'] * 100:.1f} %")
        if a["doubts"]:
            print(f"  NOT A MEASUREMENT: {'; '.join(a['doubts'])}")
        tl = job["timeline"]
        first = tl["buckets"][0]
        print(
            f"  timeline (default buckets, {len(tl['buckets'])}): loss at "
            f"{tl['loss_s'] * 1e3:.1f} ms, backward ends {tl['backward_end_s'] * 1e3:.1f} ms; "
            f"first bucket ready {first['ready_s'] * 1e3:.1f} ms, reduced "
            f"{first['done_s'] * 1e3:.1f} ms"
        )
    print(
        f"\nPredicted efficiency, {mh.MODEL_PARAMS * 4 / 1e6:.0f} MB of gradients, step "
        f"{mh.STEP_TIME_S} s (backward {mh.BACKWARD_SHARE:.2f} of it), 10 Gbit/s line rate, "
        "per-call cost and alpha fitted at 10gbit, hidden fraction measured at 1gbit"
    )
    print(f"  {'via':6s}{'variant':18s}{'hidden':>7s}" + "".join(f"{n:>8d}" for n in MODEL_HOSTS))
    for row in analysis["predictions"]:
        cells = "".join(f"{row['efficiency'][n] * 100:7.1f}%" for n in MODEL_HOSTS)
        print(f"  {row['transport']:6s}{row['variant']:18s}{row['hidden']:7.2f}{cells}")
    for transport, h in analysis.get("hidden_needed_for_90pct_at_32", {}).items():
        print(f"  {transport}: 90 % at 32 hosts needs a hidden fraction of {h:.2f}")
    doubtful = [a for a in analysis["jobs"] if a["doubts"]]
    for transport in sorted({a["transport"] for a in doubtful}):
        jobs_ = ", ".join(a["link"] for a in doubtful if a["transport"] == transport)
        print(f"  {transport}: predictions use a job that is not a measurement ({jobs_})")


# ----------------------------------------------------------------- picture
def svg_timeline(jobs: list[dict], path: Path) -> None:
    """One step per job with the default buckets: backward pass and each bucket's allreduce."""
    rows = []
    for job in jobs:
        tl = job["timeline"]
        rows.append((f"{job['link']} {job['transport']}", tl))
    span = max(max(b["done_s"] for b in tl["buckets"]) for _, tl in rows) * 1.05
    left, width, top = 130, 560, 48
    scale = width / span
    parts = [
        '<text x="10" y="18" font-size="13">One training step with the default buckets '
        "(2 simulated hosts, one core each)</text>"
        '<text x="10" y="32" fill="#555">grey: the backward pass; blue: each bucket, from '
        "its gradients ready to reduced on this rank</text>"
    ]
    y = top
    for label, tl in rows:
        parts.append(f'<text x="10" y="{y + 12}">{escape(label)}</text>')
        x0, x1 = left + tl["loss_s"] * scale, left + tl["backward_end_s"] * scale
        parts.append(
            f'<rect x="{x0:.1f}" y="{y}" width="{x1 - x0:.1f}" height="14" fill="#bbb"/>'
            f'<text x="{x1 + 4:.1f}" y="{y + 11}" fill="#555">backward ends</text>'
        )
        y += 18
        for k, b in enumerate(tl["buckets"]):
            bx0, bx1 = left + b["ready_s"] * scale, left + b["done_s"] * scale
            parts.append(
                f'<rect x="{bx0:.1f}" y="{y}" width="{max(1.0, bx1 - bx0):.1f}" height="9" '
                f'fill="#1f77b4"/><text x="{left - 6}" y="{y + 8}" text-anchor="end" '
                f'fill="#555">bucket {k + 1} ({b["bytes"] / 1e6:.1f} MB)</text>'
            )
            y += 12
        y += 14
    for ms in range(0, int(span * 1e3) + 1, max(50, int(span * 1e3) // 8 // 50 * 50)):
        x = left + ms / 1e3 * scale
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top - 6}" y2="{y}" stroke="#eee"/>'
            f'<text x="{x:.1f}" y="{y + 12}" text-anchor="middle" fill="#555">{ms} ms</text>'
        )
    height = y + 40
    path.write_text(document(left + width + 120, height, parts, footnote=""))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out")
    p.add_argument("--links", default=",".join(LINKS))
    p.add_argument("--transports", default="gloo,mpi")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rounds", type=int, default=5)
    # a re-analysis (--from-json) writes only where told to; a measurement writes both
    p.add_argument("--json", help="measuring: default bench_results/overlap.json")
    p.add_argument("--plot", help="measuring: default docs/overlap_bench.svg")
    p.add_argument("--from-json", help="re-analyse an earlier JSON (no namespaces)")
    args = p.parse_args()
    if args.worker:
        worker(args.steps, args.rounds, args.out)
        return
    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        config, jobs = old["config"], old["jobs"]
    else:
        args.json = args.json or str(REPO / "bench_results" / "overlap.json")
        args.plot = args.plot or str(REPO / "docs" / "overlap_bench.svg")
        config, jobs = measure(args)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"config": config, "jobs": jobs}, indent=2))
    analysis = analyse(jobs)
    print_report(jobs, analysis)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"config": config, "jobs": jobs, "analysis": analysis}, indent=2)
        )
        print(f"\nwrote {args.json}")
    if args.plot:
        svg_timeline(jobs, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
