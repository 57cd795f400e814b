"""The Keras integration: callbacks, saving and loading, synchronized batch norm.

Public names are re-exported by :mod:`hvdkit` (``hvdkit.callbacks``,
``hvdkit.save_model``, ``hvdkit.SyncBatchNormalization``).
"""
