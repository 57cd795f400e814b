"""Horovod's elastic Keras training, written as a Horovod user writes it.

The calls are those of Horovod's
``examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py`` (its
model, optimizer wrapper, one-step ``fit`` before the state exists,
``KerasState`` with ``batch``/``epoch``, a reset callback that rescales the
learning rate, the three state callbacks, rank-0 checkpoints, and
``@hvd.elastic.run``); only the import differs, and the two lines Keras 3
refuses are written its way (marked ``# Keras 3:``). Data is synthetic (no
download here); the model is smaller, for a 2-core machine.

Launch it elastic with hvdkit's scheduler/worker launch (Gloo)::

    HVDKIT_ELASTIC=1 HVDKIT_WORKER_NUM=3 HVDKIT_MIN_WORKERS=2 \\
        examples/cluster/run_scheduler.sh &
    examples/cluster/run_workers.sh 3 python examples/horovod/keras_mnist_elastic.py

or as a fixed job with ``horovodrun -np 2 python ...`` (then nothing is elastic).
"""

import argparse
import os
import sys

import tensorflow as tf

import hvdkit as hvd  # hvdkit: was `import horovod.tensorflow.keras as hvd`

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _synthetic import load_data  # stands in for keras.datasets.mnist (no download here)

parser = argparse.ArgumentParser(description="Tensorflow 2.0 Keras MNIST Example (elastic)")
parser.add_argument("--epochs", type=int, default=24)
parser.add_argument("--steps", type=int, default=500, help="steps per epoch of the whole job")
parser.add_argument("--outdir", default=".")
parser.add_argument("--seed", type=int, default=None, help="seed Python, NumPy and TF")
args = parser.parse_args()

hvd.init()
if args.seed is not None:  # not in Horovod's example: lets a test repeat one run exactly
    tf.keras.utils.set_random_seed(args.seed)

gpus = tf.config.experimental.list_physical_devices("GPU")
for gpu in gpus:
    tf.config.experimental.set_memory_growth(gpu, True)
if gpus:
    tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], "GPU")

(mnist_images, mnist_labels), _ = load_data(seed=hvd.rank())

dataset = tf.data.Dataset.from_tensor_slices(
    (tf.cast(mnist_images[..., tf.newaxis] / 255.0, tf.float32), tf.cast(mnist_labels, tf.int64))
)
dataset = dataset.repeat().shuffle(10000).batch(64)

model = tf.keras.Sequential(
    [
        tf.keras.Input((28, 28, 1)),
        tf.keras.layers.Conv2D(8, [3, 3], activation="relu"),
        tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
        tf.keras.layers.Dropout(0.25),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(32, activation="relu"),
        tf.keras.layers.Dropout(0.5),
        tf.keras.layers.Dense(10, activation="softmax"),
    ]
)

scaled_lr = 0.001 * hvd.size()
opt = tf.optimizers.Adam(scaled_lr)
opt = hvd.DistributedOptimizer(opt, backward_passes_per_step=1, average_aggregated_gradients=True)

# Keras 3: compile() has no experimental_run_tf_function argument (Horovod passes False).
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, metrics=["accuracy"])

# As Horovod's example: one step to build the optimizer's state before the state holds it.
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)

state = hvd.elastic.KerasState(model, batch=0, epoch=0)


def on_state_reset():
    # Keras 3: Horovod's `tf.keras.backend.set_value(optimizer.lr, ...)`: the `lr` alias is
    # gone, and set_value fails on a Keras 3 variable ('str' object has no attribute 'name').
    state.model.optimizer.learning_rate = 0.001 * hvd.size()
    # Re-initialize, to join with possible new ranks
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None)


state.register_reset_callbacks([on_state_reset])

callbacks = [
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]

if hvd.rank() == 0:
    callbacks.append(
        tf.keras.callbacks.ModelCheckpoint(os.path.join(args.outdir, "checkpoint-{epoch}.keras"))
    )


@hvd.elastic.run
def train(state):
    state.model.fit(
        dataset,
        steps_per_epoch=args.steps // hvd.size(),
        epochs=args.epochs - state.epoch,
        callbacks=callbacks,
        verbose=2 if hvd.rank() == 0 else 0,
    )


train(state)
