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


class OnDemandDict(dict):
    """A dict whose contents are part `index` of builder's result, loaded on first access."""

    def __init__(self, builder: Builder, index: int):
        super().__init__()
        self._builder, self._index, self._filled = builder, index, False

    def _fill(self):
        if not self._filled:
            self._filled = True
            super().update(self._builder.get()[self._index])

    def __getitem__(self, k):
        self._fill()
        return super().__getitem__(k)

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self):
        self._fill()
        return super().__len__()

    def __contains__(self, k):
        self._fill()
        return super().__contains__(k)

    def __bool__(self):
        self._fill()
        return super().__len__() > 0

    def __repr__(self):
        self._fill()
        return super().__repr__()

    def __eq__(self, other):
        self._fill()
        return super().__eq__(other)

    __hash__ = None

    def get(self, k, default=None):
        self._fill()
        return super().get(k, default)

    def keys(self):
        self._fill()
        return super().keys()

    def values(self):
        self._fill()
        return super().values()

    def items(self):
        self._fill()
        return super().items()

    def copy(self):
        self._fill()
        return dict(super().items())


class OnDemandList(list):
    """A list whose items are part `index` of builder's result, loaded on first access."""

    def __init__(self, builder: Builder, index: int):
        super().__init__()
        self._builder, self._index, self._filled = builder, index, False

    def _fill(self):
        if not self._filled:
            self._filled = True
            super().extend(self._builder.get()[self._index])

    def __getitem__(self, i):
        self._fill()
        return super().__getitem__(i)

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __len__(self):
        self._fill()
        return super().__len__()

    def __bool__(self):
        self._fill()
        return super().__len__() > 0

    def __repr__(self):
        self._fill()
        return super().__repr__()

    def __eq__(self, other):
        self._fill()
        return super().__eq__(other)

    __hash__ = None
