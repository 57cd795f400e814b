"""The shape of Keras's "Writing a training loop from scratch in TensorFlow" guide.

    hvdkitrun -np 2 --check-weights python examples/keras_guides/custom_loop.py

A ``tf.function`` step with a ``GradientTape``, a training metric and a
validation metric per epoch. The lines hvdkit adds: the tape's wrapper, the
broadcast of rank 0's weights (without it every rank would train its own
model, and hvdkit stops the job at the second step), metrics summed over
the ranks.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from _data import digits, mine, per_rank

import hvdkit  # hvdkit

hvdkit.init()  # hvdkit
keras.utils.set_random_seed(2 + hvdkit.rank())  # each rank initialises differently...
inputs = keras.Input(shape=(784,), name="digits")
x1 = keras.layers.Dense(32, activation="relu")(inputs)
outputs = keras.layers.Dense(10, name="predictions")(x1)
model = keras.Model(inputs=inputs, outputs=outputs)
hvdkit.broadcast_variables(model.variables, root_rank=0)  # hvdkit: ...so start from rank 0's

optimizer = keras.optimizers.SGD(learning_rate=0.05)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
train_acc_metric = keras.metrics.SparseCategoricalAccuracy()
val_acc_metric = keras.metrics.SparseCategoricalAccuracy()

x_train, y_train = digits(512, seed=0)
x_val, y_val = digits(128, seed=1)
batch = per_rank(64)  # hvdkit: the global batch stays 64
train_dataset = tf.data.Dataset.from_tensor_slices(
    (mine(x_train).reshape(-1, 784), mine(y_train))  # hvdkit: this rank's rows
).batch(batch)
val_dataset = tf.data.Dataset.from_tensor_slices((mine(x_val).reshape(-1, 784), mine(y_val))).batch(
    batch
)


@tf.function
def train_step(x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss_value = loss_fn(y, logits)
    tape = hvdkit.DistributedGradientTape(tape)  # hvdkit: averaged gradients
    grads = tape.gradient(loss_value, model.trainable_weights)
    optimizer.apply(grads, model.trainable_weights)
    train_acc_metric.update_state(y, logits)
    return loss_value


@tf.function
def test_step(x, y):
    val_acc_metric.update_state(y, model(x, training=False))


def job_result(metric):
    """The metric over every rank's rows (states summed): what one process computes."""
    total, count = (hvdkit.allreduce(v, op=hvdkit.Sum) for v in metric.variables)
    return float(total / count)


for epoch in range(3):
    for x_batch, y_batch in train_dataset:
        loss_value = train_step(x_batch, y_batch)
    loss_value = hvdkit.allreduce(loss_value)  # hvdkit: the global batch's loss
    train_acc = job_result(train_acc_metric)
    train_acc_metric.reset_state()
    for x_batch, y_batch in val_dataset:
        test_step(x_batch, y_batch)
    val_acc = job_result(val_acc_metric)
    val_acc_metric.reset_state()
    if hvdkit.rank() == 0:  # hvdkit
        print(f"Epoch {epoch}: last batch loss {float(loss_value):.5f}")
        print(f"Training acc over epoch: {train_acc:.5f}")
        print(f"Validation acc: {val_acc:.5f}")
