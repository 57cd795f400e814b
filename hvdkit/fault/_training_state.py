"""What a checkpoint holds besides the variables: extras, random state, the sampler's place.

:meth:`hvdkit.Checkpointer.state_dict` gathers them in a JSON-able dict with
the step and the epoch; :meth:`~hvdkit.Checkpointer.load_state_dict` puts
them back. The random state is the host's: Python's ``random``, NumPy's
global generator and Keras's global ``SeedGenerator``.

Example:
    >>> saved = rng_state(); random.random(); set_rng_state(saved)   # as before
"""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np

from .. import _compat
from ..data.sampler import ShardSampler
from ..data.sharding import shard_length
from ..errors import ConfigurationError

__all__ = ["check_extra", "resume_sampler", "rng_state", "set_rng_state"]


def check_extra(extra: Any) -> None:
    """Raise :class:`ConfigurationError` unless ``extra`` is a JSON-serialisable dict."""
    try:
        ok = isinstance(extra, dict) and json.loads(json.dumps(extra)) is not None
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ConfigurationError(
            f"Checkpointer: extra={extra!r} is not a JSON-serialisable dict; keep only "
            "str keys and numbers, strings, lists and dicts in it."
        )


def rng_state() -> dict:
    """The host's random state as a JSON-able dict."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    seed_state = _compat.keras_global_seed_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "keras_global_seed": None if seed_state is None else np.asarray(seed_state).tolist(),
    }


def set_rng_state(state: dict) -> None:
    """Put back what :func:`rng_state` returned."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if state["keras_global_seed"] is not None:
        var = _compat.keras_global_seed_state(create=True)
        var.assign(np.asarray(state["keras_global_seed"], dtype=var.dtype))


def resume_sampler(sampler: ShardSampler, saved: dict) -> int:
    """Load ``saved`` into ``sampler``; the epoch to continue with.

    That is the saved epoch, or the next one when nothing of it is left:
    decided from the saved state (the same on every rank), by what is left
    for rank 0, whose shard is never shorter.

    Raises:
        ShardingError: ``saved`` does not fit ``sampler``.
    """
    sampler.load_state_dict(saved)
    same = saved["num_shards"] == sampler.num_shards
    start = saved.get("start", 0) if same else saved.get("cursor", 0)
    left = shard_length(sampler.num_samples, sampler.num_shards, 0, sampler.mode, start)
    if same:
        left -= saved["position"]
    if left <= 0:
        sampler.set_epoch(sampler.epoch + 1)
    return sampler.epoch
