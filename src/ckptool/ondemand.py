"""Containers that fill themselves the first time they are used.

A reader that can offer optimizer state builds its slots (three lazy tensors per parameter, each a
graph of narrows and concats) only when someone asks for them: `inspect` and a weights-only
conversion never pay for them. One builder fills a dict and a list together (the slots and the
param groups come from the same pass).
"""
from __future__ import annotations

from typing import Any, Callable, Tuple


class Builder:
    """Runs build() once; its result is shared by the containers that wait on it."""

    def __init__(self, build: Callable[[], Tuple[Any, ...]]):
        self._build = build
        self._value = None

    def get(self):
        if self._value is None:
            self._value = self._build()
        return self._value


def _filled_first(base: type, names) -> dict:
    """base's methods `names`, each filling the container before it runs."""
    def wrap(name):
        method = getattr(base, name)

        def filled(self, *args, **kwargs):
            self._fill()
            return method(self, *args, **kwargs)
        filled.__name__ = name
        return filled
    return {name: wrap(name) for name in names}


_READS = ("__getitem__", "__iter__", "__len__", "__contains__", "__repr__", "__eq__")


class _OnDemand:
    """What the dict and the list share: the part `index` of builder's result is added (`_add`, the
    base type's own update/extend) the first time anything reads the container."""
    _base: type
    _add: Callable

    def __init__(self, builder: Builder, index: int):
        self._base.__init__(self)
        self._builder, self._index, self._filled = builder, index, False

    def _fill(self):
        if not self._filled:
            self._filled = True
            self._add(self._builder.get()[self._index])

    __hash__ = None

    def __bool__(self):
        self._fill()
        return self._base.__len__(self) > 0


class OnDemandDict(_OnDemand, dict):
    """A dict whose contents are part `index` of builder's result, loaded on first access."""
    _base, _add = dict, dict.update

    def copy(self):
        self._fill()
        return dict(dict.items(self))


class OnDemandList(_OnDemand, list):
    """A list whose items are part `index` of builder's result, loaded on first access."""
    _base, _add = list, list.extend


for _cls, _names in ((OnDemandDict, _READS + ("get", "keys", "values", "items")), (OnDemandList, _READS)):
    for _name, _method in _filled_first(_cls._base, _names).items():
        setattr(_cls, _name, _method)
