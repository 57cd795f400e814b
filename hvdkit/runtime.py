"""Process-group lifecycle and topology: ``init``, ``rank``, ``size``, ...

Under a launcher (``horovodrun``, ``mpirun``, ``hvdkitrun``, the
scheduler/worker scripts) ``init()`` starts Horovod. Without one, hvdkit runs
as a job of size 1 whose collectives are the identity, so the same script
works both ways.
"""

from __future__ import annotations

import atexit
import functools
import gc
import io
import itertools
import logging
import os
import stat
import time
import weakref
from collections.abc import Iterator

import tensorflow as tf

from . import _compat, _phases, config
from . import process_sets as _sets
from ._autograph import not_converted
from ._comm import meeting as _meeting
from ._comm import progress as _progress
from ._validate import check_int
from .backends import Backend, create
from .clusters import slurm as _slurm
from .errors import CollectiveError, ConfigurationError, NotInitializedError

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "barrier",
    "backend_name",
]

# The layers above (the launcher's heartbeat, the Keras optimizer registration)
# are wired in by hvdkit.init in the package facade: runtime imports nothing
# from them (tests/unit/test_layering.py).
logger = logging.getLogger("hvdkit")
_backend: Backend | None = None
# Inside _meeting.join_next_world: a failed start is its to handle (it waits for
# the world after), so init() raises it there instead of meeting again itself.
_rejoining = False


def init(
    backend: str | None = None,
    *,
    intra_op_threads: int | str | None = None,
    pin_gpu: bool = True,
    process_sets: list | str | None = None,
) -> None:
    """Start hvdkit's runtime; call once, before building models.

    Args:
        backend: ``"horovod"`` or ``"local"``. ``None`` reads
            ``HVDKIT_BACKEND``, else picks ``"horovod"`` when a launcher set
            the world size in the environment and ``"local"`` (size 1)
            otherwise.
        intra_op_threads: TensorFlow intra-op threads for this process.
            ``"auto"`` (the default, also via ``HVDKIT_INTRA_OP_THREADS``)
            gives each of the ``local_size()`` processes on a machine an
            equal share of its cores when more than one runs there, so that
            they do not oversubscribe the CPU; an int sets it; ``0`` leaves
            TensorFlow's default. It only takes effect if no TF op has run yet.
        pin_gpu: Make only GPU ``local_rank() % num_gpus`` visible to this
            process and enable memory growth (the Horovod recipe). Not yet
            verified on a GPU machine.
        process_sets: Horovod's argument: a list of :class:`hvdkit.ProcessSet`
            to register now (the same list on every rank), or ``"dynamic"``
            to allow :func:`hvdkit.add_process_set` later
            (:mod:`hvdkit.process_sets`).

    In an elastic job (a worker of ``HVDKIT_ELASTIC=1`` started this
    process), a rank that cannot start because a peer was lost meanwhile,
    be it at the job's first start or as it joins a running job, waits for
    the scheduler's next world and starts in it
    (:func:`hvdkit._comm.meeting.join_next_world`), as the survivors do.

    Raises:
        ConfigurationError: ``backend`` is unknown, or ``"local"`` while a
            launcher started several processes; or no launcher started this
            process but ``HVDKIT_ROLE``/``HVDKIT_WORKER_NUM``/
            ``HVDKIT_SCHED_HOST``/``HVDKIT_SCHED_PORT`` (or their ``MS_*``
            aliases) are set: it would train alone (pass ``backend="local"``
            to do that on purpose).

    Example:
        >>> import hvdkit
        >>> hvdkit.init()
        >>> hvdkit.rank(), hvdkit.size()   # (0, 1) without a launcher
        (0, 1)
    """
    global _backend, _deferred
    if _backend is not None or _deferred is not None:
        return
    name = backend or config.get(config.BACKEND)
    launched = config.launched_size()
    slurm = _slurm.SlurmEnvironment.detect()  # srun's tasks (over MPI with PMIx)
    if slurm is not None:
        slurm.check_worker_num()
        launched = slurm.size if slurm.size > 1 else None  # one task: the size-1 job
    if name is None:
        name = "horovod" if launched is not None else "local"
    if launched is None and backend != "local":
        _refuse_lonely_job()
    _refuse_horovod_elastic()
    if name == "local" and launched is not None and launched > 1:
        raise ConfigurationError(
            f"backend 'local' was requested but the launcher started {launched} "
            "processes; a local backend would silently train each rank alone. "
            f"Drop backend='local' / {config.BACKEND}=local, or launch one process."
        )
    threads = _thread_setting(intra_op_threads)  # invalid input fails before anything starts
    freeze = config.get_bool(config.GC_FREEZE, True, fix=f"unset it or set {config.GC_FREEZE}=0")
    sets, dynamic = _sets.static_ranks(process_sets, launched or 1)
    world = list(range(launched or 1))
    new = [ps for ps in sets if ps.ranks != world]  # a set equal to the job is the global set
    if _DeferredStart.applies(name, process_sets):
        _deferred = _DeferredStart()
        _sets.deferred(start_deferred)
        place = _deferred
    else:
        _announce_joining()
        _phases.enter("init")
        try:
            _backend = create(name, [ps.ranks for ps in new], dynamic)
        except CollectiveError as exc:
            if _rejoining or not _meeting.enabled():
                raise
            # The first start of an elastic job failed for a lost peer: as the
            # survivors of a regroup do, the rank meets the next world and starts
            # there (this init again, the join behind it).
            again = functools.partial(
                init,
                backend,
                intra_op_threads=intra_op_threads,
                pin_gpu=pin_gpu,
                process_sets=process_sets,
            )
            _join_next_world(again, failed=exc)
            return
        ids = iter(_backend.process_set_ids())
        _sets.registered(sets, [0 if ps.ranks == world else next(ids) for ps in sets], _backend)
        place = _backend
    _configure_threads(threads, place.local_size())
    if place.size() > 1:
        _keep_a_second_inter_op_thread()
    if slurm is not None and place.size() != slurm.size:
        _refuse_split_srun_step(slurm.size, place.size())
    if pin_gpu:
        _pin_gpu(place.local_rank())
    if freeze:
        _freeze_startup_objects()


