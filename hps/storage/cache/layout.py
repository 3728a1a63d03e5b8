"""The layout clock of the caches: a process-wide number that moves whenever any cache replaces
one of the arrays the compiled fused pass reads (its slot keys, high words and their nibbles,
dense key index, tags, counters, storage, row format or row width).

A reader that holds those arrays across calls (:class:`hps.fused.CompiledTables`) records
:func:`layout_now` when it takes them and takes them again once the clock has moved: one
comparison per call, where checking each array of 26 caches would cost more than the call's
own per-table work. The arrays are replaced only under the cache's lock (a compact cache's
new high word, its keys widened to int64) or between calls (a caller re-storing rows), and a
fused call reads the clock with every cache's lock held.
"""

from __future__ import annotations

import itertools
from typing import Any, Generic, TypeVar, overload

__all__ = ["LayoutField", "layout_now"]

_T = TypeVar("_T")
_ticks = itertools.count(1)  # next() on a count is one atomic step under the GIL
_now = [0]


def layout_now() -> int:
    """The layout clock: equal to an earlier reading only if no cache replaced an array since."""
    return _now[0]


class LayoutField(Generic[_T]):
    """An attribute of a cache (or of its keys) that the compiled pass reads: assigning it
    moves the layout clock (:func:`layout_now`). The value lives in the instance's own
    ``__dict__`` under the same name."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, objtype: type | None = None) -> LayoutField[_T]: ...

    @overload
    def __get__(self, obj: object, objtype: type | None = None) -> _T: ...

    def __get__(self, obj: object, objtype: type | None = None) -> _T | LayoutField[_T]:
        if obj is None:
            return self  # the class attribute: the descriptor
        try:
            value: _T = obj.__dict__[self.name]
        except KeyError:
            raise AttributeError(self.name) from None
        return value

    def __set__(self, obj: Any, value: _T) -> None:
        obj.__dict__[self.name] = value
        _now[0] = next(_ticks)
