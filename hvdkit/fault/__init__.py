"""Fault tolerance: checkpoints, preemption, in-process elastic recovery.

Public names are re-exported by :mod:`hvdkit` (``hvdkit.Checkpointer``,
``hvdkit.elastic``, ``hvdkit.preemption``).
"""
