"""Port of MindSpore's manual-parallelism tutorial: the network slices the batch by rank.

Every rank reads the *whole* dataset in the same order (``MnistDataset``
without ``num_shards``: shuffled anew every epoch, from one seed on every
rank, as in MindSpore); the network keeps rows ``[rank * s, rank * s + s)``
of each global batch of 32 (``s = 32 / size``), the loss keeps the same rows
of the labels and averages the ranks' losses with an allreduce. Launched
with ``mpirun`` as in the tutorial:

    DATA_PATH=/path/to/MNIST_Data/train bash run.sh

Lines that differ from the tutorial are marked ``# hvdkit:``. One addition
matters: the tutorial averages only the *loss*. The gradient of an allreduce
(in MindSpore as in Horovod) is the allreduce of the incoming gradient, so
each rank would still step with the gradient of its own rows only and the
ranks' weights would drift apart; ``hvdkit.DistributedOptimizer`` averages
the gradients, so that every rank takes the step of the whole global batch:
the job trains exactly like one process on batches of 32.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

import hvdkit  # hvdkit: was mindspore.communication
import hvdkit.data  # hvdkit: was mindspore.dataset
from hvdkit import sink  # hvdkit: was mindspore.Model

hvdkit.init()  # hvdkit: was init() (GRAPH_MODE: Keras compiles the step)
keras.utils.set_random_seed(1)  # hvdkit: the same initial weights on every rank
cur_rank = hvdkit.rank()  # hvdkit: was get_rank()
batch_size = 32
device_num = hvdkit.size()  # hvdkit: was get_group_size()
shard_size = batch_size // device_num


class Network(keras.Model):
    def __init__(self):
        super().__init__()
        self.flatten = keras.layers.Flatten()
        self.layer1 = keras.layers.Dense(512)
        self.relu1 = keras.layers.ReLU()
        self.layer2 = keras.layers.Dense(512)
        self.relu2 = keras.layers.ReLU()
        self.layer3 = keras.layers.Dense(10)

    def call(self, x):
        x = x[cur_rank * shard_size : cur_rank * shard_size + shard_size]
        x = self.flatten(x)
        x = self.layer1(x)
        x = self.relu1(x)
        x = self.layer2(x)
        x = self.relu2(x)
        logits = self.layer3(x)
        return logits


net = Network()


def create_dataset():
    dataset_path = os.getenv("DATA_PATH")
    # shuffled (MindSpore's default) with one seed: every rank reads the same order
    dataset = hvdkit.data.MnistDataset(dataset_path)  # hvdkit: was ds.MnistDataset

    def image_transforms(image, label):  # Rescale(1/255), Normalize(0.1307, 0.3081)
        image = (tf.cast(image, tf.float32) / 255.0 - 0.1307) / 0.3081
        return image, label  # hvdkit: stays HWC (no HWC2CHW); labels are int32 already

    dataset = dataset.map(image_transforms)
    dataset = dataset.batch(batch_size)
    return dataset


data_set = create_dataset()


class ReduceLoss(keras.losses.Loss):
    def __init__(self):
        super().__init__()
        self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def call(self, label, data):  # hvdkit: Keras passes (labels, network output)
        label = label[cur_rank * shard_size : cur_rank * shard_size + shard_size]
        loss_value = self.loss(label, data)
        loss_value = hvdkit.allreduce(loss_value, op=hvdkit.Sum) / device_num  # ops.AllReduce()
        return loss_value


loss_fn = ReduceLoss()


class LossMonitor(keras.callbacks.Callback):  # hvdkit: MindSpore's train.LossMonitor
    def __init__(self, per_print_times):
        super().__init__()
        self.every, self.epoch, self.losses = per_print_times, 0, []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * self.params["steps"] + batch + 1
        if step % self.every == 0:  # Keras reports the epoch's mean loss so far
            print(f"epoch: {self.epoch + 1} step: {step}, loss is {logs['loss']}", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


optimizer = keras.optimizers.SGD(1e-2)
optimizer = hvdkit.DistributedOptimizer(optimizer)  # hvdkit: average the gradients too
loss_cb = LossMonitor(20)
net.compile(optimizer=optimizer, loss=loss_fn, jit_compile=False)  # hvdkit: ms.Model(net, ...)
# hvdkit: model.train(10, data_set, callbacks=[loss_cb]) with MindSpore's argument names
sink.train(net, 10, data_set, callbacks=[loss_cb], dataset_sink_mode=False, verbose=0)

weights = np.concatenate([w.ravel() for w in net.get_weights()]).astype(np.float64)  # hvdkit:
print(f"rank {cur_rank} of {device_num}: weight sum {weights.sum():.9f}", flush=True)  # hvdkit:
if os.getenv("PORT_REPORT_DIR"):  # hvdkit: for tests/test_ports_mp.py
    with open(os.path.join(os.getenv("PORT_REPORT_DIR"), f"rank{cur_rank}.json"), "w") as f:
        json.dump({"size": device_num, "losses": loss_cb.losses, "weights": weights.tolist()}, f)
