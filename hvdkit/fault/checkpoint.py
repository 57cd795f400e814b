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
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import keras

from .. import _phases, errors, runtime
from .._validate import check_int
from ..data.sampler import ShardSampler
from ..errors import ConfigurationError, HvdkitError
from . import _checkpoint_files as files
from . import _state_broadcast
from ._background_write import BackgroundWriter
from ._checkpoint_callback import CheckpointCallback
from ._checkpoint_read import CheckpointWarning, check_writable, dtype_name, newest
from ._next_world import retry
from ._preemption_stop import PreemptionStop
from ._save_schedule import SaveSchedule
from ._training_state import check_extra, resume_sampler, rng_state, set_rng_state

__all__ = ["Checkpointer", "CheckpointWarning"]

# Test hook: called as _write_hook(stage, step) while rank 0 writes a
# checkpoint ("arrays": after the first variable's bytes are written). The
# fault-tolerance tests kill the process there to leave a torn checkpoint.
_write_hook = None


def _check_arguments(directory, model, sampler, keep, extra, background) -> None:
    """The Checkpointer's arguments other than the schedule's (:class:`SaveSchedule` checks those).

    Raises:
        ConfigurationError: one is of the wrong kind; names it and what to pass.
    """
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
    check_int(
        "keep",
        keep,
        minimum=1,
        message=f"Checkpointer: keep={keep!r} must be an int >= 1 (checkpoints kept on disk).",
    )
    check_extra({} if extra is None else extra)
    if not isinstance(background, bool):
        raise ConfigurationError(
            f"Checkpointer: background={background!r} must be True (write in a thread) "
            "or False (save() returns once the checkpoint is on disk)."
        )


