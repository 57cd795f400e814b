"""LeNet-5 on MNIST-format data in sink mode, with 1 or N processes.

    horovodrun -np 2 --gloo python examples/lenet_sink.py [--data-dir DIR]

The two forms of MindSpore's sink-mode tutorial, in TensorFlow:

1. Keras: ``hvdkit.sink.train(model, epochs, ds, sink_size=N)``, MindSpore's
   ``model.train(epochs, ds, dataset_sink_mode=True, sink_size=N)``: each
   epoch is one host call of N steps; the loss is printed once per sink.
2. Functional: ``hvdkit.sink.data_sink(train_step, ds, sink_size=N)``,
   MindSpore's ``data_sink``: each call of the returned function runs N steps.

Without ``--data-dir`` a small MNIST-format set (IDX files, class-dependent
28x28 patterns) is generated in a temporary directory. Lines that differ from
single-process TensorFlow code are marked ``# hvdkit:``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf

import hvdkit  # hvdkit
import hvdkit.data  # hvdkit
from hvdkit import sink  # hvdkit


def write_mnist_format(root: Path, train: int = 2048, test: int = 512, seed: int = 0) -> None:
    """Write the four MNIST IDX files: a learnable pattern per class, shifted, plus noise."""
    rng = np.random.default_rng(seed)
    # One smooth 28x28 template per class: blurred noise, kept where it is high.
    noise = rng.normal(size=(10, 28, 28))
    kernel = np.exp(-0.5 * (np.arange(-4, 5) / 2.0) ** 2)
    for axis in (1, 2):
        noise = np.apply_along_axis(lambda v: np.convolve(v, kernel, "same"), axis, noise)
    templates = (noise > np.quantile(noise, 0.8, axis=(1, 2), keepdims=True)).astype(float)

    def images_labels(n):
        labels = rng.integers(0, 10, n)
        shifts = rng.integers(-3, 4, size=(n, 2))
        imgs = np.stack(
            [
                np.roll(templates[k], tuple(s), axis=(0, 1))
                for k, s in zip(labels, shifts, strict=True)
            ]
        )
        imgs = np.clip(imgs * 200 + rng.normal(0, 100, imgs.shape), 0, 255).astype(np.uint8)
        return imgs, labels.astype(np.uint8)

    for prefix, n in (("train", train), ("t10k", test)):
        imgs, labels = images_labels(n)
        # IDX: big-endian magic 0x00000803 + dims for images, 0x00000801 + count for labels
        (root / f"{prefix}-images-idx3-ubyte").write_bytes(
            struct.pack(">IIII", 0x803, n, 28, 28) + imgs.tobytes()
        )
        (root / f"{prefix}-labels-idx1-ubyte").write_bytes(
            struct.pack(">II", 0x801, n) + labels.tobytes()
        )


def lenet5() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((32, 32, 1)),
            keras.layers.Conv2D(6, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(16, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(120, activation="relu"),
            keras.layers.Dense(84, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def preprocess(image, label):
    image = tf.image.resize(tf.cast(image, tf.float32) / 255.0, (32, 32))  # LeNet's input
    return (image - 0.1307) / 0.3081, label


class LossMonitor(keras.callbacks.Callback):
    """Prints the epoch's loss; in sink mode an epoch is one sink, so once per sink."""

    def __init__(self, sink_size: int):
        super().__init__()
        self.sink_size = sink_size

    def on_epoch_end(self, epoch, logs=None):
        step = (epoch + 1) * self.sink_size
        print(f"epoch {epoch + 1:2d} step {step:4d} loss {logs['loss']:.4f}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data-dir", help="directory of the 4 MNIST IDX files; default: generate")
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--sink-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=0.01, help="for one process; scaled by size()")
    args = p.parse_args()

    hvdkit.init()  # hvdkit: size 1 without a launcher
    rank, size = hvdkit.rank(), hvdkit.size()  # hvdkit
    data_dir = args.data_dir
    if data_dir is None:
        data_dir = tempfile.mkdtemp(prefix="mnist-format-")  # each rank writes the same files
        atexit.register(shutil.rmtree, data_dir, ignore_errors=True)
        write_mnist_format(Path(data_dir))

    # hvdkit: this rank's shard (equal lengths on every rank), staged ahead of the step
    train_ds = hvdkit.data.MnistDataset(data_dir, "train", num_shards="auto", shuffle=True)
    train_ds = train_ds.shuffle(1024).map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    train_ds = sink.prefetch_to_device(train_ds.batch(args.batch_size, drop_remainder=True))

    keras.utils.set_random_seed(0)
    model = lenet5()
    opt = keras.optimizers.SGD(args.lr * size, momentum=0.9)  # hvdkit: lr scaled by size
    model.compile(
        optimizer=hvdkit.DistributedOptimizer(opt),  # hvdkit: average gradients
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,  # hvdkit: Horovod's allreduce has no XLA kernels
    )
    callbacks = [
        hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),  # hvdkit: same start
        hvdkit.callbacks.MetricAverageCallback(),  # hvdkit: job-wide loss
    ]
    if rank == 0:  # hvdkit: print from one rank
        callbacks.append(LossMonitor(args.sink_size))
        print(f"1. Keras sink mode: {args.epochs} sinks of {args.sink_size} steps", flush=True)
    # hvdkit: MindSpore's model.train(epochs, ds, dataset_sink_mode=True, sink_size=N)
    sink.train(
        model, args.epochs, train_ds, callbacks=callbacks, sink_size=args.sink_size, verbose=0
    )

    # 2. The functional form: the same model continues with a custom step.
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def train_step(images, labels):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        model.optimizer.apply(grads, model.trainable_variables)  # averaged over ranks
        return loss

    sink_process = sink.data_sink(train_step, train_ds, sink_size=args.sink_size)  # hvdkit
    if rank == 0:
        print(f"2. data_sink: 4 calls of {args.sink_size} steps", flush=True)
    for call in range(4):
        loss = hvdkit.allreduce(sink_process())  # hvdkit: the last step's loss, averaged
        if rank == 0:
            step = (args.epochs + call + 1) * args.sink_size
            print(f"call {call + 1} step {step:4d} loss {float(loss):.4f}", flush=True)

    # hvdkit: each rank scores a disjoint part of the test set; counts are summed
    test_ds = hvdkit.data.MnistDataset(
        data_dir, "test", num_shards="auto", shuffle=False, mode="uneven"
    )  # hvdkit: stored order: each rank reads contiguous records
    test_ds = test_ds.map(preprocess)
    correct = total = 0
    for images, labels in test_ds.batch(256):
        pred = tf.argmax(model(images, training=False), axis=1, output_type=tf.int32)
        correct += int(tf.reduce_sum(tf.cast(pred == labels, tf.int32)))
        total += int(labels.shape[0])
    correct, total = hvdkit.allreduce(np.array([correct, total]), op=hvdkit.Sum)  # hvdkit
    if rank == 0:
        print(f"test accuracy {correct / total:.4f} ({correct}/{total})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
