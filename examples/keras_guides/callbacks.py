"""The shape of Keras's "Writing your own callbacks" guide: callbacks that print and decide.

    hvdkitrun -np 2 --check-weights python examples/keras_guides/callbacks.py

A callback prints the epoch's logs; ``EarlyStopping`` and a custom callback
that lowers the learning rate decide on the job's numbers (``MetricAverageCallback``),
so every rank decides alike, at the epoch one process would.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from _data import digits, mine, per_rank

import hvdkit  # hvdkit

hvdkit.init()  # hvdkit
keras.utils.set_random_seed(5)
x, y = digits(256, seed=0)
x = x.reshape(-1, 784)
x_val, y_val = digits(64, seed=1)
x_val = x_val.reshape(-1, 784)

model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(1)])
model.compile(
    optimizer=hvdkit.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse"
)  # hvdkit


class LossPrinter(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if hvdkit.rank() == 0:  # hvdkit
            print(
                f"The average loss for epoch {epoch} is {logs['loss']:7.4f}, "
                f"validation {logs['val_loss']:7.4f}"
            )


class HalveLearningRateOnPlateau(keras.callbacks.Callback):
    """Decides from the logs, which are the job's: every rank halves at the same epoch."""

    def __init__(self):
        super().__init__()
        self.best = float("inf")

    def on_epoch_end(self, epoch, logs=None):
        if logs["val_loss"] > self.best - 0.5:
            lr = self.model.optimizer.learning_rate
            lr.assign(lr * 0.5)
            if hvdkit.rank() == 0:  # hvdkit
                print(f"Epoch {epoch}: learning rate halved to {float(lr.numpy()):.6f}")
        self.best = min(self.best, logs["val_loss"])


stopper = keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, min_delta=0.05)
model.fit(
    mine(x),  # hvdkit
    mine(y),
    batch_size=per_rank(32),  # hvdkit
    epochs=30,
    shuffle=False,
    verbose=0,
    validation_data=(mine(x_val), mine(y_val)),  # hvdkit
    callbacks=[
        hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),  # hvdkit
        hvdkit.callbacks.MetricAverageCallback(),  # hvdkit: before any callback sees them
        LossPrinter(),
        HalveLearningRateOnPlateau(),
        stopper,
    ],
)
if hvdkit.rank() == 0:  # hvdkit
    print(f"Stopped after epoch {stopper.stopped_epoch}")
