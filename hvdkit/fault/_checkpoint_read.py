"""Rank 0's search for the checkpoint to restore: the newest one complete, intact and of this model.

:func:`newest` walks ``directory``'s checkpoints newest first
(:mod:`hvdkit.fault._checkpoint_files` reads them): a torn one (an unfinished
write) is skipped with a :class:`CheckpointWarning`, a corrupt one (a file
that fails its checksum) is moved aside to ``corrupt-ckpt-...`` with one, and
the first that reads is checked against the model's variables (count, shapes,
dtypes) before its arrays are returned.

Example:
    >>> folder, arrays, state = newest(Path("ckpt"), ckpt.variables(), len(model.variables))
"""

from __future__ import annotations

import json
import os
import time
import warnings
from pathlib import Path

import keras
import numpy as np

from ..errors import ConfigurationError
from . import _checkpoint_files as files

__all__ = ["CheckpointWarning", "check_writable", "dtype_name", "newest"]


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped on restore (torn or corrupt); the message names it."""


def dtype_name(variable) -> str:
    """The dtype's name a manifest records for ``variable`` (``"float32"``, ``"bfloat16"``)."""
    return keras.backend.standardize_dtype(variable.dtype)


def _numpy_dtype(name: str, variable) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:  # e.g. bfloat16, known to NumPy only through ml_dtypes' scalar type
        return np.asarray(variable.numpy()).dtype


def check_writable(directory: Path) -> None:
    """Create ``directory`` if needed and write a file into it.

    Raises:
        ConfigurationError: it cannot be created or written; names it.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".hvdkit-write-test-{os.getpid()}"
        files.write_file(probe, b"ok")
        probe.unlink()
    except OSError as e:
        raise ConfigurationError(
            f"checkpoint directory {str(directory)!r} is not writable "
            f"({e.strerror or e}); pass a directory this process can create and write "
            "(every rank passes the same path; only rank 0 writes)."
        ) from e


def newest(
    directory: Path, variables: list, model_variables: int
) -> tuple[Path, list[np.ndarray], dict] | None:
    """``(folder, arrays, state)`` of the newest checkpoint that reads; ``None`` if there is none.

    Args:
        directory: The checkpoints' folder (created if missing).
        variables: The model's variables, then the optimizer's: one array each.
        model_variables: How many of ``variables`` are the model's (for the message).

    Raises:
        ConfigurationError: the directory is not writable, or the newest
            intact checkpoint was written for another model; names the file.
        DataFormatError: a manifest is unreadable.
    """
    check_writable(directory)
    found, torn = files.scan(directory)
    for path, why in torn:
        warnings.warn(
            f"skipping torn checkpoint {path}: {why}; the next save removes it.",
            CheckpointWarning,
            stacklevel=2,
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
                stacklevel=2,
            )
            continue
        _check_fits(folder, manifest, variables, model_variables)
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
        return folder, arrays, state
    return None


def _check_fits(folder: Path, manifest: dict, variables: list, model_variables: int) -> None:
    saved = manifest["variables"]
    here = [
        {"name": getattr(v, "path", v.name), "shape": list(v.shape), "dtype": dtype_name(v)}
        for v in variables
    ]
    diffs = []
    if len(saved) != len(here):
        groups = {g: sum(e["group"] == g for e in saved) for g in ("model", "optimizer")}
        diffs.append(
            f"it holds {groups['model']} model and {groups['optimizer']} optimizer "
            f"variables, this model and optimizer have {model_variables} and "
            f"{len(here) - model_variables}"
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
