"""Keras ``fit`` with Horovod's callbacks, written as a Horovod user writes it.

The calls are those of Horovod's ``examples/tensorflow2/tensorflow2_keras_mnist.py``
(its model, optimizer wrapper, callbacks, rank-0 checkpoint and logging); only
the import differs. Data is synthetic (no download here). Launch with
``horovodrun -np 2 python examples/horovod/keras_mnist.py``.
"""

import argparse
import os
import sys

import tensorflow as tf

import hvdkit as hvd  # hvdkit: was `import horovod.tensorflow.keras as hvd`

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _synthetic import load_data  # stands in for keras.datasets.mnist (no download here)


def main(epochs: int, steps: int, outdir: str, seed: int | None = None) -> None:
    hvd.init()
    if seed is not None:  # not in Horovod's example: lets a test repeat one run exactly
        tf.keras.utils.set_random_seed(seed)  # the same seed on every rank

    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (images, labels), (test_images, test_labels) = load_data(seed=hvd.rank())
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(64)

    model = tf.keras.Sequential(
        [
            tf.keras.Input((28, 28, 1)),
            tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )

    scaled_lr = 0.001 * hvd.size()
    opt = tf.optimizers.Adam(scaled_lr)
    opt = hvd.DistributedOptimizer(
        opt, backward_passes_per_step=1, average_aggregated_gradients=True
    )
    model.compile(
        loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"]
    )

    callbacks = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=2, verbose=1),
    ]
    if hvd.rank() == 0:
        callbacks.append(
            tf.keras.callbacks.ModelCheckpoint(os.path.join(outdir, "checkpoint-{epoch}.keras"))
        )
    verbose = 2 if hvd.rank() == 0 else 0

    history = model.fit(
        dataset,
        steps_per_epoch=steps // hvd.size(),
        callbacks=callbacks,
        epochs=epochs,
        verbose=verbose,
    )

    # Same weights on every rank, and a job-wide accuracy on held-out data.
    weights_sum = float(sum(tf.reduce_sum(tf.abs(w)) for w in model.weights))
    spread = hvd.allreduce([weights_sum], op=hvd.Max) - hvd.allreduce([weights_sum], op=hvd.Min)
    _, test_acc = model.evaluate(test_images[..., None] / 255.0, test_labels, verbose=0)
    test_acc = float(hvd.allreduce([test_acc])[0])
    if hvd.rank() == 0:
        losses = history.history["loss"]
        print(f"final loss {losses[-1]:.4f} first {losses[0]:.4f}")
        print(f"weights differ between ranks by {float(spread[0]):.3g}")
        print(f"held-out accuracy {test_acc:.3f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--steps", type=int, default=100, help="steps per epoch of the whole job")
    p.add_argument("--outdir", default=".")
    p.add_argument("--seed", type=int, default=None, help="seed Python, NumPy and TF")
    a = p.parse_args()
    main(a.epochs, a.steps, a.outdir, a.seed)
