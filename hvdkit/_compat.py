"""Every TensorFlow / Keras / Horovod version quirk hvdkit works around.

Each item says why it exists, so it can be deleted when the reason goes away.
Nothing outside this module should test versions or poke at private APIs,
with these exceptions, each for a reason stated where it is:

* ``hvdkit/keras/sync_batch_norm.py`` overrides ``BatchNormalization._moments``
  (a protected method subclasses are meant to override) to average the
  batch statistics over the ranks;
* ``hvdkit/optimizer.py`` calls ``LossScaleOptimizer``'s private members
  from the function :func:`route_loss_scale_apply` installs (at
  :func:`hvdkit.init`; the list of members is ``_LSO_PRIVATE`` here);
* ``hvdkit/keras/_job_metrics.py`` replaces Keras's private
  ``Trainer._get_metrics_result_or_logs`` on each model it installs on (the
  one place ``fit``/``evaluate`` make their logs), so every callback sees the
  job's metrics;
* ``hvdkit/keras/callbacks.py`` patches ``keras.callbacks.BackupAndRestore.on_train_begin``
  for the whole process at :func:`hvdkit.init` (a public method, replaced on
  Keras's class), so that callback refuses a job of more than one rank;
* ``hvdkit/keras/_update_check.py`` wraps ``keras.optimizers.Optimizer.apply``
  for the whole process at :func:`hvdkit.init` (a public method, replaced on
  Keras's class: every update passes there) to name weights updated with no
  hvdkit reduction, and reads an optimizer's ``_trainable_variables`` when
  ``apply`` gets gradients only.
TensorFlow and Keras are imported inside the functions that need them, so the
launcher (which needs neither) can use the Horovod launch quirks cheaply.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import socket

from . import config
from .errors import ConfigurationError, LaunchError

# Horovod 0.28.1's ``horovod.tensorflow.keras.DistributedOptimizer`` accepts a
# Keras 3 optimizer, but Keras 3's trainer calls ``optimizer.apply()``, a path
# the Horovod wrapper does not intercept: gradients are silently NOT averaged
# (Horovod issue #4290). hvdkit therefore never uses horovod.tensorflow.keras
# and reduces gradients itself with horovod.tensorflow's collectives
# (tests/multiproc/training_worker.py checks that the wrapper still fails).


# The TensorFlow versions hvdkit is tested with, each with the Keras 3 it brings
# (scripts/matrix.sh; its last table is in README.md). setup.py's extras read this line;
# hvdkit.tools.install_horovod refuses others unless told, ``hvdkit doctor`` flags them.
# Horovod 0.28.1's build quirks per TensorFlow live in hvdkit/tools/install_horovod.py.
SUPPORTED_TENSORFLOW = ">=2.18,<2.22"


def tensorflow_supported(version: str) -> bool:
    """Whether TensorFlow ``version`` is in :data:`SUPPORTED_TENSORFLOW` (no import of TF)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion

    try:
        return SpecifierSet(SUPPORTED_TENSORFLOW).contains(version, prereleases=True)
    except InvalidVersion:
        return False


def require_keras3() -> None:
    """hvdkit's optimizer wrapper is written against Keras 3's optimizer API."""
    import keras

    if int(keras.__version__.split(".")[0]) < 3:  # pragma: no cover - installation
        raise ImportError(
            f"hvdkit needs Keras 3 (found keras {keras.__version__}); "
            "install it with `pip install 'keras>=3'`, or use horovod.tensorflow.keras "
            "directly for tf.keras 2."
        )


