"""Checkpoints of the whole training state: :class:`Checkpointer`.

One object saves and restores everything a restarted job needs to continue
as if it had never stopped: the model's variables (weights and the states
of its layers' random generators), the optimizer's (slots, ``iterations``,
the loss scale of a ``LossScaleOptimizer``), the epoch, the data position of
a :class:`~hvdkit.data.ShardSampler` (a global cursor, so the job may resume
on another number of ranks), the host random-number state (Python's
``random``, NumPy's global generator, Keras's global ``SeedGenerator``) and
a JSON-able dict of user extras.

Rank 0 writes each checkpoint atomically (a temporary folder, fsync,
rename; a manifest with SHA-256 checksums; see :mod:`hvdkit.fault._checkpoint_files`)
and keeps the last ``keep``; :meth:`Checkpointer.restore` skips torn or corrupt
ones with a warning and loads the newest complete one on rank 0, then
broadcasts it.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import keras
import numpy as np

from .. import _compat, _phases, collectives, config, errors, runtime
from .._comm import meeting as _meeting
from .._validate import check_int, is_number
from ..data.sampler import ShardPositionCallback, ShardSampler
from ..data.sharding import shard_length
from ..errors import ConfigurationError, HvdkitError
from . import _checkpoint_files as files
from . import preemption

__all__ = ["Checkpointer", "CheckpointWarning"]

# Test hook: called as _write_hook(stage, step) while rank 0 writes a
# checkpoint ("arrays": after the first variable's bytes are written). The
# fault-tolerance tests kill the process there to leave a torn checkpoint.
_write_hook = None


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on restore (torn or corrupt); the message names it."""


def _dtype_name(variable) -> str:
    return keras.backend.standardize_dtype(variable.dtype)


def _numpy_dtype(name: str, variable) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # e.g. bfloat16, known to NumPy only through ml_dtypes' scalar type
        return np.asarray(variable.numpy()).dtype


def _rng_state() -> dict:
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    seed_state = _compat.keras_global_seed_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "keras_global_seed": None if seed_state is None else np.asarray(seed_state).tolist(),
    }


def _set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state["keras_global_seed"] is not None:
        var = _compat.keras_global_seed_state(create=True)
        var.assign(np.asarray(state["keras_global_seed"], dtype=var.dtype))


# The background write in progress per checkpoint directory (rank 0, this process).
_writing: dict[Path, threading.Thread] = {}


