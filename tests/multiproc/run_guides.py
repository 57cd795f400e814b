"""Runs the guide-shaped scripts of examples/keras_guides one after another in this process.

    python run_guides.py [name ...]          # one process
    hvdkitrun -np 2 python run_guides.py     # 2 ranks

One TensorFlow start for all five. Before each script rank 0 prints
``=== <name>``; after it, ``ranks hold equal weights: True`` when every
``keras.Model`` the script left behind has the same weights on every rank.
"""

import os
import runpy
import sys

import keras
import numpy as np

import hvdkit

GUIDES = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "keras_guides")
NAMES = ["mnist_convnet", "custom_loop", "gan_train_step", "callbacks", "save_load"]


def fingerprint(namespace) -> list[float]:
    models = [v for _, v in sorted(namespace.items()) if isinstance(v, keras.Model)]
    return [float(np.sum([np.sum(w.numpy().astype("float64")) for w in m.weights])) for m in models]


def main(names):
    sys.path.insert(0, os.path.abspath(GUIDES))
    hvdkit.init()
    for name in names:
        if hvdkit.rank() == 0:
            print(f"=== {name}", flush=True)
        namespace = runpy.run_path(os.path.join(GUIDES, f"{name}.py"), run_name="__main__")
        prints = hvdkit.allgather_object(fingerprint(namespace))
        if hvdkit.rank() == 0:
            print(f"ranks hold equal weights: {all(p == prints[0] for p in prints)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or NAMES)
