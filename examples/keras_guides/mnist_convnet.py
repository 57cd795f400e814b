"""The shape of Keras's "Simple MNIST convnet" example, data made synthetic.

    python examples/keras_guides/mnist_convnet.py
    hvdkitrun -np 2 --check-weights python examples/keras_guides/mnist_convnet.py

``model.summary()``, a progress bar and the final "Test loss / Test
accuracy" lines print on rank 0 exactly as in one process.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from _data import digits, mine, per_rank

import hvdkit  # hvdkit

hvdkit.init()  # hvdkit
keras.utils.set_random_seed(1)
x_train, y_train = digits(512, seed=0)
x_test, y_test = digits(200, seed=1)
y_train, y_test = keras.utils.to_categorical(y_train, 10), keras.utils.to_categorical(y_test, 10)

model = keras.Sequential(
    [
        keras.Input(shape=(28, 28, 1)),
        keras.layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Conv2D(16, kernel_size=(3, 3), activation="relu"),
        keras.layers.MaxPooling2D(pool_size=(2, 2)),
        keras.layers.Flatten(),
        keras.layers.Dense(10, activation="softmax"),
    ]
)
if hvdkit.rank() == 0:  # hvdkit: print once
    model.summary()

optimizer = hvdkit.DistributedOptimizer("adam")  # hvdkit
model.compile(loss="categorical_crossentropy", optimizer=optimizer, metrics=["accuracy"])
model.fit(
    mine(x_train),  # hvdkit: this rank's rows
    mine(y_train),
    batch_size=per_rank(64),  # hvdkit: the global batch stays 64
    epochs=3,
    shuffle=False,
    verbose=1 if hvdkit.rank() == 0 else 0,  # hvdkit
    callbacks=[
        hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),  # hvdkit
        hvdkit.callbacks.MetricAverageCallback(),  # hvdkit
    ],
)
score = model.evaluate(
    mine(x_test),
    mine(y_test),
    verbose=0,
    callbacks=[hvdkit.callbacks.MetricAverageCallback()],  # hvdkit: the whole test set's
)
if hvdkit.rank() == 0:  # hvdkit
    print("Test loss:", f"{score[0]:.5f}")
    print("Test accuracy:", f"{score[1]:.5f}")