def check_gloo_hostname(rendezvous_host: str) -> None:
    """Refuse a cross-host Gloo job that Horovod 0.28.1 would break.

    Horovod 0.28.1 builds the Gloo context of its global process set
    (``GlooContext::InitializeForProcessSet``) with the process set's own,
    empty ``gloo_iface_`` instead of ``HOROVOD_GLOO_IFACE``, so Gloo falls back
    to the address this machine's host name resolves to. Where that is a
    loopback address (Debian's ``127.0.1.1 host`` line, containers), peers on
    other machines are told to connect to 127.0.0.1 and the job aborts with
    "connect [127.0.0.1]: Connection refused". Jobs on one machine are fine.
    """
    try:
        if ipaddress.ip_address(socket.gethostbyname(rendezvous_host)).is_loopback:
            return
    except (OSError, ValueError):
        return
    name = socket.gethostname()
    try:
        resolved = socket.gethostbyname(name)
    except OSError:
        resolved = None
    if resolved is None or ipaddress.ip_address(resolved).is_loopback:
        raise LaunchError(
            f"this machine's host name {name!r} resolves to {resolved or 'nothing'}, but the "
            f"job spans machines (scheduler at {rendezvous_host}). Horovod 0.28.1's Gloo "
            "uses that address for part of its setup, so other machines could not connect. "
            f"Make {name!r} resolve to the address other machines reach this one at (an "
            "/etc/hosts line such as '10.0.0.2 " + name + "'), then start the worker again."
        )


# Horovod 0.28.1 registers its TF ops for XLA only when built with
# HOROVOD_ENABLE_XLA_OPS (hvdkit's build does not), so a collective inside
# ``jit_compile=True`` fails deep in XLA with "No registered OpKernel". Keras 3
# turns XLA on by default (``jit_compile="auto"``) whenever a GPU is visible.
HOROVOD_XLA_LIMIT = "Horovod 0.28.1's collectives have no XLA kernels"


def refuse_jit_in_job(what: str, jit_compile: bool, size: int, fix: str) -> None:
    """Refuse ``jit_compile=True`` for code that runs collectives in a job of several ranks."""
    if jit_compile and size > 1:
        raise ConfigurationError(
            f"{what}: jit_compile=True in a job of {size} processes, but {HOROVOD_XLA_LIMIT} "
            f"(Keras's jit_compile='auto' picks XLA when a GPU is visible). {fix}"
        )


def in_xla_context() -> bool:
    """True while tracing a function that XLA will compile (see HOROVOD_XLA_LIMIT).

    Uses a private TF helper; there is no public equivalent in TF 2.21.
    """
    import tensorflow as tf

    if tf.executing_eagerly():
        return False
    try:
        from tensorflow.python.ops import control_flow_util
    except ImportError:  # pragma: no cover - TF moved the helper
        return False
    graph = tf.compat.v1.get_default_graph()
    return bool(control_flow_util.GraphOrParentsInXlaContext(graph))


def refuse_xla(what: str) -> None:
    """Raise a clear error if ``what`` is being traced for XLA compilation."""
    if in_xla_context():
        raise ConfigurationError(
            f"{what} cannot run inside an XLA-compiled function: {HOROVOD_XLA_LIMIT}. "
            "Compile the model with "
            "`model.compile(..., jit_compile=False)` (Keras 3 enables XLA by "
            "default when a GPU is visible), or use `tf.function(jit_compile=False)`."
        )


def opaque_while_tracing(tensor):
    """Pass a small graph tensor through unchanged, hidden from TF's trace-time evaluation.

    Horovod 0.28.1 registers its TF ops as stateless. When a graph uses a
    collective's output as a *shape* (``tf.reshape``, ``tf.split``'s sizes,
    ``tf.fill``), TensorFlow's shape inference may run that subgraph while
    tracing to learn the shape -- a real collective, on the ranks whose trace
    takes that path only, which then pairs with the wrong call or hangs. A
    stateful pass-through (``Print`` that never prints: ``first_n=0``) stops
    that evaluation; it forwards the same buffer, on the CPU, so use it for
    shape-sized metadata only, never for gradients.

    Example::

        sizes = _compat.opaque_while_tracing(received_splits)  # [size()] int32
        pieces = tf.split(received, sizes, num=size())
    """
    import tensorflow as tf

    if tf.executing_eagerly():
        return tensor
    return tf.raw_ops.Print(input=tensor, data=[], message="", first_n=0)


