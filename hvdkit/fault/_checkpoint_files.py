"""The on-disk format of hvdkit checkpoints: atomic folders with checksummed files.

``directory`` holds one folder per checkpoint::

    ckpt-0000000120/
        arrays.bin      every variable's bytes, back to back (C order)
        state.json      step, epoch, sampler state, random state, extras
        manifest.json   format, step, size and SHA-256 of the two files,
                        name/shape/dtype/offset of every variable, and the
                        SHA-256 of the manifest itself

:func:`write` puts it under a temporary name (``.tmp-ckpt-<step>-<pid>``),
fsyncs every file and the folder, renames it to ``ckpt-<step>`` and fsyncs
``directory``: a folder named ``ckpt-<step>`` with a manifest is complete. A
process killed while writing leaves only a ``.tmp-ckpt-...`` folder. No
TensorFlow here: the values arrive as NumPy arrays.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np

from ..errors import DataFormatError

FORMAT = "hvdkit-checkpoint"
FORMAT_VERSION = 1
MANIFEST, ARRAYS, STATE = "manifest.json", "arrays.bin", "state.json"
_NAME = re.compile(r"ckpt-(\d{10})")
_TMP_PREFIX = ".tmp-ckpt-"
_CHUNK = 1 << 24  # bytes written per call


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def scan(directory: Path) -> tuple[list[tuple[int, Path]], list[tuple[Path, str]]]:
    """``(complete-looking checkpoints newest first, [(torn folder, why)])``."""
    found, torn = [], []
    for p in sorted(directory.iterdir()):
        if p.name.startswith(_TMP_PREFIX):
            torn.append((p, "an unfinished write (its writer stopped before renaming it)"))
            continue
        m = _NAME.fullmatch(p.name)
        if m and p.is_dir():
            if (p / MANIFEST).is_file():
                found.append((int(m.group(1)), p))
            else:
                torn.append((p, f"it has no {MANIFEST}"))
    found.sort(reverse=True)
    return found, torn


def read_manifest(folder: Path) -> dict:
    """The manifest of ``folder``; DataFormatError if it is not a valid hvdkit manifest."""
    path = folder / MANIFEST
    fix = (
        f"Move or delete the folder {folder} to resume from the checkpoint before it, "
        "or restore the file from a backup."
    )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataFormatError(f"checkpoint manifest {path} is unreadable ({e}). {fix}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataFormatError(
            f"{path} is not an hvdkit checkpoint manifest (no format={FORMAT!r}). {fix}"
        )
    if manifest.get("version") != FORMAT_VERSION:
        raise DataFormatError(
            f"{path} has checkpoint format version {manifest.get('version')!r}; this hvdkit "
            f"reads version {FORMAT_VERSION}. {fix}"
        )
    if manifest.get("manifest_sha256") != manifest_digest(manifest):
        raise DataFormatError(f"checkpoint manifest {path} fails its own checksum. {fix}")
    return manifest


def read_payload(folder: Path, manifest: dict) -> tuple[dict[str, bytes], str | None]:
    """``({file name: bytes}, None)``, or ``({}, why the files do not match the manifest)``."""
    payload = {}
    for name, meta in manifest["files"].items():
        try:
            data = (folder / name).read_bytes()
        except OSError as e:
            return {}, f"{name} cannot be read ({e.strerror or e})"
        if len(data) != meta["bytes"]:
            return {}, f"{name} has {len(data)} bytes, the manifest says {meta['bytes']}"
        if hashlib.sha256(data).hexdigest() != meta["sha256"]:
            return {}, f"{name} fails its SHA-256 checksum"
        payload[name] = data
    return payload, None


def write(
    directory: Path,
    step: int,
    arrays: Iterable[tuple[dict, Callable[[], np.ndarray]]],
    state: dict,
    hook: Callable[[str, int], None] | None = None,
) -> Path:
    """Write checkpoint ``step`` atomically into ``directory``; return its folder.

    Args:
        directory: The checkpoint directory (exists, writable).
        step: The step number; the folder is ``ckpt-<step, 10 digits>``.
        arrays: ``(entry, value)`` pairs: ``entry`` is the variable's manifest
            record (``group``, ``name``, ``dtype``; ``shape``, ``offset`` and
            ``nbytes`` are added), ``value()`` returns its array. Fetched one
            at a time, so one variable's copy is in memory at once.
        state: JSON-able dict written as ``state.json`` (``epoch`` is also
            copied into the manifest).
        hook: Test hook, called as ``hook("arrays", step)`` once the first
            array is written (the tests kill the process there).
    """
    final = final_folder(directory, step)
    tmp = directory / f"{_TMP_PREFIX}{step:010d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    entries, offset, digest = [], 0, hashlib.sha256()
    with open(tmp / ARRAYS, "wb") as f:
        for i, (entry, fetch) in enumerate(arrays):
            value = np.asarray(fetch(), order="C")  # 0-d stays 0-d
            data = value.reshape(-1).view(np.uint8)
            for lo in range(0, data.size, _CHUNK):
                f.write(data[lo : lo + _CHUNK])
            digest.update(data)
            nbytes = int(value.nbytes)
            entries.append(
                {**entry, "shape": list(value.shape), "offset": offset, "nbytes": nbytes}
            )
            offset += nbytes
            if i == 0 and hook is not None:
                f.flush()
                hook("arrays", step)
        f.flush()
        os.fsync(f.fileno())
    state_bytes = json.dumps(state, sort_keys=True).encode()
    write_file(tmp / STATE, state_bytes)
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "step": step,
        "epoch": state.get("epoch"),
        "files": {
            ARRAYS: {"bytes": offset, "sha256": digest.hexdigest()},
            STATE: {"bytes": len(state_bytes), "sha256": hashlib.sha256(state_bytes).hexdigest()},
        },
        "variables": entries,
    }
    manifest["manifest_sha256"] = manifest_digest(manifest)
    write_file(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (a restart that redid it)
        old = directory / f"{_TMP_PREFIX}old-{step:010d}-{os.getpid()}"
        final.rename(old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(directory)
    return final


def final_folder(directory: Path, step: int) -> Path:
    """Where :func:`write` puts checkpoint ``step`` once it is complete."""
    return directory / f"ckpt-{step:010d}"


def is_temporary(path: Path) -> bool:
    """A folder left by an unfinished write."""
    return path.name.startswith(_TMP_PREFIX)