class _DeferredStart:
    """A newcomer's Horovod start, put off from :func:`init` to its first collective.

    A rank that joins a running elastic job says ready when it starts
    Horovod; the scheduler then takes the survivors out of their world, and
    they wait in the new world's first collective (the state's broadcast)
    until the newcomer gets there. Said in ``init()``, that wait held
    everything the script does between ``init()`` and ``restore()``: building
    the model (0.28 s of each join pause in the goodput runs), loading data.
    Put off to the first call that needs Horovod (:func:`start_deferred`:
    a collective, a process set's use, a probe; ``restore()`` calls it
    first), the survivors train on meanwhile. Until then the place
    in the world (rank, size, local and cross) is the assignment's: the
    Horovod settings the worker put in the environment, which Horovod's start
    reads as well. Horovod's module is loaded at once, so that the start
    itself is as short as a survivor's.

    Only a newcomer without process sets: ``init(process_sets=...)``
    registers its sets as Horovod starts, so such a rank starts at ``init()``.
    """

    name = "horovod"  # the only backend that starts late (applies)

    def __init__(self) -> None:
        from .backends import horovod  # noqa: F401  Horovod's module, loaded before the start

        self.env = {  # the worker sets them all (hvdkit.launch.worker)
            key: config.get_int(key, 0, minimum=0)
            for key in _compat.HOROVODRUN_LAYOUT_VARIABLES
            if key != "HOROVOD_HOSTNAME"
        }

    @staticmethod
    def applies(name: str, process_sets) -> bool:
        """Whether this ``init()`` joins a running elastic job and may put its start off."""
        return (
            name == "horovod"
            and process_sets is None
            and _meeting.enabled()
            and bool(config.get(config.ELASTIC_JOIN))
        )

    def rank(self) -> int:
        return self.env[config.HOROVOD_RANK]

    def size(self) -> int:
        return self.env[config.HOROVOD_SIZE]

    def local_rank(self) -> int:
        return self.env["HOROVOD_LOCAL_RANK"]

    def local_size(self) -> int:
        return self.env["HOROVOD_LOCAL_SIZE"]

    def cross_rank(self) -> int:
        return self.env["HOROVOD_CROSS_RANK"]

    def cross_size(self) -> int:
        return self.env["HOROVOD_CROSS_SIZE"]

    def start(self) -> None:
        """Start Horovod in the world the environment now names (its round's)."""
        global _backend
        _phases.enter("init")
        _backend = create(self.name, [], False)
        _sets.registered([], [], _backend)


# A newcomer whose init() put its Horovod start off (see _DeferredStart); None otherwise.
_deferred: _DeferredStart | None = None