def control_flow_graph_classes() -> tuple[type, ...]:
    """The graphs TensorFlow traces ``cond`` branches and ``while`` bodies into (no public name)."""
    from tensorflow.python.ops import control_flow_v2_func_graphs as graphs

    return (graphs.CondBranchFuncGraph, graphs.WhileCondFuncGraph, graphs.WhileBodyFuncGraph)


def set_intra_op_threads(threads: int) -> bool:
    """Set TensorFlow's intra-op thread pool size; False if TF already started.

    TensorFlow fixes its thread pools when the first op runs and raises
    RuntimeError on later changes, so this can only take effect early.
    """
    return _set_thread_pool("intra_op", threads)


def set_inter_op_threads(threads: int) -> bool:
    """Set TensorFlow's inter-op thread pool size; False if TF already started."""
    return _set_thread_pool("inter_op", threads)


def inter_op_threads_set() -> bool:
    """Whether TensorFlow's inter-op pool size was set (``0`` = TensorFlow's default)."""
    import tensorflow as tf

    return tf.config.threading.get_inter_op_parallelism_threads() != 0


def _set_thread_pool(which: str, threads: int) -> bool:
    import tensorflow as tf

    get = getattr(tf.config.threading, f"get_{which}_parallelism_threads")
    if get() == threads:
        return True
    try:
        getattr(tf.config.threading, f"set_{which}_parallelism_threads")(threads)
    except RuntimeError:
        return False
    return True


def serialize_keras_object(obj):
    """Keras 3 moved (de)serialization helpers under ``keras.saving``."""
    import keras

    return keras.saving.serialize_keras_object(obj)


def deserialize_keras_object(config, custom_objects=None):
    import keras

    return keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)


def no_automatic_dependency_tracking(method):
    """Keras's decorator that stops TF auto-tracking from wrapping list attributes.

    Keras 3 optimizers use it in ``build``; a wrapper optimizer that creates
    variables in ``build`` needs the same, and Keras exports it only privately.
    """
    from keras.src.utils import tracking

    return tracking.no_automatic_dependency_tracking(method)


# Keras 3's TensorFlow trainer (checked on 3.10-3.15) trains by calling
# ``model.train_function(iterator)`` once per ``steps_per_execution`` steps,
# with the tf.data iterator of the fit call, and builds that function only
# while the attribute is None; evaluation uses ``model.test_function`` the same
# way, with the same ``steps_per_execution``. hvdkit's sink mode
# (:func:`hvdkit.sink.train`) puts its own multi-step function there for one
# fit call and restores the model afterwards. There is no public hook for it.
@contextlib.contextmanager
def keras_train_function(model, function, steps_per_execution: int):
    saved = (model.train_function, model.test_function, model.steps_per_execution)
    model.train_function = function
    # A test function built for another steps_per_execution would evaluate
    # only part of the validation data: let Keras build one for this fit.
    model.test_function = None
    model.steps_per_execution = steps_per_execution
    try:
        yield
    finally:
        model.train_function, model.test_function, model.steps_per_execution = saved


def keras_compile_token(model) -> object:
    """An object that is replaced each time ``model.compile`` runs.

    Keras 3 keeps no public compile counter; ``_compile_config`` is rebuilt by
    every ``compile`` call, so its identity tells a recompiled model (new
    optimizer, loss or metrics) from an unchanged one.
    """
    return getattr(model, "_compile_config", None)


def tf_variable(variable):
    """The ``tf.Variable`` holding a ``keras.Variable``'s value (a ``tf.Variable`` as is).

    Horovod's in-place broadcast (``broadcast_``) works on TensorFlow resource
    variables only; Keras 3's TensorFlow-backend ``Variable`` is not one but
    keeps one in ``_value`` (checked on Keras 3.10-3.15; there is no public
    accessor), and assigning to it updates the Keras variable.
    """
    import tensorflow as tf

    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "_value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise TypeError(
        f"expected a tf.Variable or keras.Variable, got {type(variable).__name__}; in-place "
        "broadcast needs variables (use broadcast() for tensors)."
    )


