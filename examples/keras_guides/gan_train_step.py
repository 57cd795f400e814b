"""The shape of Keras's "Customizing what happens in fit()" guide: a GAN's ``train_step``.

    hvdkitrun -np 2 --check-weights python examples/keras_guides/gan_train_step.py

A subclassed model with two optimizers, each wrapped; the noise comes with the
data so that N ranks draw what one process draws.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from _data import digits, mine, per_rank

import hvdkit  # hvdkit

hvdkit.init()  # hvdkit
keras.utils.set_random_seed(3)
LATENT = 16


class GAN(keras.Model):
    def __init__(self, discriminator, generator):
        super().__init__()
        self.discriminator = discriminator
        self.generator = generator
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer = d_optimizer
        self.g_optimizer = g_optimizer
        self.loss_fn = loss_fn

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def train_step(self, data):
        real_images, noise = data
        batch_size = tf.shape(real_images)[0]
        generated_images = self.generator(noise)
        combined_images = tf.concat([generated_images, real_images], axis=0)
        labels = tf.concat([tf.ones((batch_size, 1)), tf.zeros((batch_size, 1))], axis=0)
        with tf.GradientTape() as tape:
            predictions = self.discriminator(combined_images)
            d_loss = self.loss_fn(labels, predictions)
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply(grads, self.discriminator.trainable_weights)

        misleading_labels = tf.zeros((batch_size, 1))
        with tf.GradientTape() as tape:
            predictions = self.discriminator(self.generator(noise))
            g_loss = self.loss_fn(misleading_labels, predictions)
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss, sample_weight=batch_size)
        self.g_loss_tracker.update_state(g_loss, sample_weight=batch_size)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


discriminator = keras.Sequential(
    [
        keras.Input((28, 28, 1)),
        keras.layers.Flatten(),
        keras.layers.Dense(16, "relu"),
        keras.layers.Dense(1),
    ]
)
generator = keras.Sequential(
    [
        keras.Input((LATENT,)),
        keras.layers.Dense(28 * 28, "sigmoid"),
        keras.layers.Reshape((28, 28, 1)),
    ]
)
gan = GAN(discriminator=discriminator, generator=generator)
gan.compile(
    d_optimizer=hvdkit.DistributedOptimizer(keras.optimizers.Adam(3e-4)),  # hvdkit
    g_optimizer=hvdkit.DistributedOptimizer(keras.optimizers.Adam(3e-4)),  # hvdkit
    loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
)
images, _ = digits(256, seed=0)
noise = np.random.default_rng(4).normal(size=(256, LATENT)).astype("float32")


class PrintLosses(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if hvdkit.rank() == 0:  # hvdkit
            print(f"epoch {epoch}: d_loss {logs['d_loss']:.5f} g_loss {logs['g_loss']:.5f}")


gan.fit(
    mine(images),  # hvdkit: this rank's rows
    mine(noise),
    batch_size=per_rank(32),  # hvdkit: the global batch stays 32
    epochs=2,
    shuffle=False,
    verbose=0,
    callbacks=[
        hvdkit.callbacks.BroadcastGlobalVariablesCallback(0),  # hvdkit
        hvdkit.callbacks.MetricAverageCallback(),  # hvdkit
        PrintLosses(),
    ],
)