def start_deferred() -> bool:
    """Start Horovod now if :func:`init` put it off; whether it did.

    A newcomer to an elastic job meets the others here (its ready, their go;
    :func:`_announce_joining`) and starts Horovod in the world of that round,
    which may be a later one than ``init()`` saw (a peer was lost meanwhile:
    then its rank and size changed, a warning says so, and the sampler
    ``restore()`` holds takes the new shards). If the start fails for a peer
    lost while the ranks connect, the rank waits for the next world and
    starts there, as in :func:`init`. Whatever needs Horovod calls it
    (through :func:`backend`, and a process set's first use);
    :meth:`hvdkit.Checkpointer.restore` and :func:`hvdkit.elastic.run` call
    it before anything else.
    """
    global _deferred
    if _deferred is None:
        return False
    start, _deferred = _deferred, None
    _announce_joining()
    try:
        start.start()
    except CollectiveError as exc:
        _join_next_world(start.start, failed=exc)
    _progress.rank_changed(rank())  # the heartbeats speak for the rank it started as
    _say_if_moved(start)
    return True


def _say_if_moved(start: _DeferredStart) -> None:
    """Warn if the rank started elsewhere than ``init()`` said (a peer was lost meanwhile)."""
    said, now = (start.rank(), start.size()), (rank(), size())
    if said != now:
        logger.warning(
            "hvdkit: a peer was lost while this rank got ready to join: it started Horovod as "
            "rank %d of %d, not rank %d of %d as hvdkit.rank()/size() said before its first "
            "collective. Values computed from them before then are stale; read rank() and "
            "size() after restore() (or in the training function) instead.",
            *now,
            *said,
        )


# Set once per process, at the first init(): the objects alive then are frozen,
# and the files among them are kept (weakly) for the flush at exit.
_frozen = False
_frozen_files: list[weakref.ref] = []


def _freeze_startup_objects() -> None:
    """At the first ``init()``: collect, then let Python's collector skip what is alive.

    Why, and what it changes (docs/performance.md, "A process's end"): what is
    alive now, mostly TensorFlow's and Keras's modules, is skipped by every
    later collection and not torn down at exit; an object alive now that is
    dropped later in a reference cycle is not freed before the process ends;
    files on disk still open at exit are flushed (:func:`_flush_files_at_exit`).
    ``HVDKIT_GC_FREEZE=0`` turns it off.
    """
    global _frozen
    if _frozen:
        return
    gc.collect()  # what is already garbage is finalized now, not frozen
    for f in _files_among(gc.get_objects()):
        try:
            _frozen_files.append(weakref.ref(f))
        except TypeError:  # a class registered as a file that takes no weak reference
            pass
    gc.freeze()
    _frozen = True


def _files_among(objects) -> Iterator[io.IOBase]:
    """The ``io`` objects among ``objects``, told by their type (one ABC check per type)."""
    is_file: dict[type, bool] = {}
    for o in objects:
        kind = type(o)
        if kind not in is_file:
            try:
                is_file[kind] = issubclass(kind, io.IOBase)
            except Exception:  # a type whose subclass hook fails: not one of ours to flush
                is_file[kind] = False
        if is_file[kind]:
            yield o


# Registered when hvdkit's runtime is imported, so that it runs after the exit
# handlers a script registers later (atexit runs the last registered first).
@atexit.register
def _flush_files_at_exit() -> None:
    """After a freeze, flush every file on disk still open (else Python's own end does).

    Frozen, ``__main__`` is not collected at exit, so a file held in a reference
    cycle by a global of the script would lose what it still buffers. Pipes and
    sockets are left alone (a flush could block on a peer); so is a file whose
    state cannot be read.
    """
    if not _frozen:
        return
    frozen = (ref() for ref in _frozen_files)
    for f in itertools.chain(frozen, _files_among(gc.get_objects())):  # frozen not listed
        try:
            if f is None or f.closed or not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                continue
            f.flush()
        except Exception:  # e.g. a detached buffer (ValueError), no fileno (OSError)
            pass


def _refuse_split_srun_step(tasks: int, formed: int) -> None:
    """srun started ``tasks`` tasks, but Horovod formed a job of ``formed``: never train so."""
    shutdown()
    raise _slurm.refuse_split_step(tasks, formed)


def _refuse_horovod_elastic() -> None:
    """``horovodrun --host-discovery-script`` (``HOROVOD_ELASTIC=1``): refused, with hvdkit's way.

    Horovod's elastic driver tells its ranks of new and lost hosts through
    its own notification service, which hvdkit's ranks do not listen to: a
    lost host would end the job, and a new one would never be admitted.
    """
    if config.get(config.HOROVOD_ELASTIC) == "1":
        from .errors import NotSupportedError

        raise NotSupportedError(
            "this process was started by horovodrun's elastic mode (--host-discovery-script, "
            f"{config.HOROVOD_ELASTIC}=1), whose host changes hvdkit cannot follow. Start the "
            f"job with hvdkit's elastic launch instead: {config.ELASTIC}=1 "
            f"{config.named(config.WORKER_NUM)}=N {config.MIN_WORKERS}=M "
            "examples/cluster/run_scheduler.sh, then "
            "examples/cluster/run_workers.sh K python train.py on each host "
            "(docs/elastic.md)."
        )


