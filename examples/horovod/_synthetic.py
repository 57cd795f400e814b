"""Synthetic MNIST-shaped digits: this machine has no network to download MNIST.

Ten fixed random 28x28 prototypes (one per class, the same on every rank);
each image is its class prototype plus noise, so a small CNN learns them in a
few hundred steps. Returned like ``keras.datasets.mnist.load_data()``.
"""

import numpy as np


def load_data(n_train: int = 6000, n_test: int = 1000, seed: int = 0):
    protos = np.random.default_rng(1234).uniform(0, 255, size=(10, 28, 28))
    rng = np.random.default_rng(seed)

    def make(n):
        labels = rng.integers(0, 10, size=n)
        images = protos[labels] * 0.5 + rng.uniform(0, 127, size=(n, 28, 28))
        return images.astype(np.uint8), labels.astype(np.uint8)

    return make(n_train), make(n_test)
