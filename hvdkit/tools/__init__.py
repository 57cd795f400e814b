"""The ``hvdkit`` command's tools, built on the library, not part of it (no public API).

``doctor`` (``hvdkit doctor``: what this environment can do, with the fix for
each problem; ``_doctor_probe`` is the 2-process job it launches) and
``install_horovod`` (``hvdkit install-horovod``: build Horovod for the
installed TensorFlow). Neither imports TensorFlow, Keras or Horovod itself,
so they can say what is wrong when those are broken.
"""