def _announce_joining() -> None:
    """A rank that joins a running elastic job meets the others before starting Horovod.

    It says ready (its worker tells the scheduler, which only then tells the
    survivors to leave their world at the next commit boundary) and waits for
    the go that comes when every rank of the new world is ready
    (:mod:`hvdkit._comm.meeting`); once a process, and only if it joins.

    Raises:
        ConfigurationError: no go within ``HVDKIT_SCHED_TIMEOUT``.
    """
    folder = _meeting.shared_folder()
    if not folder or not config.get(config.ELASTIC_JOIN):
        return
    timeout = config.sched_timeout(ConfigurationError)
    round_ = config.restart_count()
    try:
        _meeting.meet(folder, round_, time.monotonic() + timeout)
    except TimeoutError:
        raise ConfigurationError(
            f"this rank was to join a running elastic job in round {round_}, but the other "
            f"ranks were not ready within {timeout:g} s ({config.SCHED_TIMEOUT}); see the "
            "scheduler's log."
        ) from None
    os.environ.pop(config.ELASTIC_JOIN, None)  # joined once, at the start


def _refuse_lonely_job() -> None:
    """Refuse to train alone when the environment says this process is part of a job.

    ``HVDKIT_ROLE``/``MS_ROLE`` are handled by :func:`hvdkit.init` before it
    gets here (the process becomes the scheduler or a worker's rank); what is
    left is a process that would run as a job of size 1 although the
    scheduler/worker variables describe a job: it would train alone, silently.
    """
    _slurm.refuse_task_without_srun()
    found = config.job_vars_set()
    if not found:
        return
    shown = ", ".join(f"{v}={os.environ[v]!r}" for v in found)
    raise ConfigurationError(
        f"{shown} say this process is part of a scheduler/worker job, but no launcher "
        "started it, so it would train alone as a job of size 1. Start it the way the "
        "job is started (MS_ROLE=MS_SCHED once and MS_ROLE=MS_WORKER for each worker, with "
        "hvdkit.init() rather than hvdkit.runtime.init(); or examples/cluster/run_*.sh), "
        "or unset these variables to train in one process."
    )


def _thread_setting(setting: int | str | None) -> int | str:
    """``"auto"`` or a thread count >= 0, from the argument or HVDKIT_INTRA_OP_THREADS.

    An int (``True`` and ``2.5`` are not ints), or the string ``"auto"``.
    """
    fix = "use 'auto', 0 (TensorFlow's default) or a positive number of threads."
    if setting is None:
        if config.get(config.INTRA_OP_THREADS, "auto").strip() == "auto":
            return "auto"
        return config.get_int(config.INTRA_OP_THREADS, 0, minimum=0, fix=fix)
    if setting == "auto":
        return "auto"
    return check_int("intra_op_threads", setting, minimum=0, fix=fix)