# --------------------------------------------------------------------------
# Horovod's Gloo rendezvous server (launcher side; imports no TensorFlow).
#
# Horovod 0.28.1's ``RendezvousServer.start()`` binds its HTTP key-value store
# to ``('', random port)``, every interface, and answers anyone: its public API
# takes neither an address nor a guard, and Horovod's Gloo client cannot send a
# credential. hvdkit therefore subclasses the server and handler classes
# (internal names in ``horovod.runner.http.http_server``) to bind one address
# and refuse clients that are not the job's (:mod:`hvdkit.launch.guard`).
def horovod_rendezvous_classes() -> tuple[type, type]:
    """``(RendezvousHTTPServer, RendezvousHandler)`` of Horovod 0.28.1."""
    from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer

    return RendezvousHTTPServer, RendezvousHandler


def horovod_slot_info() -> type:
    """Horovod 0.28.1's ``SlotInfo`` (a rank's place), as its rendezvous server's ``init``
    reads it."""
    from horovod.runner.common.util.hosts import SlotInfo

    return SlotInfo


# ``horovodrun --gloo`` (static, non-elastic) starts that server inside
# ``horovod.runner.gloo_run.launch_gloo(command, exec_command, settings, nics,
# env, server_ip)`` as ``RendezvousServer(settings.verbose)``, a module-level
# name looked up at call time; only ``launch_gloo`` knows ``server_ip``, the
# address the ranks are told to dial (127.0.0.1 when every host is local).
# Replacing both names in this process makes horovodrun use
# ``factory(server_ip, verbose)`` instead. Elastic mode is not covered.
def use_horovodrun_rendezvous(factory) -> None:
    """Make ``horovodrun --gloo`` run in this process use ``factory(server_ip, verbose)``."""
    from horovod.runner import gloo_run

    original = gloo_run.launch_gloo

    def launch_gloo(command, exec_command, settings, nics, env, server_ip):
        gloo_run.RendezvousServer = lambda verbose=0: factory(server_ip, verbose)
        return original(command, exec_command, settings, nics, env, server_ip)

    gloo_run.launch_gloo = launch_gloo


# ``horovodrun --gloo`` starts each rank as ``<its layout variables> <the launching
# environment> <command>`` (gloo_run._slot_info_to_command_fn), so a layout variable
# left in the environment horovodrun runs in (a shell that exported HOROVOD_RANK, a
# script started from another job's rank) overrides every rank's own: all ranks get
# the same rank, and Horovod's start waits out its timeout. Under MPI, mpirun hands
# them to the ranks too (``-x``), where hvdkit takes HOROVOD_SIZE before Open MPI's
# size (config.LAUNCHER_SIZE_VARS) and Horovod's runner HOROVOD_RANK/HOROVOD_SIZE
# before Open MPI's (runner.common.util.env.get_env_rank_and_size).
HOROVODRUN_LAYOUT_VARIABLES = (
    "HOROVOD_HOSTNAME",
    config.HOROVOD_RANK,
    config.HOROVOD_SIZE,
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_CROSS_RANK",
    "HOROVOD_CROSS_SIZE",
)


# ``horovodrun --gloo`` relays each rank's output through
# ``safe_shell_exec.prefix_connection``, which decodes strictly: the first byte
# that is not UTF-8 kills its thread, the rank's pipe fills and the rank blocks
# in ``write`` for ever (Horovod 0.28.1). ``relay(fd, dst, tag)`` replaces it.
def use_robust_output_relay(relay) -> None:
    """Make ``horovodrun --gloo`` in this process relay output with ``relay(fd, dst, tag)``."""
    from horovod.runner.common.util import safe_shell_exec

    def prefix_connection(src, dst, prefix, index, with_timestamp=False):
        tag = "" if index is None or prefix is None else f"[{index}]<{prefix}>:"
        try:
            relay(src.fileno(), dst, tag)
        finally:
            src.close()

    safe_shell_exec.prefix_connection = prefix_connection


