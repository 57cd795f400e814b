"""hvdkit.fault._failed_attempt: a failed attempt's tf.data iterators are kept, the rest let go."""

from __future__ import annotations

import gc
import types
import weakref

import keras
import numpy as np
import tensorflow as tf

from hvdkit.fault import _failed_attempt


class Payload:
    """Stands for what a failed step leaves in its frames (tensors, gradients)."""


def _fail(refs: dict):
    """A training attempt that dies holding two iterators and a payload."""
    ds = tf.data.Dataset.range(100).map(lambda x: x * 2).prefetch(2)
    direct = iter(ds)
    next(direct)
    epoch = types.SimpleNamespace(current=iter(ds))
    payload = Payload()
    refs.update(direct=weakref.ref(direct), nested=weakref.ref(epoch.current))
    refs["payload"] = weakref.ref(payload)
    raise RuntimeError("peer lost")


def _live_iterators() -> set[int]:
    return {id(o) for o in gc.get_objects() if isinstance(o, tf.data.Iterator)}


def test_the_iterators_are_kept_and_everything_else_is_let_go():
    refs: dict = {}
    try:
        _fail(refs)
    except RuntimeError as exc:
        caught = exc  # the traceback outlives the recovery, as it does in a reference cycle
    before = len(_failed_attempt.kept())
    assert _failed_attempt.let_go(caught) >= 2
    assert refs["payload"]() is None  # its frames were cleared: freed at once, no collection
    assert caught.__traceback__ is not None  # and it still prints
    kept = {id(it): it for it in _failed_attempt.kept()[before:]}
    assert id(refs["direct"]()) in kept and id(refs["nested"]()) in kept
    assert int(next(refs["direct"]())) == 2  # a working iterator still: not destroyed


class _LosePeerAtBatch3(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            raise RuntimeError("peer lost")


def test_fits_iterator_is_kept_though_fits_traceback_leaves_fit_out():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    x, y = np.ones((64, 4), "float32"), np.ones((64, 1), "float32")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    before = _live_iterators()
    try:
        model.fit(ds, epochs=1, verbose=0, callbacks=[_LosePeerAtBatch3()])
    except RuntimeError as exc:
        caught = exc
    names = []
    tb = caught.__traceback__
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert "fit" not in names, names  # Keras's filtered traceback: fit's frame is not in it
    count = len(_failed_attempt.kept())
    _failed_attempt.let_go(caught)
    new = [it for it in _failed_attempt.kept()[count:] if id(it) not in before]
    assert len(new) == 1, new  # fit's one epoch iterator


def test_an_iterator_is_kept_once():
    _failed_attempt.let_go(RuntimeError("a first failure"))  # keeps whatever is alive now
    try:
        raise ValueError([1, 2, {"a": (3,)}])
    except ValueError as exc:
        assert _failed_attempt.let_go(exc) == 0  # nothing new since


def test_a_kept_iterator_is_never_freed_not_even_when_the_list_goes():
    """At exit Python clears the modules, _KEPT too: a kept iterator must outlive that, since
    freeing it waits for its autotuning thread's period (ranks stood 95 s at exit)."""
    refs: dict = {}
    try:
        _fail(refs)
    except RuntimeError as exc:
        caught = exc
    _failed_attempt.let_go(caught)
    held = list(_failed_attempt._KEPT)
    _failed_attempt._KEPT.clear()  # as the interpreter's end clears the module
    try:
        del held
        gc.collect()
        assert refs["direct"]() is not None and refs["nested"]() is not None
    finally:
        _failed_attempt._KEPT.extend(it for it in (refs["direct"](), refs["nested"]()) if it)
