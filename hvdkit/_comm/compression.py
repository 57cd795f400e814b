"""Gradient compression applied around the allreduce (Horovod's ``Compression``)."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["Compression", "Compressor", "NoneCompressor", "FP16Compressor"]


class Compressor:
    """Turns a tensor into what is sent, and what is received back into a tensor."""

    name = "base"

    @staticmethod
    def compress(tensor: tf.Tensor) -> tuple[tf.Tensor, tf.DType | None]:
        """Returns ``(tensor_to_send, context_for_decompress)``."""
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: tf.Tensor, ctx: tf.DType | None) -> tf.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Sends tensors unchanged."""

    name = "none"

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Sends float32/float64 tensors as float16, halving the bytes on the wire.

    Values beyond float16's range (about ±65504) overflow to inf and tiny
    ones lose precision; integer and float16 tensors are sent unchanged.
    """

    name = "fp16"

    @staticmethod
    def compress(tensor):
        if tensor.dtype in (tf.float32, tf.float64):
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Available compressors: ``Compression.none`` and ``Compression.fp16``.

    Example:
        >>> opt = hvdkit.DistributedOptimizer(opt, compression=hvdkit.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor

    @classmethod
    def by_name(cls, name: str) -> type[Compressor]:
        from ..errors import ConfigurationError

        for comp in (cls.none, cls.fp16):
            if comp.name == name:
                return comp
        raise ConfigurationError(
            f"unknown compression {name!r}; use hvdkit.Compression.none or hvdkit.Compression.fp16."
        )
