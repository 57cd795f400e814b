"""Port of MindSpore's "distributed parallel training on CPU" tutorial (data parallel).

The tutorial trains ResNet-50 on CIFAR-10 with one scheduler and eight
workers, all started by ``run.sh`` from this same script: ``MS_ROLE`` tells
each process what it is, and ``init()`` takes that role. Here
``hvdkit.init()`` does the same: in the scheduler it runs the scheduler and
exits with the job's status (it never trains); in a worker it registers and
becomes one rank of the job. Every worker reads its own shard of CIFAR-10
(``num_shards=get_group_size(), shard_id=get_rank()``), shuffled anew every
epoch, and the gradients are averaged (``gradients_mean=True``).

    bash run.sh /path/to/cifar-10-batches-bin      # MS_WORKER_NUM workers (default 8)

The tutorial passes the whole ``cifar-10-batches-bin`` directory and no
``usage``, so MindSpore reads every batch file in it, ``test_batch.bin``
included: 60,000 images. ``hvdkit.data.Cifar10Dataset`` does the same; pass
``usage="train"`` (in both places below) for the 50,000 training images only.

Lines that differ from the tutorial are marked ``# hvdkit:``. The network
is a small CNN instead of ResNet-50 at 224 x 224 (set ``RESNET50=1`` for
``keras.applications.ResNet50`` on 32 x 32 images): a CPU-sized model is
what lets the whole flow run in a test.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

import hvdkit  # hvdkit: was mindspore and mindspore.communication.init
import hvdkit.data  # hvdkit: was mindspore.dataset
from hvdkit import sink  # hvdkit: Model.train(..., dataset_sink_mode=True)

MEAN = (0.4465, 0.4822, 0.4914)  # the tutorial's normalisation constants
STD = (0.2010, 0.1994, 0.2023)


def create_dataset(data_path, repeat_num=1, batch_size=32):
    """Create training dataset"""
    rank_size = hvdkit.size()  # hvdkit: was get_group_size()
    rank_id = hvdkit.rank()  # hvdkit: was get_rank()
    data_set = hvdkit.data.Cifar10Dataset(data_path, num_shards=rank_size, shard_id=rank_id)

    def augment(image, label):
        # random crop 32 x 32 after padding 4 on each side, random horizontal flip,
        # rescale to [0, 1], normalise; images stay HWC (Keras is channels-last)  # hvdkit:
        image = tf.image.resize_with_crop_or_pad(image, 40, 40)
        image = tf.image.random_crop(image, (32, 32, 3))
        image = tf.image.random_flip_left_right(image)
        image = (tf.cast(image, tf.float32) / 255.0 - MEAN) / STD
        return image, tf.cast(label, tf.int32)

    data_set = data_set.map(augment)
    data_set = data_set.shuffle(buffer_size=10)
    data_set = data_set.batch(batch_size=batch_size, drop_remainder=True)
    data_set = data_set.repeat(repeat_num)
    return data_set


def small_cnn(num_classes):  # hvdkit: a CPU-sized network in place of resnet50()
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(32, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(num_classes),
        ]
    )


class LossMonitor(keras.callbacks.Callback):  # hvdkit: MindSpore's train.LossMonitor
    def on_epoch_end(self, epoch, logs=None):
        steps = self.params["steps"]
        print(f"epoch: {epoch + 1} step: {steps}, loss is {logs['loss']}", flush=True)


def train_resnet50_with_cifar10(epoch_size=10):
    """Start the training"""
    loss_cb = LossMonitor()
    data_path = os.getenv("DATA_PATH")
    dataset = create_dataset(data_path)
    batch_size = 32
    num_classes = 10
    if os.getenv("RESNET50") == "1":  # hvdkit: the tutorial's network, on 32 x 32 images
        net = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    else:
        net = small_cnn(num_classes)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=not os.getenv("RESNET50"))
    opt = keras.optimizers.SGD(0.01, momentum=0.9)  # nn.Momentum(params, 0.01, 0.9)
    opt = hvdkit.DistributedOptimizer(opt)  # hvdkit: gradients_mean=True
    net.compile(optimizer=opt, loss=loss, jit_compile=False)  # hvdkit: train.Model(net, ...)
    broadcast = hvdkit.callbacks.BroadcastGlobalVariablesCallback(0)  # hvdkit: same start
    sink.train(
        net,
        epoch_size,
        dataset,
        callbacks=[broadcast, loss_cb],
        dataset_sink_mode=True,
        verbose=0,  # hvdkit: LossMonitor prints instead of Keras's progress bar
    )
    report(net, data_path, batch_size)  # hvdkit: what the run shows (see below)


def report(net, data_path, batch_size):  # hvdkit: not in the tutorial
    """Print what every rank ends with; with PORT_REPORT_DIR set, also write it as JSON.

    The ids are the first two bytes of each image of this rank's shard, the
    shard ``create_dataset`` reads (tests/datafiles.py writes ids there).
    """
    weights = np.concatenate([w.ravel() for w in net.get_weights()]).astype(np.float64)
    rank, size = hvdkit.rank(), hvdkit.size()
    shard = hvdkit.data.Cifar10Dataset(data_path, num_shards=size, shard_id=rank)
    images = np.stack([image for image, _ in shard.as_numpy_iterator()])
    ids = (images[:, 0, 0, 0].astype(int) * 256 + images[:, 0, 1, 0]).tolist()
    print(f"rank {rank} of {size}: {len(ids)} images, weight sum {weights.sum():.9f}", flush=True)
    out = os.getenv("PORT_REPORT_DIR")
    if out:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "size": size, "ids": ids, "weights": weights.tolist()}, f)


if __name__ == "__main__":
    hvdkit.init()  # hvdkit: set_context/set_auto_parallel_context/set_ps_context + init()
    train_resnet50_with_cifar10()
