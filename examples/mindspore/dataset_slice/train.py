"""Port of MindSpore's dataset-slicing tutorial: each rank reads one vertical strip of every image.

Every rank reads all of MNIST in the same order (``MnistDataset`` without
``num_shards``, shuffled anew every epoch from one seed), cuts every image
into a ``1 x 4`` grid (``SlicePatches``) and keeps patch ``rank % 4``. MindSpore's
``dataset_strategy=((1, 1, 1, 4), (1,))`` then trains the network *as if on
the whole images*: the first ``Dense`` layer is split by rows over the
ranks' strips and the partial products are summed across ranks; the rest of
the network is replicated. This port writes that split out (``StripDense``),
so the job computes exactly what one process computes on whole images.
Launched with ``mpirun`` as in the tutorial:

    DATA_PATH=/path/to/MNIST_Data/train bash run.sh

Lines that differ from the tutorial are marked ``# hvdkit:``.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf

import hvdkit  # hvdkit: was mindspore.communication
import hvdkit.data  # hvdkit: was mindspore.dataset
import hvdkit.ops  # hvdkit: was mindspore.dataset.vision.SlicePatches

hvdkit.init()  # hvdkit: was init() (SEMI_AUTO_PARALLEL: the split is written out below)
slice_h_num = 1
# hvdkit: 4 strips as in the tutorial (8 ranks: 2 per strip); fewer ranks, one strip each
slice_w_num = 4 if hvdkit.size() % 4 == 0 else hvdkit.size()
rank_id = hvdkit.rank()  # hvdkit: was get_rank()
copies = hvdkit.size() // (slice_h_num * slice_w_num)  # ranks that hold the same strip
strip = rank_id % (slice_h_num * slice_w_num)
strip_width = -(-28 // slice_w_num)  # SlicePatches' pad mode: the last strip is padded


@tf.custom_gradient
def sum_over_strips(partial):  # hvdkit: what dataset_strategy inserts after the split layer
    """Forward: the strips' partial products summed over the ranks. Backward: identity,
    since every rank computes the same loss from the summed output."""
    total = hvdkit.allreduce(partial, op=hvdkit.Sum) / copies
    return total, lambda grad: grad


class StripDense(keras.layers.Layer):  # hvdkit: Dense(28*28, 512) split by this rank's strip
    def __init__(self, units, full_kernel):
        super().__init__()
        rows = np.zeros((28, strip_width, full_kernel.shape[1]), "float32")  # padded columns: 0
        cols = range(strip * strip_width, min(28, (strip + 1) * strip_width))
        rows[:, : len(cols)] = full_kernel.reshape(28, 28, -1)[:, cols.start : cols.stop]
        self.kernel = self.add_weight(shape=(28 * strip_width, units), name="kernel")
        self.kernel.assign(rows.reshape(28 * strip_width, units))
        self.bias = self.add_weight(shape=(units,), initializer="zeros", name="bias")

    def call(self, x):
        return sum_over_strips(tf.matmul(x, self.kernel)) + self.bias


class Network(keras.Model):
    """Network"""

    def __init__(self):
        super().__init__()
        keras.utils.set_random_seed(1)  # hvdkit: the same whole-image weights on every rank
        full = keras.initializers.GlorotUniform()((28 * 28, 512)).numpy()  # Dense(28*28, 512)
        self.flatten = keras.layers.Flatten()
        self.layer1 = StripDense(512, full)  # hvdkit: this rank's rows of Dense(28*28, 512)
        self.relu1 = keras.layers.ReLU()
        self.layer2 = keras.layers.Dense(512)
        self.relu2 = keras.layers.ReLU()
        self.layer3 = keras.layers.Dense(10)

    def call(self, x):
        x = self.flatten(x)
        x = self.layer1(x)
        x = self.relu1(x)
        x = self.layer2(x)
        x = self.relu2(x)
        logits = self.layer3(x)
        return logits


net = Network()


def create_dataset(batch_size):
    """create dataset"""
    dataset_path = os.getenv("DATA_PATH")
    # hvdkit: seed=1000 stands for ds.config.set_seed(1000); shuffled, as MindSpore's default
    dataset = hvdkit.data.MnistDataset(dataset_path, seed=1000)

    def image_transforms(image, label):  # Rescale(1/255), Normalize(0.1307, 0.3081)
        return (tf.cast(image, tf.float32) / 255.0 - 0.1307) / 0.3081, label  # hvdkit: HWC

    dataset = dataset.map(image_transforms)
    # slice image: keep this rank's patch (SlicePatches + project img{rank % 4})
    dataset = dataset.map(hvdkit.ops.rank_patch(slice_h_num, slice_w_num))  # hvdkit:
    dataset = dataset.batch(batch_size)
    return dataset


data_set = create_dataset(32)
optimizer = keras.optimizers.SGD(1e-2)
loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)  # nn.CrossEntropyLoss()


def forward_fn(data, target):
    """forward propagation"""
    logits = net(data)
    loss = loss_fn(target, logits)
    return loss, logits


@tf.function  # hvdkit: ms.value_and_grad in GRAPH_MODE
def train_step(image, label):
    with tf.GradientTape() as tape:
        loss_value, _ = forward_fn(image, label)
    grads = tape.gradient(loss_value, net.trainable_variables)
    optimizer.apply(grads, net.trainable_variables)
    return loss_value


losses = []
for epoch in range(5):
    i = 0
    for image, label in data_set:
        loss_value = train_step(image, label)
        if i % 10 == 0:
            print(f"epoch: {epoch}, step: {i}, loss is {float(loss_value)}")
        losses.append(float(loss_value))  # hvdkit: kept for the report below
        i += 1

replicated = np.concatenate([w.numpy().ravel() for w in net.trainable_variables[2:]])  # hvdkit:
print(f"rank {rank_id} strip {strip} of {slice_w_num}: final loss {losses[-1]:.6f}", flush=True)
if os.getenv("PORT_REPORT_DIR"):  # hvdkit: for tests/test_ports_mp.py
    with open(os.path.join(os.getenv("PORT_REPORT_DIR"), f"rank{rank_id}.json"), "w") as f:
        json.dump({"strips": slice_w_num, "losses": losses, "replicated": replicated.tolist()}, f)