class Checkpointer:
    """Saves and restores the whole training state, so a restarted job continues exactly.

    Call :meth:`restore` on every rank before training: it loads the newest
    complete checkpoint in ``directory`` on rank 0 and broadcasts it, so
    every rank starts identical (on a fresh start it broadcasts rank 0's
    initial variables). Then save on a schedule every rank agrees on: with
    :meth:`callback` in ``model.fit`` or :func:`hvdkit.sink.train`, or with
    :meth:`maybe_save` / :meth:`save` in a custom loop. Only rank 0 writes.

    Args:
        directory: Folder of the checkpoints (created if missing); the same
            path for every rank (only rank 0 uses it). ``None``: nothing is
            written (Horovod's elastic state classes, :mod:`hvdkit.fault.elastic_state`,
            keep their commits in memory only).
        model: A built ``keras.Model``; all of ``model.variables`` are saved.
        optimizer: Its optimizer; ``None`` means ``model.optimizer`` when the
            model is compiled. Built on :meth:`restore` if it is not yet.
        sampler: The :class:`~hvdkit.data.ShardSampler` feeding the model;
            its position is saved and restored (on any number of ranks).
        every_steps: Save when the step count reaches a multiple of it.
        every_seconds: Save when this much time passed on rank 0 since the
            last save; rank 0 decides and broadcasts the decision, so ranks
            never disagree (checked about ten times per interval).
        keep: Checkpoints kept (the newest ``keep``; older ones are deleted).
        extra: A JSON-able dict saved with every checkpoint; :meth:`restore`
            replaces its contents with the saved ones.
        preemption: Stop for ``SIGTERM`` at a step every rank agrees on, after
            saving it (:mod:`hvdkit.preemption`): :meth:`restore` installs the
            handler, the schedule (the callback, :meth:`maybe_save`) checks it,
            and every rank raises :class:`~hvdkit.preemption.Preempted` (exit
            status 75). ``False`` leaves ``SIGTERM`` alone. In an elastic job
            (:mod:`hvdkit.elastic`) the same per-second exchange also admits
            a joining worker at a step every rank agrees on.
        background: ``True`` (default): :meth:`save` copies the state in
            memory and returns; one thread on rank 0 writes, fsyncs and
            renames it. The next save, :meth:`restore`, :meth:`wait`, a
            preemption stop and the process's end wait for an unfinished
            write; a failed write is raised at the next of these. ``False``:
            :meth:`save` returns once the checkpoint is on disk.
            :meth:`restore` also waits for another Checkpointer of this
            process writing into the same directory. The
            snapshot needs as much memory again as the checkpoint, on rank 0,
            kept for the next save.

    Attributes:
        step: Training steps done (restored by :meth:`restore`, counted by
            the callback, set by :meth:`save`).
        epoch: The epoch to continue with after :meth:`restore` (the
            sampler's epoch when there is a sampler; a restored epoch whose
            data is used up becomes the next one).
        extra: The user extras.
        restored: Whether :meth:`restore` ran.
        last_path: Folder of the last checkpoint saved or restored (rank 0;
            with ``background=True`` its write may still be running:
            :meth:`wait`).

    Example:
        >>> sampler = hvdkit.data.ShardSampler(len(x), shuffle=True, seed=1)
        >>> ckpt = hvdkit.Checkpointer("ckpt", model=model, sampler=sampler, every_steps=100)
        >>> ckpt.restore()                       # 0 on a fresh start
        >>> for epoch in range(sampler.epoch, EPOCHS):
        ...     sampler.set_epoch(epoch)
        ...     model.fit(sampler.dataset((x, y)).batch(32), initial_epoch=epoch,
        ...               epochs=epoch + 1,
        ...               callbacks=[hvdkit.data.ShardPositionCallback(sampler, 32),
        ...                          ckpt.callback()])
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer | None = None,
        sampler: ShardSampler | None = None,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        keep: int = 3,
        extra: dict | None = None,
        preemption: bool = True,
        background: bool = True,
    ):
        if directory is not None and not isinstance(directory, (str, os.PathLike)):
            raise ConfigurationError(
                f"Checkpointer: directory={directory!r} is not a path; pass the folder "
                "to keep checkpoints in (or None to keep the last save in memory only)."
            )
        if not isinstance(model, keras.Model):
            raise ConfigurationError(
                f"Checkpointer: model={model!r} is not a keras.Model; pass the model trained."
            )
        if sampler is not None and not isinstance(sampler, ShardSampler):
            raise ConfigurationError(
                f"Checkpointer: sampler={sampler!r} is not an hvdkit.data.ShardSampler; "
                "pass the sampler whose dataset is trained on, or None."
            )
        schedule = "must be a positive number, or None for no schedule of that kind."
        if every_steps is not None:
            every_steps = check_int(
                "every_steps",
                every_steps,
                minimum=1,
                message=f"Checkpointer: every_steps={every_steps!r} {schedule}",
            )
        if every_seconds is not None and (not is_number(every_seconds) or every_seconds <= 0):
            raise ConfigurationError(f"Checkpointer: every_seconds={every_seconds!r} {schedule}")
        keep = check_int(
            "keep",
            keep,
            minimum=1,
            message=f"Checkpointer: keep={keep!r} must be an int >= 1 (checkpoints kept on disk).",
        )
        extra = {} if extra is None else extra
        self._check_extra(extra)
        self.directory = None if directory is None else Path(directory)
        self.model = model
        self._optimizer = optimizer
        self.sampler = sampler
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.keep = keep
        self.extra = extra
        self.step = 0
        self.epoch = 0
        self.last_path: Path | None = None
        self._last_save_time = time.monotonic()
        self._next_check = 1  # step of the next every_seconds decision
        self._check_time = time.monotonic()
        self._check_step = 0
        self._scheduled_step = 0  # last step the schedule looked at
        self._preemption_wanted = bool(preemption)
        self._preemption = None  # a preemption.Watch, installed by restore()
        self._listeners: list[Callable[[str, Checkpointer], None]] = []  # add_listener()
        self.restored = False  # restore() ran (hvdkit.elastic.run restores only if not)
        if not isinstance(background, bool):
            raise ConfigurationError(
                f"Checkpointer: background={background!r} must be True (write in a thread) "
                "or False (save() returns once the checkpoint is on disk)."
            )
        self.background = background
        self._writer: threading.Thread | None = None  # rank 0's write in progress
        self._write_error: tuple[Path, BaseException] | None = None
        self._buffers: list = []  # rank 0: the background snapshot's arrays, reused

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.directory and str(self.directory)!r}, "
            f"step={self.step}, epoch={self.epoch}, "
            f"every_steps={self.every_steps}, every_seconds={self.every_seconds}, "
            f"keep={self.keep})"
        )

    # ------------------------------------------------------------ helpers
    @staticmethod
    def _check_extra(extra: Any) -> None:
        try:
            ok = isinstance(extra, dict) and json.loads(json.dumps(extra)) is not None
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ConfigurationError(
                f"Checkpointer: extra={extra!r} is not a JSON-serialisable dict; keep only "
                "str keys and numbers, strings, lists and dicts in it."
            )

    @property
    def optimizer(self):
        """The optimizer whose state is saved (``None`` if there is none)."""
        if self._optimizer is not None:
            return self._optimizer
        return getattr(self.model, "optimizer", None)

    def _variables(self) -> tuple[list, list]:
        """``(model variables, optimizer variables)``, building the optimizer if needed."""
        if not self.model.built or not self.model.variables:
            raise ConfigurationError(
                "Checkpointer: the model has no variables yet; build it first "
                "(start it with keras.Input(...), or call model.build(input_shape))."
            )
        opt = self.optimizer
        if opt is None:
            return list(self.model.variables), []
        if not opt.built:
            opt.build(self.model.trainable_variables)
        return list(self.model.variables), list(opt.variables)

    def _check_directory(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".hvdkit-write-test-{os.getpid()}"
            files.write_file(probe, b"ok")
            probe.unlink()
        except OSError as e:
            raise ConfigurationError(
                f"checkpoint directory {str(self.directory)!r} is not writable "
                f"({e.strerror or e}); pass a directory this process can create and write "
                "(every rank passes the same path; only rank 0 writes)."
            ) from e

    # ------------------------------------------------------------ restore
    def _find_on_root(self, variables: list) -> tuple[Path, dict, list, dict] | None:
        self._check_directory()
        found, torn = files.scan(self.directory)
        for path, why in torn:
            warnings.warn(
                f"skipping torn checkpoint {path}: {why}; the next save removes it.",
                CheckpointWarning,
                stacklevel=3,
            )
        for _, folder in found:
            manifest = files.read_manifest(folder)
            payload, problem = files.read_payload(folder, manifest)
            if problem is not None:
                aside = folder.with_name(f"corrupt-{folder.name}-{int(time.time())}")
                folder.rename(aside)
                warnings.warn(
                    f"skipping corrupt checkpoint {folder}: {problem}; moved it to {aside} "
                    "and trying the one before.",
                    CheckpointWarning,
                    stacklevel=3,
                )
                continue
            self._check_matches(folder, manifest, variables)
            state = json.loads(payload[files.STATE])
            raw = payload[files.ARRAYS]
            arrays = [
                np.frombuffer(
                    raw,
                    dtype=_numpy_dtype(e["dtype"], var),
                    count=int(np.prod(e["shape"])),
                    offset=e["offset"],
                ).reshape(e["shape"])
                for e, var in zip(manifest["variables"], variables, strict=True)
            ]
            return folder, manifest, arrays, state
        return None

    def _check_matches(self, folder: Path, manifest: dict, variables: list) -> None:
        saved = manifest["variables"]
        here = [
            {
                "name": getattr(v, "path", v.name),
                "shape": list(v.shape),
                "dtype": _dtype_name(v),
            }
            for v in variables
        ]
        diffs = []
        if len(saved) != len(here):
            groups = {g: sum(e["group"] == g for e in saved) for g in ("model", "optimizer")}
            diffs.append(
                f"it holds {groups['model']} model and {groups['optimizer']} optimizer "
                f"variables, this model and optimizer have {len(self.model.variables)} and "
                f"{len(here) - len(self.model.variables)}"
            )
        for i, (s, h) in enumerate(zip(saved, here, strict=False)):
            if s["shape"] != h["shape"] or s["dtype"] != h["dtype"]:
                diffs.append(
                    f"variable {i} {s['name']!r} is {s['dtype']}{s['shape']} there, "
                    f"{h['name']!r} is {h['dtype']}{h['shape']} here"
                )
        if diffs:
            raise ConfigurationError(
                f"checkpoint {folder / files.MANIFEST} was written for another model: "
                f"{'; '.join(diffs[:3])}{' ...' if len(diffs) > 3 else ''}. Point the "
                "Checkpointer at another directory for this model, or move that folder away "
                "to start afresh."
            )

    def restore(self) -> int:
        """Load the newest complete checkpoint on rank 0 and broadcast it; call on every rank.

        Torn checkpoints (an unfinished write) and corrupt ones (a file that
        fails its checksum) are skipped with a :class:`CheckpointWarning`
        naming them; a corrupt one is moved aside to ``corrupt-ckpt-...``.
        Without a checkpoint, rank 0's initial variables are broadcast.
        Afterwards every rank has the same model and optimizer variables,
        sampler position (re-sharded if the number of ranks changed), random
        state, ``epoch``, ``step`` and ``extra``.

        Returns:
            The step the checkpoint was saved at; 0 on a fresh start.

        Raises:
            ConfigurationError: the directory is not writable, the model is
                not built, or the checkpoint was written for another model
                (variable count or shapes differ); the message names the file.
            DataFormatError: a checkpoint's manifest is unreadable or fails
                its checksum (not something an interrupted write leaves).
            ShardingError: the saved sampler state does not fit ``sampler``.

        Every rank raises the same error; none is left waiting. In an elastic
        job, a peer lost during the broadcast (a newcomer's first restore meets
        the survivors' roll back) is one more regroup: the rank meets the next
        world (:func:`hvdkit.runtime.rejoin`) and restores there.
        """
        while True:
            try:
                return self._restore_once()
            except Exception as exc:
                if not _meeting.enabled() or not _meeting.peer_lost(exc):
                    raise
                print(
                    f"hvdkit: rank {runtime.rank()} of {runtime.size()}: a peer was lost during "
                    f"the restore ({type(exc).__name__}); it meets the next world",
                    file=sys.stderr,
                    flush=True,
                )
            runtime.rejoin()
            if self.sampler is not None:  # the new world's shards, as a roll back takes them
                self.sampler.reshard(runtime.size(), runtime.rank())

    def _restore_once(self) -> int:
        _phases.enter("restore")
        model_vars, opt_vars = self._variables()
        variables = model_vars + opt_vars
        root, multi = runtime.rank() == 0, runtime.size() > 1
        failure = None
        if root:
            try:
                self.wait()
                # another Checkpointer of this process may still write here
                other = self.directory and _writing.get(self.directory.resolve())
                if other is not None:
                    other.join()
            except Exception as e:  # every rank must learn of it, or the others wait
                failure = e
        self._watch_steps()
        header: dict = {"ok": True, "state": None}
        if failure is not None:
            header = {"ok": False, "type": "HvdkitError", "message": f"on rank 0: {failure}"}
        elif root:
            try:
                found = None if self.directory is None else self._find_on_root(variables)
                if found is not None:
                    folder, _, arrays, state = found
                    for var, value in zip(variables, arrays, strict=True):
                        var.assign(value)
                    header = {"ok": True, "state": state, "path": str(folder)}
            except Exception as e:  # every rank must learn of it, or the others wait
                failure = e
                kind = type(e).__name__ if isinstance(e, HvdkitError) else "HvdkitError"
                header = {"ok": False, "type": kind, "message": f"on rank 0: {e}"}
        if multi:
            header = collectives.broadcast_object(header, 0)
        if not header["ok"]:
            if failure is not None:
                raise failure
            raise getattr(errors, header["type"])(header["message"])
        if multi:
            collectives.broadcast_variables(variables, 0)
        state = header["state"]
        if state is None:
            self.step, self.epoch = 0, self.sampler.epoch if self.sampler else 0
        else:
            if header.get("path"):
                self.last_path = Path(header["path"])
            self.load_state_dict(state)
        self.restored = True
        self._tell("restore")
        return self.step

    def _watch_steps(self) -> None:
        """Install what decides with the other ranks at step boundaries (preemption, growth)."""
        if self._preemption_wanted:
            self._preemption = preemption.watch()
        elif _meeting.enabled():  # the step exchange without a SIGTERM handler
            self._preemption = preemption.Watch(config.preempt_grace())
        if self._preemption is not None and _meeting.enabled():
            self._preemption.join_waiting = _meeting.join_waiting

    # ------------------------------------------------------------ state, for hvdkit.elastic
    def variables(self) -> list:
        """The model's variables, then the optimizer's (built if it is not yet): what is saved.

        Raises:
            ConfigurationError: the model is not built.
        """
        model_vars, opt_vars = self._variables()
        return model_vars + opt_vars

    def state_dict(self) -> dict:
        """Step, epoch, extra, random state and sampler position as they stand (no variables).

        A JSON-able dict; :meth:`load_state_dict` takes it back.
        """
        return {
            "step": self.step,
            "epoch": self.epoch,
            "sampler": None if self.sampler is None else self.sampler.state_dict(),
            "rng": _rng_state(),
            "extra": json.loads(json.dumps(self.extra)),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take step, epoch, extra, random state and sampler position from ``state``.

        ``state`` is what :meth:`state_dict` returned or a checkpoint held. The
        sampler's position is re-sharded if its ``num_shards`` changed since,
        and the save schedule counts from the state's step.
        """
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.extra.clear()
        self.extra.update(state["extra"])
        _set_rng_state(state["rng"])
        if self.sampler is not None and state["sampler"] is not None:
            self._restore_sampler(state["sampler"])
        self._scheduled_step = self._check_step = self.step
        self._next_check = self.step + 1
        self._last_save_time = self._check_time = time.monotonic()

    def add_listener(self, listener: Callable[[str, Checkpointer], None]) -> None:
        """Call ``listener(event, self)`` on this rank after each restore and save.

        ``event`` is ``"restore"`` (every rank holds the restored state) or
        ``"save"`` (the state as saved; rank 0 may still be writing it). Every
        rank calls them at the same steps: :mod:`hvdkit.elastic` keeps each
        such state in memory, its commits.
        """
        self._listeners.append(listener)

    def _tell(self, event: str) -> None:
        for listener in self._listeners:
            listener(event, self)

    def reschedule(self) -> None:
        """Decide with the other ranks again at the next step (preemption, growth).

        Call it on every rank alike, e.g. in a new world (:mod:`hvdkit.elastic`).
        """
        if self._preemption is not None:
            self._preemption.restart()

    def _regroup(self, step: int) -> NoReturn:
        """Every rank: leave for the bigger world after ``step`` (a worker waits to join)."""
        self.step = int(step)
        raise preemption.Regroup(self.step)

    def _restore_sampler(self, saved: dict) -> None:
        s = self.sampler
        s.load_state_dict(saved)
        # Decided from the saved state (the same on every rank): is anything
        # left of this epoch for rank 0, whose shard is never shorter?
        same = saved["num_shards"] == s.num_shards
        start = saved.get("start", 0) if same else saved.get("cursor", 0)
        left = shard_length(s.num_samples, s.num_shards, 0, s.mode, start)
        if same:
            left -= saved["position"]
        if left <= 0:
            s.set_epoch(s.epoch + 1)
        self.epoch = s.epoch

    # ------------------------------------------------------------ save
    def save(self, step: int) -> Path | None:
        """Write a checkpoint of the state after ``step`` training steps (rank 0 only).

        Call it on every rank at the same step (other ranks only record the
        step; nothing is communicated). The sampler's position is saved as it
        stands, so advance it for the step's batch first.

        Returns:
            The checkpoint's folder on rank 0, ``None`` on other ranks.

        Raises:
            ConfigurationError: ``step`` is not an int >= 0, the directory is not
                writable, or it already holds a checkpoint newer than ``step``
                (call :meth:`restore` first, or use another directory).
        """
        step = check_int(
            "step",
            step,
            minimum=0,
            message=f"Checkpointer.save: step={step!r} must be an int >= 0 (training steps done).",
        )
        self.step = step
        self._last_save_time = time.monotonic()
        if self.sampler is not None:
            self.epoch = self.sampler.epoch
        self._tell("save")
        _phases.enter("save")
        if runtime.rank() != 0 or self.directory is None:
            return None
        self._check_extra(self.extra)
        self.wait()  # one write at a time; a failed one is raised here
        self._check_directory()
        found, torn = files.scan(self.directory)
        newer = [p.name for s, p in found if s > step]
        if newer:
            raise ConfigurationError(
                f"Checkpointer.save({step}): {self.directory} already holds newer "
                f"checkpoints {newer}; call restore() before training to continue from them, "
                "or use a new directory for a new run."
            )
        for path, _ in torn:
            shutil.rmtree(path, ignore_errors=True)
        model_vars, opt_vars = self._variables()
        named = [("model", v) for v in model_vars] + [("optimizer", v) for v in opt_vars]
        state = {**self.state_dict(), "world_size": runtime.size(), "saved_at": time.time()}

        def entry(group, v):
            return {"group": group, "name": getattr(v, "path", v.name), "dtype": _dtype_name(v)}

        folder = files.final_folder(self.directory, step)
        self.last_path = folder
        if not self.background:
            arrays = ((entry(group, v), v.numpy) for group, v in named)
            self._write(step, arrays, state)
            return folder
        # The snapshot: training changes the variables as soon as we return. It goes
        # into buffers kept from the last save (the previous write is finished).
        buffers = self._buffers + [None] * (len(named) - len(self._buffers))
        self._buffers = [
            _compat.copy_variable(v, out) for (_, v), out in zip(named, buffers, strict=False)
        ]
        arrays = (
            (entry(group, v), (lambda a=a: a))
            for (group, v), a in zip(named, self._buffers, strict=True)
        )
        self._writer = threading.Thread(
            target=self._write_in_background,
            args=(step, arrays, state),
            name=f"hvdkit-checkpoint-{step}",
            daemon=False,  # the interpreter waits for it at exit: the last save is kept
        )
        self._writer.start()
        _writing[self.directory.resolve()] = self._writer
        return folder

    def _write(self, step: int, arrays, state: dict) -> None:
        """Write, fsync and rename one checkpoint, then drop the oldest beyond ``keep``."""
        files.write(self.directory, step, arrays, state, _write_hook)
        found, _ = files.scan(self.directory)
        for _, old in found[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def _write_in_background(self, step: int, arrays, state: dict) -> None:
        try:
            self._write(step, arrays, state)
        except BaseException as e:  # raised on the training thread at the next wait()
            self._write_error = (files.final_folder(self.directory, step), e)

    def wait(self) -> None:
        """Block until rank 0's background write (if any) is on disk; a no-op elsewhere.

        Raises:
            HvdkitError: the write failed; names the checkpoint and the cause
                (the previous checkpoints are intact).

        Example:
            >>> ckpt.save(step)
            >>> ckpt.wait()          # e.g. before copying ckpt.last_path elsewhere
        """
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        if self._write_error is not None:
            folder, cause = self._write_error
            self._write_error = None
            raise HvdkitError(
                f"writing checkpoint {folder.name} in the background failed: "
                f"{type(cause).__name__}: {cause}. The earlier checkpoints are intact; check "
                f"that {self.directory} is writable and has space."
            ) from cause

    # ------------------------------------------------------------ schedule
    def due(self, step: int) -> bool:
        """Whether the schedule saves after ``step``; every rank must call it at the same steps.

        ``every_steps``: ``step`` reached a multiple of it since the last
        call. ``every_seconds``: rank 0's clock decides, at steps chosen so
        that it decides about ten times per interval, and broadcasts the
        decision (a collective at those steps only).
        """
        step = int(step)
        due = False
        if self.every_steps is not None:
            due = step // self.every_steps > self._scheduled_step // self.every_steps
        self._scheduled_step = step
        if self.every_seconds is not None and step >= self._next_check:
            decision = None
            if runtime.rank() == 0:
                now = time.monotonic()
                rate = (step - self._check_step) / max(now - self._check_time, 1e-9)
                ahead = max(1, int(rate * self.every_seconds / 10))
                decision = (now - self._last_save_time >= self.every_seconds, step + ahead)
                self._check_time, self._check_step = now, step
            if runtime.size() > 1:
                decision = collectives.broadcast_object(decision, 0)
            timed, self._next_check = decision
            due = due or timed
        return due

    def maybe_save(self, step: int) -> bool:
        """Save if :meth:`due`; for custom loops, called on every rank after every step or sink.

        Example:
            >>> for x, y in sampler.dataset(data).batch(32):
            ...     train_step(x, y)
            ...     sampler.advance(len(y)); step += 1
            ...     ckpt.maybe_save(step)
        """
        if _phases.ACTIVE:  # fault-injection tests only: no call otherwise
            _phases.enter("step")
        saved = self.due(step)
        if saved:
            self.save(step)
        else:
            self.step = int(step)
        if self._preemption is not None and self._preemption.decide(step):
            self._stop_for_preemption(int(step), saved)
        if self._preemption is not None and self._preemption.regroup:
            self._regroup(int(step))
        return saved

    def _stop_for_preemption(self, step: int, saved: bool) -> None:
        """Every rank: make sure ``step`` is saved and on disk, then raise Preempted."""
        outcome = {"ok": True}
        if runtime.rank() == 0:
            try:
                if not saved:
                    self.save(step)
                self.wait()  # on disk before anyone leaves
            except Exception as e:  # every rank must learn of it, or the others wait
                outcome = {"ok": False, "message": f"{type(e).__name__}: {e}"}
                failure = e
        else:
            self.save(step)  # records the step; rank 0 writes
        if runtime.size() > 1:  # nobody leaves before rank 0's checkpoint is written
            outcome = collectives.broadcast_object(outcome, 0)
        if not outcome["ok"]:
            if runtime.rank() == 0:
                raise failure
            raise HvdkitError(
                f"preempted after step {step}, but rank 0 could not save it: {outcome['message']}"
            )
        self._preemption.stopped(step)
        raise preemption.Preempted(step, self.last_path if runtime.rank() == 0 else None)

    def callback(self, batch_size: int | None = None) -> keras.callbacks.Callback:
        """A Keras callback that counts steps and saves on the schedule during ``fit``.

        It also works with :func:`hvdkit.sink.train`, where it runs once per
        sink, so checkpoints fall on sink boundaries. The sampler's position
        is saved as it stands after the step: list
        ``hvdkit.data.ShardPositionCallback(sampler, B)`` before this
        callback, or pass ``batch_size=B`` to have this callback advance the
        sampler itself (then leave ShardPositionCallback out).

        Raises (during fit):
            ConfigurationError: there is a sampler, no ``batch_size``, and the
                sampler did not advance in the first step (no
                ShardPositionCallback before this callback).
        """
        position = None
        if batch_size is not None:
            if self.sampler is None:
                raise ConfigurationError(
                    "Checkpointer.callback: batch_size is for advancing the sampler, but "
                    "this Checkpointer has none; drop batch_size or pass sampler=."
                )
            position = ShardPositionCallback(self.sampler, batch_size)
        return _CheckpointCallback(self, position)


class _CheckpointCallback(keras.callbacks.Callback):
    def __init__(self, ckpt: Checkpointer, position: ShardPositionCallback | None):
        super().__init__()
        self.ckpt = ckpt
        self.position = position
        self._batch = -1
        self._before = None

    def set_model(self, model):
        super().set_model(model)
        if self.position is not None:
            self.position.set_model(model)

    def on_train_begin(self, logs=None):
        if self.position is not None:
            self.position.on_train_begin(logs)
        s = self.ckpt.sampler
        self._before = None if s is None or self.position is not None else (s.epoch, s.position)

    def on_epoch_begin(self, epoch, logs=None):
        if self.position is not None:
            self.position.on_epoch_begin(epoch, logs)
        self._batch = -1
        if self.ckpt.sampler is None:
            self.ckpt.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.position is not None:
            self.position.on_train_batch_end(batch, logs)
        s = self.ckpt.sampler
        if self._before is not None:
            if (s.epoch, s.position) == self._before:
                raise ConfigurationError(
                    "Checkpointer.callback(): the sampler did not advance in the first step, "
                    "so its saved position would be stale. List "
                    "hvdkit.data.ShardPositionCallback(sampler, batch_size) before "
                    "ckpt.callback() in callbacks=, or use ckpt.callback(batch_size=...)."
                )
            self._before = None
        # Keras passes the index of the last batch of each step (one call per
        # steps_per_execution or per sink), counted from 0 in every epoch.
        step = self.ckpt.step + batch - self._batch
        self._batch = batch
        self.ckpt.maybe_save(step)