def _schedule_setting(name: str) -> property:
    """``Checkpointer.<name>``: the save schedule's setting of that name, to read and to set."""
    return property(
        lambda self: getattr(self._schedule, name),
        lambda self, value: setattr(self._schedule, name, value),
        doc=f"The save schedule's ``{name}`` (``None``: none).",
    )


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
        _check_arguments(directory, model, sampler, keep, extra, background)
        self._schedule = SaveSchedule(every_steps, every_seconds)  # (checks both)
        self.directory = None if directory is None else Path(directory)
        self.model = model
        self._optimizer = optimizer
        self.sampler = sampler
        self.keep = int(keep)
        self.extra = {} if extra is None else extra
        self.step = 0
        self.epoch = 0
        self.last_path: Path | None = None
        self.restored = False  # restore() ran (hvdkit.elastic.run restores only if not)
        self.background = background
        self._writer = BackgroundWriter(self.directory)  # rank 0's writes
        self._stop = PreemptionStop(preemption)  # installed by restore()
        self._listeners: list[Callable[[str, Checkpointer], None]] = []  # add_listener()

    def __repr__(self) -> str:
        return (
            f"Checkpointer({self.directory and str(self.directory)!r}, "
            f"step={self.step}, epoch={self.epoch}, "
            f"every_steps={self.every_steps}, every_seconds={self.every_seconds}, "
            f"keep={self.keep})"
        )

    every_steps = _schedule_setting("every_steps")
    every_seconds = _schedule_setting("every_seconds")

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
                (variable count or shapes differ; the message names the file),
                or a rank's variables differ from rank 0's (the message names
                the first one and the rank).
            DataFormatError: a checkpoint's manifest is unreadable or fails
                its checksum (not something an interrupted write leaves).
            ShardingError: the saved sampler state does not fit ``sampler``.

        Every rank raises the same error; none is left waiting. The variables
        go in one broadcast per dtype (:mod:`hvdkit.fault._state_broadcast`). In an elastic
        job, a peer lost during the broadcast (a newcomer's first restore meets
        the survivors' roll back) is one more regroup: the rank meets the next
        world (:func:`hvdkit.runtime.rejoin`) and restores there.
        """
        return retry(lambda _move: self._restore_once(), where="the restore", sampler=self.sampler)

    def _restore_once(self) -> int:
        _phases.enter("restore")
        model_vars, opt_vars = self._variables()
        variables = model_vars + opt_vars
        multi = runtime.size() > 1
        self._stop.install()
        header, failure = {"ok": True, "state": None}, None
        if runtime.rank() == 0:
            header, failure = self._load_on_root(variables, len(model_vars))
        if multi:
            header = _state_broadcast.header(header, variables)
        if not header["ok"]:
            if failure is not None:
                raise failure
            raise getattr(errors, header["type"])(header["message"])
        if multi:
            _state_broadcast.variables(variables)
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

    def _load_on_root(self, variables: list, models: int) -> tuple[dict, Exception | None]:
        """Rank 0: the newest checkpoint into ``variables``; (what every rank gets, the failure).

        A failure goes out in the header, so every rank raises it and none waits.
        """
        try:
            self.wait()
            self._writer.wait_for_others()  # another Checkpointer of this process
        except Exception as e:
            return {"ok": False, "type": "HvdkitError", "message": f"on rank 0: {e}"}, e
        try:
            found = self.directory and newest(self.directory, variables, models)
            if not found:
                return {"ok": True, "state": None}, None
            folder, arrays, state = found
            for var, value in zip(variables, arrays, strict=True):
                var.assign(value)
        except Exception as e:
            kind = type(e).__name__ if isinstance(e, HvdkitError) else "HvdkitError"
            return {"ok": False, "type": kind, "message": f"on rank 0: {e}"}, e
        return {"ok": True, "state": state, "path": str(folder)}, None

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
            "rng": rng_state(),
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
        set_rng_state(state["rng"])
        if self.sampler is not None and state["sampler"] is not None:
            self.epoch = resume_sampler(self.sampler, state["sampler"])
        self._schedule.restart(self.step)

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
        self._stop.restart()

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
        self._schedule.saved()
        if self.sampler is not None:
            self.epoch = self.sampler.epoch
        self._tell("save")
        _phases.enter("save")
        if runtime.rank() != 0 or self.directory is None:
            return None
        check_extra(self.extra)
        self.wait()  # one write at a time; a failed one is raised here
        check_writable(self.directory)
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
        entries = [
            {"group": group, "name": getattr(v, "path", v.name), "dtype": dtype_name(v)}
            for group, v in named
        ]
        self.last_path = files.final_folder(self.directory, step)
        if not self.background:
            self._write(step, zip(entries, (v.numpy for _, v in named), strict=True), state)
            return self.last_path
        # training changes the variables as soon as we return: write a copy
        copies = self._writer.snapshot([v for _, v in named])
        arrays = ((e, (lambda a=a: a)) for e, a in zip(entries, copies, strict=True))
        self._writer.start(step, lambda: self._write(step, arrays, state))
        return self.last_path

    def _write(self, step: int, arrays, state: dict) -> None:
        """Write, fsync and rename one checkpoint, then drop the oldest beyond ``keep``."""
        files.write(self.directory, step, arrays, state, _write_hook)
        found, _ = files.scan(self.directory)
        for _, old in found[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)

    def wait(self) -> None:
        """Block until rank 0's background write (if any) is on disk; a no-op elsewhere.

        Raises:
            HvdkitError: the write failed; names the checkpoint and the cause
                (the previous checkpoints are intact).

        Example:
            >>> ckpt.save(step)
            >>> ckpt.wait()          # e.g. before copying ckpt.last_path elsewhere
        """
        self._writer.wait()

    # ------------------------------------------------------------ schedule
    def due(self, step: int) -> bool:
        """Whether the schedule saves after ``step``; every rank must call it at the same steps.

        ``every_seconds``: rank 0's clock decides about ten times per interval,
        and broadcasts the decision (a collective at those steps only).
        """
        return self._schedule.due(step)

    def maybe_save(self, step: int) -> bool:
        """Save if :meth:`due`; for custom loops, called on every rank after every step or sink.

        Example:
            >>> for x, y in sampler.dataset(data).batch(32):
            ...     train_step(x, y)
            ...     sampler.advance(len(y)); step += 1
            ...     ckpt.maybe_save(step)
        """
        if _phases.ACTIVE:  # fault-injection tests and phase logs only: no call otherwise
            _phases.enter("step")
        saved = self.due(step)
        if saved:
            self.save(step)
        else:
            self.step = int(step)
        self._stop.after_step(self, step, saved)
        return saved

    def callback(self, batch_size: int | None = None) -> keras.callbacks.Callback:
        """A Keras callback that counts steps and saves on the schedule during ``fit``.

        It also works with :func:`hvdkit.sink.train`, where it runs once per
        sink, so checkpoints fall on sink boundaries. The sampler's position
        is saved as it stands after the step: list
        ``hvdkit.data.ShardPositionCallback(sampler, B)`` before this
        callback, or pass ``batch_size=B`` to have this callback advance the
        sampler itself (then leave ShardPositionCallback out).

        Raises:
            ConfigurationError: ``batch_size`` without a sampler; during fit: there
                is a sampler, no ``batch_size``, and the sampler did not advance in
                the first step (no ShardPositionCallback before this callback).
        """
        return CheckpointCallback(self, batch_size)
