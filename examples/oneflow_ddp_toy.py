"""Port of OneFlow's data-parallel (DDP) toy: two ranks fit y = x @ w, and w becomes [[2], [3]].

Each of the 2 ranks trains on its own two samples (``train_x[rank]``,
``train_y[rank]``, all on the plane ``y = 2 x1 + 3 x2``); the gradients are
averaged (OneFlow's ``DistributedDataParallel``, here
``hvdkit.DistributedGradientTape``), so both ranks end with the same
``w`` = ``[[2], [3]]``. OneFlow launches it with
``python3 -m oneflow.distributed.launch --nproc_per_node 2 ddp_train.py``;
here:

    horovodrun -np 2 --gloo python examples/oneflow_ddp_toy.py     # or --mpi, or hvdkitrun -np 2

Lines that differ from the tutorial are marked ``# hvdkit:``.
"""

import tensorflow as tf

import hvdkit  # hvdkit: was oneflow and oneflow.nn.parallel.DistributedDataParallel

hvdkit.init()  # hvdkit: the launcher's process group, before any TensorFlow op

train_x = [
    tf.constant([[1, 2], [2, 3]], dtype=tf.float32),
    tf.constant([[4, 6], [3, 1]], dtype=tf.float32),
]
train_y = [
    tf.constant([[8], [13]], dtype=tf.float32),
    tf.constant([[26], [9]], dtype=tf.float32),
]


class Model(tf.Module):
    def __init__(self):
        super().__init__()
        self.lr = 0.01
        self.iter_count = 500
        self.w = tf.Variable([[0.0], [0.0]])

    def __call__(self, x):
        return tf.matmul(x, self.w)


m = Model()  # hvdkit: no .to("cuda"): CPU here


def loss(y_pred, y):  # flow.nn.MSELoss(reduction="sum")
    return tf.reduce_sum(tf.square(y_pred - y))


optimizer = tf.keras.optimizers.SGD(m.lr)

for i in range(0, m.iter_count):
    rank = hvdkit.rank()  # hvdkit: was flow.env.get_rank()
    x = train_x[rank]
    y = train_y[rank]

    with tf.GradientTape() as tape:
        y_pred = m(x)
        l = loss(y_pred, y)  # noqa: E741  (the tutorial's name)
    if (i + 1) % 50 == 0:
        print(f"{i + 1}/{m.iter_count} loss:{float(l)}")

    tape = hvdkit.DistributedGradientTape(tape)  # hvdkit: DDP averages the gradients
    grads = tape.gradient(l, [m.w])
    optimizer.apply(grads, [m.w])

print(f"\nw:{m.w.numpy().tolist()}")  # hvdkit: printed as a list