# Before it starts a job, ``horovodrun`` checks that Horovod was built with the
# transport asked for (``horovod.runner.launch.gloo_built`` / ``mpi_built``,
# imported there from ``horovod.common.util``). Each check forks a child that
# imports ``horovod.tensorflow``, i.e. TensorFlow: 7 s of CPU (14 s of wall on
# a loaded 2-core machine) at every launch and every restart, before any rank
# starts. The answer is one C function of Horovod's TensorFlow extension
# (``horovod_gloo_built``, ``horovod_mpi_built``), which needs TensorFlow's two
# shared libraries loaded first, not its Python package: a child that loads
# just those three answers in about 1 s. Where it cannot (another layout of
# TensorFlow's or Horovod's files), Horovod's own check runs as before.
_TF_LIBRARIES = ("libtensorflow_framework.so.2", "libtensorflow_cc.so.2")
_BUILT_PROBE = """
import ctypes, glob, importlib.util, os, sys
tf = os.path.dirname(importlib.util.find_spec("tensorflow").origin)
for name in sys.argv[2:]:
    ctypes.CDLL(os.path.join(tf, name), mode=ctypes.RTLD_GLOBAL)
hvd = os.path.dirname(importlib.util.find_spec("horovod").origin)
(ext,) = glob.glob(os.path.join(hvd, "tensorflow", "mpi_lib*.so"))
print(int(bool(getattr(ctypes.CDLL(ext, mode=ctypes.RTLD_GLOBAL), sys.argv[1])())))
"""


