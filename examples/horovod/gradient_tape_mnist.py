"""A custom loop with ``DistributedGradientTape``, written as a Horovod user writes it.

The calls are those of Horovod's ``examples/tensorflow2/tensorflow2_mnist.py``
(a ``tf.function`` step that wraps the tape, broadcasts model and optimizer
variables after the first step, rank-0 printing and checkpoint); only the
import differs. Data is synthetic. Launch with
``horovodrun -np 2 python examples/horovod/gradient_tape_mnist.py``.
"""

import argparse
import os
import sys

import tensorflow as tf

import hvdkit as hvd  # hvdkit: was `import horovod.tensorflow as hvd`

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _synthetic import load_data  # stands in for keras.datasets.mnist (no download here)


def main(steps: int, outdir: str, seed: int | None = None) -> None:
    hvd.init()
    if seed is not None:  # not in Horovod's example: lets a test repeat one run exactly
        tf.keras.utils.set_random_seed(seed)  # the same seed on every rank

    gpus = tf.config.experimental.list_physical_devices("GPU")
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

    (images, labels), _ = load_data(seed=hvd.rank())
    dataset = tf.data.Dataset.from_tensor_slices(
        (tf.cast(images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(labels, tf.int64))
    )
    dataset = dataset.repeat().shuffle(10000).batch(64)

    model = tf.keras.Sequential(
        [
            tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
            tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(32, activation="relu"),
            tf.keras.layers.Dense(10, activation="softmax"),
        ]
    )
    loss = tf.losses.SparseCategoricalCrossentropy()
    opt = tf.optimizers.Adam(0.001 * hvd.size())
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)

    @tf.function
    def training_step(images, labels, first_batch):
        with tf.GradientTape() as tape:
            probs = model(images, training=True)
            loss_value = loss(labels, probs)
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        # after the first step, so that the optimizer's variables exist
        if first_batch:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
        return loss_value

    first = None
    for batch, (x, y) in enumerate(dataset.take(steps // hvd.size())):
        loss_value = training_step(x, y, batch == 0)
        first = float(loss_value) if first is None else first
        if batch % 10 == 0 and hvd.rank() == 0:
            print(f"Step #{batch}\tLoss: {float(loss_value):.6f}")

    weights_sum = float(sum(tf.reduce_sum(tf.abs(w)) for w in model.weights))
    spread = hvd.allreduce([weights_sum], op=hvd.Max) - hvd.allreduce([weights_sum], op=hvd.Min)
    last = float(hvd.allreduce([float(loss_value)])[0])
    if hvd.rank() == 0:
        checkpoint.save(os.path.join(outdir, "checkpoints"))
        print(f"final loss {last:.4f} first {first:.4f}")
        print(f"weights differ between ranks by {float(spread[0]):.3g}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=400, help="steps of the whole job")
    p.add_argument("--outdir", default=".")
    p.add_argument("--seed", type=int, default=None, help="seed Python, NumPy and TF")
    a = p.parse_args()
    main(a.steps, a.outdir, a.seed)
