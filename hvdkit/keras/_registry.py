"""Keras finds ``DistributedOptimizer`` in saved models as soon as hvdkit is imported.

A ``.keras`` file of a model compiled with ``hvdkit.DistributedOptimizer``
names the class ``hvdkit>DistributedOptimizer``; ``keras.models.load_model``
looks that name up in Keras's registry of custom objects. The class itself
is registered when :mod:`hvdkit.optimizer` is imported, which imports
TensorFlow; ``import hvdkit`` must stay cheap (``hvdkitrun`` starts without
TensorFlow), so it imports neither. Instead, ``import hvdkit`` puts a small
stand-in under that name whose ``from_config`` imports the real class and
builds it. If Keras is not imported yet, the stand-in is registered right
after Keras's own import finishes (an import hook that removes itself
then); nothing else about that import changes.

No TensorFlow here, and nothing of Keras beyond its public registry
(``keras.saving.get_custom_objects``), which works while TensorFlow itself
is still importing Keras.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

# what @keras.saving.register_keras_serializable(package="hvdkit") calls the class
REGISTERED_NAME = "hvdkit>DistributedOptimizer"


class _DistributedOptimizerEntry:
    """Keras's registry entry for ``DistributedOptimizer`` until hvdkit.optimizer is imported."""

    @staticmethod
    def from_config(config, custom_objects=None):
        from ..optimizer import DistributedOptimizer  # registers the real class over this entry

        return DistributedOptimizer.from_config(config, custom_objects=custom_objects)


def _register(keras_module) -> None:
    registry = keras_module.saving.get_custom_objects()
    registry.setdefault(REGISTERED_NAME, _DistributedOptimizerEntry)


class _AfterKerasImport(importlib.abc.MetaPathFinder):
    """Finds ``keras`` through the other finders and registers the entry once it has run.

    It stays in ``sys.meta_path`` until Keras has been imported: TensorFlow
    asks for Keras's spec (``importlib.util.find_spec``) before it imports it.
    """

    def __init__(self):
        self._searching = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "keras" or self._searching:
            return None
        self._searching = True  # the other finders, not this one again
        try:
            spec = importlib.util.find_spec("keras")
        finally:
            self._searching = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            try:
                _register(module)
            except AttributeError:  # a Keras without keras.saving (Keras 2): nothing to register
                pass

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register the entry now if Keras is imported, else right after Keras is imported."""
    keras_module = sys.modules.get("keras")
    if keras_module is not None and hasattr(keras_module, "saving"):
        _register(keras_module)
    elif keras_module is None and not any(isinstance(f, _AfterKerasImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterKerasImport())
