"""Cluster environments that start hvdkit's ranks themselves: one module per cluster.

:mod:`~hvdkit.clusters.slurm` (``srun``'s tasks, requeue), :mod:`~hvdkit.clusters.spark`
(a barrier stage: ``hvdkit.spark.run``), :mod:`~hvdkit.clusters.ray` (actors:
``hvdkit.ray.run``). What they share, a Gloo world whose hosts are known up
front, is :mod:`~hvdkit.clusters._world`. None of them imports TensorFlow.
"""
