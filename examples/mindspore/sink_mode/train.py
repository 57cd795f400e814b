"""Port of MindSpore's sink-mode tutorial: LeNet-5 on MNIST, sunk with Model.train and data_sink.

Two parts, as in the tutorial:

1. ``model.train(epoch=10, train_dataset=ds, callbacks=[LossMonitor()],
   dataset_sink_mode=True, sink_size=1000)``: every epoch is one sink of
   1000 steps (the dataset cycles), and the loss is printed once per epoch.
2. ``data_sink(train_step, ds, sink_size=..., jit_config=jit)``, called in
   the tutorial's three ways: one step per call, one epoch per call, and all
   10 epochs in one call.

    DATA_PATH=./datasets/MNIST_Data/train/ python train.py

The tutorial downloads MNIST; the port reads it from ``DATA_PATH``. Lines
that differ from the tutorial are marked ``# hvdkit:``.
"""

import os

import keras
import tensorflow as tf

import hvdkit  # hvdkit: was mindspore
import hvdkit.data  # hvdkit: was mindspore.dataset
from hvdkit import sink  # hvdkit: ms.Model(...).train and ms.data_sink


def create_dataset(data_path, batch_size=32, repeat_size=1, num_parallel_workers=1):
    """
    create dataset for train or test
    """
    # define dataset
    mnist_ds = hvdkit.data.MnistDataset(data_path)  # hvdkit: all records, shuffled (MindSpore's)

    resize_height, resize_width = 32, 32
    rescale = 1.0 / 255.0
    shift = 0.0
    rescale_nml = 1 / 0.3081
    shift_nml = -1 * 0.1307 / 0.3081

    def map_ops(image, label):  # hvdkit: one tf.data map; images stay HWC (no HWC2CHW)
        image = tf.image.resize(tf.cast(image, tf.float32), (resize_height, resize_width))
        image = image * rescale + shift
        image = image * rescale_nml + shift_nml
        return image, tf.cast(label, tf.int32)

    mnist_ds = mnist_ds.map(map_ops, num_parallel_calls=num_parallel_workers)

    # apply DatasetOps
    buffer_size = 10000
    mnist_ds = mnist_ds.shuffle(buffer_size=buffer_size)  # 10000 as in LeNet train script
    mnist_ds = mnist_ds.batch(batch_size, drop_remainder=True)
    mnist_ds = mnist_ds.repeat(repeat_size)
    return mnist_ds


def weight_variable():
    """weight initial"""
    return keras.initializers.TruncatedNormal(stddev=0.02)


def conv(out_channels, kernel_size):  # hvdkit: Keras infers in_channels
    """weight initial for conv layer"""
    return keras.layers.Conv2D(
        out_channels, kernel_size, kernel_initializer=weight_variable(), use_bias=False
    )


def fc_with_initialize(out_channels):  # hvdkit: Keras infers input_channels
    """weight initial for fc layer"""
    return keras.layers.Dense(
        out_channels, kernel_initializer=weight_variable(), bias_initializer=weight_variable()
    )


def LeNet5(num_class=10):  # hvdkit: a keras.Sequential in place of the nn.Cell
    """Lenet network"""
    return keras.Sequential(
        [
            keras.Input((32, 32, 1)),
            conv(6, 5),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2, 2),
            conv(16, 5),
            keras.layers.ReLU(),
            keras.layers.MaxPooling2D(2, 2),
            keras.layers.Flatten(),
            fc_with_initialize(120),
            keras.layers.ReLU(),
            fc_with_initialize(84),
            keras.layers.ReLU(),
            fc_with_initialize(num_class),
        ]
    )


class LossMonitor(keras.callbacks.Callback):  # hvdkit: MindSpore's train.LossMonitor
    def on_epoch_end(self, epoch, logs=None):
        steps = self.params["steps"]
        print(f"epoch: {epoch + 1} step: {steps}, loss is {logs['loss']}", flush=True)


def model_train(ds_train_path):
    ds_train = create_dataset(ds_train_path, 32)
    network = LeNet5(10)
    net_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    net_opt = keras.optimizers.SGD(0.01, momentum=0.9)  # nn.Momentum(params, 0.01, 0.9)
    network.compile(optimizer=net_opt, loss=net_loss, jit_compile=False)  # ms.Model(...)
    print("============== Starting Training ==============")
    sink.train(  # hvdkit: model.train(...), with the tutorial's argument names
        network,
        epoch=10,
        train_dataset=ds_train,
        callbacks=[LossMonitor()],
        dataset_sink_mode=True,
        sink_size=int(os.getenv("SINK_SIZE", "1000")),  # hvdkit: 1000 as in the tutorial
        verbose=0,  # hvdkit: LossMonitor prints instead of Keras's progress bar
    )


def data_sink_train(ds_train_path):
    network = LeNet5(10)
    weights = network.trainable_variables
    net_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    net_opt = keras.optimizers.SGD(0.01, momentum=0.9)

    def forward_fn(data, label):
        loss = net_loss(label, network(data, training=True))
        return loss

    def train_step(data, label):
        with tf.GradientTape() as tape:  # hvdkit: ops.value_and_grad
            loss = forward_fn(data, label)
        grads = tape.gradient(loss, weights)
        net_opt.apply(grads, weights)
        return loss

    print("============== Different calling methods train 10 epochs ==============")
    jit = sink.JitConfig()  # hvdkit: was ms.JitConfig()
    print("1. Default, execute one step data each per sink")
    ds_train = create_dataset(ds_train_path, 32)
    data_size = hvdkit.data.get_dataset_size(ds_train)  # hvdkit: ds_train.get_dataset_size()
    epochs = 10
    sink_process = sink.data_sink(train_step, ds_train, jit_config=jit)
    for _ in range(data_size * epochs):
        loss = sink_process()
        print(f"step {_ + 1}, loss is {loss}")
    print(f"sink 1: {sink_process.calls} calls, {sink_process.steps_done} steps")  # hvdkit:

    print("2. Execute one epoch data per sink")
    ds_train = create_dataset(ds_train_path, 32)
    data_size = hvdkit.data.get_dataset_size(ds_train)  # hvdkit: ds_train.get_dataset_size()
    epochs = 10
    sink_process = sink.data_sink(train_step, ds_train, sink_size=data_size, jit_config=jit)
    for _ in range(epochs):
        loss = sink_process()
        print(f"epoch {_ + 1}, loss is {loss}")
    print(f"sink 2: {sink_process.calls} calls, {sink_process.steps_done} steps")  # hvdkit:

    print("3. Execute multiple epoch data per sink")
    ds_train = create_dataset(ds_train_path, 32)
    data_size = hvdkit.data.get_dataset_size(ds_train)  # hvdkit: ds_train.get_dataset_size()
    epochs = 10
    sink_process = sink.data_sink(
        train_step, ds_train, sink_size=epochs * data_size, jit_config=jit
    )
    loss = sink_process()
    print(f"loss is {loss}")
    print(f"sink 3: {sink_process.calls} calls, {sink_process.steps_done} steps")  # hvdkit:


if __name__ == "__main__":
    hvdkit.init()  # hvdkit: was ms.set_context(mode=ms.GRAPH_MODE, device_target="GPU")
    ds_train_path = os.getenv("DATA_PATH", "./datasets/MNIST_Data/train/")  # hvdkit: no download
    model_train(ds_train_path)
    data_sink_train(ds_train_path)
