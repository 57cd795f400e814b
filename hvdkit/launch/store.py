"""The rendezvous server's key-value store: Horovod's dict of scopes, counted and versioned.

Horovod's rendezvous server keeps its store in ``server.cache``, a dict of scope
name -> dict of key -> value, changed by Horovod's handler (``setdefault`` a
scope, set a key, ``clear`` a scope, delete a key or a scope) and by hvdkit's
guard, always under ``server.cache_lock``. :class:`Store` is that dict, with
every change of it counted as it happens, so that the guard's check of the
store's bounds before each PUT (``MAX_KEYS``, ``MAX_STORED_BYTES``) is O(1)
instead of a sum over the whole store; and every change of a scope gives it a
new :attr:`Scope.version` (never used before in this store), so that an answer
computed from a scope's values (the batched mesh's parse, :class:`.mesh.MeshGrid`)
is known stale without comparing the values.

Example::

    >>> store = Store()
    >>> store.setdefault("global", {})["0"] = b"addr"
    >>> store.setdefault("global", {})["1"] = b"xy"
    >>> store.keys_held, store.bytes_held
    (2, 6)
    >>> v = store.version("global")
    >>> del store["global"]["0"]
    >>> (store.keys_held, store.bytes_held), store.version("global") > v
    ((1, 2), True)
    >>> store.version("absent") is None
    True
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping

_NO_DEFAULT = object()


class _SetItemByItem(dict):
    """A dict whose ``update`` and ``|=`` set each item through its own ``__setitem__``
    (``dict``'s own would bypass it)."""

    def update(self, items=(), /, **more) -> None:
        for key, value in dict(items, **more).items():
            self[key] = value

    def __ior__(self, items):
        self.update(items)
        return self


class Scope(_SetItemByItem):
    """One scope's key -> value (``bytes``): each change is counted by its store and versions it."""

    def __init__(self, store: Store, items: Mapping | Iterable = ()):
        super().__init__()
        self._store = store
        self.version = store.tick()
        self.update(items)

    def __setitem__(self, key, value) -> None:
        old = dict.get(self, key)
        super().__setitem__(key, value)
        self._changed(0 if old is not None else 1, len(value) - (len(old) if old else 0))

    def __delitem__(self, key) -> None:
        value = dict.pop(self, key)
        self._changed(-1, -len(value))

    def pop(self, key, default=_NO_DEFAULT):
        if key in self:
            value = dict.pop(self, key)
            self._changed(-1, -len(value))
            return value
        if default is _NO_DEFAULT:
            raise KeyError(key)
        return default

    def popitem(self):
        key, value = dict.popitem(self)
        self._changed(-1, -len(value))
        return key, value

    def clear(self) -> None:
        keys, size = len(self), sum(map(len, self.values()))
        super().clear()
        self._changed(-keys, -size)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return dict.__getitem__(self, key)

    def _changed(self, keys: int, size: int) -> None:
        self._store.counted(keys, size)
        self.version = self._store.tick()


class Store(_SetItemByItem):
    """Scope name -> :class:`Scope`; :attr:`keys_held` and :attr:`bytes_held` of all its scopes.

    Any dict given to it as a scope (Horovod's ``cache.setdefault(scope, {})``)
    becomes a :class:`Scope` with the same items. Changed only under the
    server's ``cache_lock``; the counters are then read without it.
    """

    def __init__(self):
        super().__init__()
        self.keys_held = 0
        self.bytes_held = 0
        self._ticks = itertools.count()

    def tick(self) -> int:
        """A version number no scope of this store had before."""
        return next(self._ticks)

    def counted(self, keys: int, size: int) -> None:
        self.keys_held += keys
        self.bytes_held += size

    def version(self, name: str) -> int | None:
        """The current version of scope ``name``; None when there is no such scope."""
        scope = self.get(name)
        return None if scope is None else scope.version

    def __setitem__(self, name, items) -> None:
        if name in self:
            del self[name]
        super().__setitem__(name, Scope(self, items))

    def __delitem__(self, name) -> None:
        self._detach(dict.pop(self, name))

    def pop(self, name, default=_NO_DEFAULT):
        if name in self:
            return self._detach(dict.pop(self, name))
        if default is _NO_DEFAULT:
            raise KeyError(name)
        return default

    def popitem(self):
        name, scope = dict.popitem(self)
        return name, self._detach(scope)

    def clear(self) -> None:
        for scope in self.values():
            self._detach(scope)
        super().clear()

    def _detach(self, scope: Scope) -> Scope:
        """``scope``, taken out: its counts leave the store, its later changes count elsewhere."""
        self.counted(-len(scope), -sum(map(len, scope.values())))
        scope._store = Store()
        return scope

    def setdefault(self, name, default=None):
        if name not in self:
            self[name] = default or {}
        return dict.__getitem__(self, name)
