"""The shape of Keras's "Save, serialize, and export models" guide, across ranks.

    hvdkitrun -np 2 --check-weights python examples/keras_guides/save_load.py

Rank 0 saves, every rank loads (``hvdkit.save_model``: no rank looks for the
file before it is complete), a custom layer is registered and the registry
cleared as the guide does, and every rank's reloaded model predicts what the
original does.
"""

import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
from _data import mine, per_rank

import hvdkit  # hvdkit

hvdkit.init()  # hvdkit
keras.utils.set_random_seed(6)


@keras.saving.register_keras_serializable(package="my_package", name="custom_fn")
def custom_fn(x):
    return x**2


def get_model():
    inputs = keras.Input(shape=(32,))
    outputs = keras.layers.Dense(1, activation=custom_fn)(inputs)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=hvdkit.DistributedOptimizer("adam"), loss="mean_squared_error"
    )  # hvdkit
    return model


rng = np.random.default_rng(7)
x = rng.random((128, 32)).astype("float32")
target = rng.random((128, 1)).astype("float32")
model = get_model()
model.fit(mine(x), mine(target), batch_size=per_rank(32), epochs=2, shuffle=False, verbose=0)

folder = hvdkit.broadcast_object(tempfile.mkdtemp() if hvdkit.rank() == 0 else None)  # hvdkit
path = os.path.join(folder, "my_model.keras")
hvdkit.save_model(model, path)  # hvdkit: rank 0 writes; every rank returns once it is there

reconstructed = keras.models.load_model(path)  # every rank
same = np.array_equal(model.predict(x, verbose=0), reconstructed.predict(x, verbose=0))
same_everywhere = hvdkit.allgather_object(same)  # hvdkit
keras.saving.get_custom_objects().clear()  # the guide's own step
reloaded = hvdkit.load_model(path, custom_objects={"my_package>custom_fn": custom_fn})  # hvdkit
again = np.array_equal(model.predict(x, verbose=0), reloaded.predict(x, verbose=0))
reloaded.fit(mine(x), mine(target), batch_size=per_rank(32), epochs=1, shuffle=False, verbose=0)
loss = reloaded.evaluate(x, target, verbose=0)
if hvdkit.rank() == 0:  # hvdkit
    print(f"reloaded model predicts the same on every rank: {all(same_everywhere)}")
    print(f"reloaded after clearing the registry: {again}")
    print(f"loss after one more epoch: {loss:.5f}")