def horovod_tf_built(transport: str) -> bool | None:
    """Whether Horovod's TensorFlow extension has ``transport`` ("gloo", "mpi", "nccl").

    Asked in a child process that does not import TensorFlow; None when it
    cannot tell (then ask Horovod: ``horovod.common.util.gloo_built()``).
    """
    import subprocess
    import sys

    probe = [sys.executable, "-c", _BUILT_PROBE, f"horovod_{transport}_built", *_TF_LIBRARIES]
    try:
        done = subprocess.run(probe, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip().splitlines()[-1:] if done.returncode == 0 else []
    return {"1": True, "0": False}.get(answer[0]) if answer else None


def use_quick_build_checks() -> None:
    """Make ``horovodrun`` run in this process check its build with :func:`horovod_tf_built`."""
    from horovod.runner import launch

    def quick(transport, horovods_own):
        answer = functools.cache(lambda: horovod_tf_built(transport))

        def built(verbose=False):
            known = answer()
            return horovods_own(verbose=verbose) if known is None else known

        return built

    launch.gloo_built = quick("gloo", launch.gloo_built)
    launch.mpi_built = quick("mpi", launch.mpi_built)


# ``horovodrun --mpi`` puts the Open MPI flags of the module-level list
# ``horovod.runner.mpi_run._OMPI_FLAGS`` (``-mca pml ob1``, ``-mca btl ^openib``
# in 0.28.1), read at call time, on the mpirun command line.
def use_mpirun_btl(value: str) -> None:
    """Make ``horovodrun --mpi`` in this process pass ``-mca btl value`` (``""``: no btl flag)."""
    from horovod.runner import mpi_run

    flags = [f for f in mpi_run._OMPI_FLAGS if not f.startswith("-mca btl ")]
    mpi_run._OMPI_FLAGS = flags + ([f"-mca btl {value}"] if value else [])


# When a rank exits non-zero, ``horovodrun --gloo`` (``gloo_run.launch_gloo``)
# raises a RuntimeError starting with this sentence and naming the first such
# process and its code; run from the command line it ends in a traceback.
_HOROVODRUN_RANK_FAILED = "Horovod detected that one or more processes exited with non-zero"


def horovodrun_rank_failure(exc: BaseException) -> str | None:
    """Horovod's message if ``exc`` is horovodrun's "a rank exited non-zero" error, else None."""
    if isinstance(exc, RuntimeError) and str(exc).startswith(_HOROVODRUN_RANK_FAILED):
        return str(exc).strip()
    return None


# Keras 3 draws the random numbers of ``keras.random.*`` calls made without a
# seed (and of ``keras.utils.set_random_seed``'s global generator) from one
# global ``SeedGenerator``, created on first use and kept in Keras's private
# global state (checked on 3.10-3.15). hvdkit's Checkpointer saves and
# restores its state so a resumed job draws the same numbers; there is no
# public accessor.
def keras_global_seed_state(create: bool = False):
    """The global SeedGenerator's state variable, or ``None`` if there is none yet."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator

    generator = global_state.get_global_attribute(seed_generator.GLOBAL_SEED_GENERATOR)
    if generator is None and create:
        generator = seed_generator.global_seed_generator()
    return None if generator is None else generator.state


class _DLPackCapsule:
    """Hands numpy a capsule from ``tf.experimental.dlpack.to_dlpack``.

    numpy >= 2 takes only objects with ``__dlpack__``; TensorFlow's exporter
    returns a bare capsule.
    """

    def __init__(self, capsule):
        self._capsule = capsule

    def __dlpack__(self, stream=None, **_):
        return self._capsule

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU: the only device numpy reads


def copy_variable(variable, out=None):
    """A copy of ``variable``'s value as numpy, written into ``out`` when it fits.

    ``variable.numpy()`` allocates a new array on every call, and on this
    kind of machine the first touch of hundreds of MB of fresh memory costs
    more than the copy itself (about 0.4 s per 200 MB measured, against
    0.01 s into memory already touched). A CPU tensor read through DLPack is
    a view of TensorFlow's buffer, so it can be copied into a reused ``out``
    (the Checkpointer keeps one per variable). Other devices and dtypes
    DLPack cannot carry take ``variable.numpy()``.

    Returns:
        ``out`` (filled) if its shape and dtype fit, else a new array.
    """
    import numpy as np
    import tensorflow as tf

    try:
        tensor = tf.convert_to_tensor(variable)
        if "CPU" not in tensor.device.upper():
            raise ValueError("not on the CPU")
        view = np.from_dlpack(_DLPackCapsule(tf.experimental.dlpack.to_dlpack(tensor)))
    except Exception:  # any failure of the fast path takes the plain one
        return np.array(variable.numpy(), copy=True)
    if out is None or out.shape != view.shape or out.dtype != view.dtype:
        out = np.empty(view.shape, view.dtype)
    np.copyto(out, view)
    return out


# Keras 3's LossScaleOptimizer decides from the gradients it is handed whether to
# apply a step; around a DistributedOptimizer those are one rank's local gradients
# (see hvdkit/optimizer.py, "loss scaling"). Keras has no hook between computing
# and applying gradients, so its private _common_apply is routed through hvdkit,
# which also calls the three other private members below. Checked against Keras
# 3.10-3.15; remove when Keras offers such a hook.
_LSO_PRIVATE = (
    "_common_apply",
    "_stateful_handle_finite_grads",
    "_stateful_handle_non_finite_grads",
    "check_finite",
)
_lso_keras_apply = None  # Keras's own _common_apply, once routed


def route_loss_scale_apply(route) -> None:
    """Make ``LossScaleOptimizer._common_apply`` call ``route(lso, keras_apply, grads, vars)``.

    Installed once per process (later calls do nothing); ``keras_apply`` is
    Keras's own method, for the optimizers ``route`` leaves alone.

    Raises:
        ConfigurationError: this Keras lacks a private member hvdkit needs.
    """
    global _lso_keras_apply
    if _lso_keras_apply is not None:
        return
    import keras

    lso = keras.optimizers.LossScaleOptimizer
    missing = [name for name in _LSO_PRIVATE if not hasattr(lso, name)]
    if missing:
        raise ConfigurationError(
            f"this Keras ({keras.__version__}) LossScaleOptimizer lacks {missing}, which "
            "hvdkit needs to decide loss scaling from averaged gradients; use the Keras "
            "version hvdkit pins (scripts/install.sh)."
        )
    keras_apply = lso._common_apply

    def _common_apply(self, grads, trainable_variables=None):
        return route(self, keras_apply, grads, trainable_variables)

    lso._common_apply = _common_apply
    _lso_keras_apply = keras_apply