def _configure_threads(setting: int | str, local_size: int) -> None:
    if setting == "auto":
        if local_size <= 1:
            return
        threads = max(1, len(os.sched_getaffinity(0)) // local_size)
    else:
        threads = int(setting)
        if threads == 0:
            return
    if not _compat.set_intra_op_threads(threads):
        logger.warning(
            "hvdkit: could not set TensorFlow intra-op threads to %d because TensorFlow "
            "already started; call hvdkit.init() before running any TensorFlow op.",
            threads,
        )


# The gradient allreduce overlaps the backward pass only if TensorFlow's executor
# has a second inter-op thread: with one, a bucket's allreduce is queued behind
# the rest of the backward pass and starts when it ends (measured with
# tf.timestamp ops: every gradient's timestamp lands at the end of the step).
# TensorFlow sizes the pool by the cores the process may use, so a rank bound to
# one core (mpirun --bind-to core, taskset) would get one.
MIN_INTER_OP_THREADS = 2


def _keep_a_second_inter_op_thread() -> None:
    """At least ``MIN_INTER_OP_THREADS`` inter-op threads, unless the user set the pool size."""
    if _compat.inter_op_threads_set() or len(os.sched_getaffinity(0)) >= MIN_INTER_OP_THREADS:
        return
    if not _compat.set_inter_op_threads(MIN_INTER_OP_THREADS):
        logger.warning(
            "hvdkit: this process may use one core and TensorFlow already started with one "
            "inter-op thread, so the gradient allreduce cannot overlap the backward pass; "
            "call hvdkit.init() before running any TensorFlow op."
        )


def _pin_gpu(local_rank_: int) -> None:
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return
    gpu = gpus[local_rank_ % len(gpus)]
    try:
        tf.config.experimental.set_memory_growth(gpu, True)
        tf.config.set_visible_devices(gpu, "GPU")
    except RuntimeError:
        logger.warning(
            "hvdkit: TensorFlow already initialized its GPUs, so rank-to-GPU pinning "
            "was skipped; call hvdkit.init() before running any TensorFlow op."
        )


def _get() -> Backend:
    if _backend is None:
        if not start_deferred():
            raise NotInitializedError()
    return _backend


def _place():
    """Where this rank is (rank, size, local, cross): Horovod's answer, or a put-off start's."""
    if _deferred is not None:
        return _deferred
    return _get()


def abandon() -> int:
    """End this process's connections to the other ranks; how many were open.

    For a world that lost a rank (:mod:`hvdkit.elastic`): a collective that
    waits on a peer fails now instead of at the transport's timeout. Call
    :func:`shutdown` next. Nothing to end without a runtime or in one process.
    """
    return _backend.abandon() if _backend is not None else 0


def shutdown() -> None:
    """Stop the runtime. ``init()`` may be called again afterwards."""
    global _backend, _deferred
    if _deferred is not None:  # put off and never started: nothing to stop
        _deferred = None
        _sets.forget_all()
    if _backend is not None:
        _sets.forget_all()
        _backend.shutdown()
        _backend = None


def rejoin() -> int:
    """Leave Horovod, meet the ranks of the elastic job's next world, start in it; the round.

    After a collective failed for a lost peer (:func:`hvdkit._comm.meeting.peer_lost`):
    :func:`hvdkit.elastic.run`'s recovery, and a :meth:`hvdkit.Checkpointer.restore`
    whose broadcast failed, go on as a rank of the next world
    (:func:`hvdkit._comm.meeting.join_next_world`).

    Example:
        >>> round_ = rejoin()            # then rank() and size() are the new world's
    """
    _phases.enter("leave")
    shutdown()
    _progress.forget_waits()  # not "stuck in a collective" while it rejoins
    round_ = _join_next_world(init)
    _progress.rank_changed(rank())  # the heartbeats speak for the new rank
    return round_


def _join_next_world(start, failed: CollectiveError | None = None) -> int:
    """:func:`hvdkit._comm.meeting.join_next_world`, with ``start``'s failures raised to it."""
    global _rejoining
    _rejoining = True
    try:
        return _meeting.join_next_world(start, failed=failed)
    finally:
        _rejoining = False


@not_converted
def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` not since)."""
    return _backend is not None or _deferred is not None


def started() -> bool:
    """Whether Horovod (or the local backend) runs: initialized, and not put off."""
    return _backend is not None


def job_rank_size(what: str, fix: str) -> tuple[int, int]:
    """``(rank(), size())`` for arguments left as ``None``: where every default of them is taken.

    Used by :mod:`hvdkit.ops` (``rank``/``size``) and :mod:`hvdkit.data`
    (``shard_id``/``num_shards``).

    Raises:
        NotInitializedError: :func:`init` was not called; names ``what`` and ``fix``.
    """
    if not is_initialized():
        raise NotInitializedError(
            f"{what} left as None default to this job's rank and size (hvdkit.rank(), "
            f"hvdkit.size()), but hvdkit is not initialized: call hvdkit.init() first, or {fix}"
        )
    return _place().rank(), _place().size()


@not_converted
def rank() -> int:
    """This process's index in the job, in ``[0, size())``."""
    return _place().rank()


@not_converted
def size() -> int:
    """Number of processes in the job."""
    return _place().size()


@not_converted
def local_rank() -> int:
    """This process's index among the processes on the same machine."""
    return _place().local_rank()


@not_converted
def local_size() -> int:
    """Number of processes on this machine."""
    return _place().local_size()


@not_converted
def cross_rank() -> int:
    """Index of this machine among the machines of the job."""
    return _place().cross_rank()


@not_converted
def cross_size() -> int:
    """Number of machines with a process of the same ``local_rank()``."""
    return _place().cross_size()


def barrier(process_set=None) -> None:
    """Block until every process of the job (or of ``process_set``) has reached this call."""
    _get().barrier(_sets.resolve(process_set, "barrier").process_set_id)


def backend_name() -> str:
    """``"horovod"`` or ``"local"``."""
    return _get().name


def backend() -> Backend:
    """The active backend (internal use by hvdkit modules)."""
    return _get()
