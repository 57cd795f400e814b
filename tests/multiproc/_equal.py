"""What the 2-rank equivalence scripts compare: one process on the global batch, and the ranks.

rows = my_rows(64, global_batch=16, rank=r, size=n)   # rank r's half of every batch
assert_close(weights(model), weights(reference))      # against one process
assert_same_on_all_ranks(weights(model), "fit")       # bit-identical across ranks
"""

import numpy as np

import hvdkit as hvd


def my_rows(count: int, global_batch: int, rank: int, size: int) -> np.ndarray:
    """Row indices of ``rank``'s share of every global batch, in order."""
    part = global_batch // size
    return np.concatenate(
        [np.arange(b + rank * part, b + (rank + 1) * part) for b in range(0, count, global_batch)]
    )


def weights(model) -> list:
    return [w.numpy() for w in model.weights]


def assert_close(got, want, rtol=1e-5, atol=1e-6) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def assert_same_on_all_ranks(ws, label: str) -> None:
    flat = np.concatenate([np.asarray(w, np.float64).ravel() for w in ws])
    both = hvd.allgather(flat[None])
    if not np.array_equal(both[0], both[1]):
        raise AssertionError(
            f"{label}: weights differ across ranks, max |diff| {np.abs(both[0] - both[1]).max()}"
        )


def computed_once_across_ranks(tasks: dict) -> dict:
    """``{name: task()}`` on every rank, each task run on one rank only (the i-th on rank i % size).

    For single-process references, which every rank would otherwise compute alike:
    the ranks share the work and exchange the results (one ``allgather_object``).

        refs = computed_once_across_ranks({"sgd": lambda: fit_alone(sgd)})
    """
    n, r = hvd.size(), hvd.rank()
    mine = {name: task() for i, (name, task) in enumerate(tasks.items()) if i % n == r}
    merged = {}
    for part in hvd.allgather_object(mine):
        merged.update(part)
    return {name: merged[name] for name in tasks}


# A small classification problem: 64 rows of 8 features, 3 classes, a 2-layer model.
def small_problem():
    """``(X, Y, loss, make_model)``: the same data and initial weights on every call."""
    import keras

    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x @ rng.normal(size=(8, 3)) > 0).argmax(1).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def make_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
        )

    return x, y, loss, make_model


def assert_fit_matches_one_process(wrap, label: str) -> None:
    """``fit`` with ``wrap(SGD(0.1))`` on this rank's rows of :func:`small_problem` (global
    batch 16, 2 epochs) ends with one process's weights, the same on every rank."""
    import keras

    x, y, loss, make_model = small_problem()
    want = make_model()
    want.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    want.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    got = make_model()
    got.compile(optimizer=wrap(keras.optimizers.SGD(0.1)), loss=loss)
    mine = my_rows(len(x), 16, hvd.rank(), hvd.size())
    got.fit(x[mine], y[mine], batch_size=16 // hvd.size(), epochs=2, shuffle=False, verbose=0)
    assert_close(weights(got), weights(want), rtol=1e-4, atol=1e-5)
    assert_same_on_all_ranks(weights(got), label)
