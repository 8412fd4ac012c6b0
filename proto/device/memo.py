"""Values remembered per object while that object lives (no dependencies: the launch path's
modules at every level use it)."""
from __future__ import annotations

import weakref


class PerObject:
    """Values computed from an array object and remembered while that object lives. Eager
    launches and captures ask for the same arrays' byte ranges and views again and again,
    and an array's address, shape and strides never change. A hit must be the very object:
    an id can be reused once its object is gone, and an entry leaves with its object (a
    remembered view must not keep device memory alive)."""

    def __init__(self):
        self._values: dict = {}

    def get(self, obj, key, make):
        k = (id(obj), key)
        hit = self._values.get(k)
        if hit is not None and hit[0]() is obj:
            return hit[1]
        value = make()
        values = self._values
        try:
            ref = weakref.ref(obj, lambda _, k=k: values.pop(k, None))
        except TypeError:   # an object without weak references: not remembered
            return value
        values[k] = (ref, value)
        return value
