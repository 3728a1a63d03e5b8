"""Data derived from a condensed layout's tensors, kept while those very tensors live unchanged.

``tilesparse::tw_linear`` receives the layout as bare tensors (its schema has no layout object),
yet its implementations derive costly things from them that do not change between calls of one
layer: the check that the indices are a valid layout (a few dozen small tensor ops with host
syncs, ~170 us for a 1024x1024 layer at G=128 on one thread of an AMD EPYC: more than the CPU
kernel at small M) and the CUDA kernel's packed weight (more than the kernel at small batches).
:class:`LayoutCache` keeps such data per set of tensors::

    record key   id(anchor)                      the first tensor of the set
    record       stamp  = (t._version for t in tensors) + extra ints (e.g. K, N)
                 refs   = weak references to the tensors (a new tensor is not the old one,
                          whatever its id)
                 values = {key: derived value}   e.g. (dtype, device, max tile width) -> pack

A lookup whose tensors are not the recorded objects, or whose stamp differs (an in-place edit
bumps a tensor's version), starts a fresh record. A record leaves when its anchor tensor is
freed. Inference-mode tensors have no version counter: nothing is cached for them, the value is
computed on every call.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

__all__ = ["LayoutCache"]

V = TypeVar("V")


@dataclass
class _Record(Generic[V]):
    stamp: tuple[int, ...]
    refs: tuple[weakref.ref[torch.Tensor], ...]
    values: dict[Hashable, V] = field(default_factory=dict)


class LayoutCache(Generic[V]):
    """Values derived from a set of layout tensors, by key (see the module docstring).

    >>> cache: LayoutCache[int] = LayoutCache()
    >>> t = torch.arange(3)
    >>> cache.get((t,), (), "sum", lambda: int(t.sum()))
    3
    >>> t += 1  # an in-place edit: computed again
    >>> cache.get((t,), (), "sum", lambda: int(t.sum()))
    6
    >>> key = id(t); del t  # the record leaves with its anchor
    >>> key in cache
    False
    """

    def __init__(self) -> None:
        self._records: dict[int, _Record[V]] = {}

    def get(
        self,
        tensors: Sequence[torch.Tensor],
        extra: tuple[int, ...],
        key: Hashable,
        compute: Callable[[], V],
    ) -> V:
        """The value of ``key`` for ``tensors``, from ``compute()`` when not recorded.

        Args:
            tensors: the layout tensors the value is derived from; ``tensors[0]`` is the
                anchor (the record leaves with it).
            extra: further integers the value depends on (e.g. ``K``, ``N``).
            key: which value of the record (e.g. a dtype and device).
            compute: makes the value; its exceptions propagate and nothing is recorded.
        """
        try:
            stamp = (*(t._version for t in tensors), *extra)
        except RuntimeError:  # inference-mode tensors have no version counter
            return compute()
        anchor = id(tensors[0])
        rec = self._records.get(anchor)
        if (
            rec is None
            or rec.stamp != stamp
            or any(r() is not t for r, t in zip(rec.refs, tensors))
        ):
            forget = functools.partial(self._forget, anchor)
            refs = (weakref.ref(tensors[0], forget), *(weakref.ref(t) for t in tensors[1:]))
            rec = _Record(stamp, refs)
            self._records[anchor] = rec
        if key not in rec.values:
            rec.values[key] = compute()
        return rec.values[key]

    def _forget(self, anchor: int, _ref: weakref.ref[torch.Tensor]) -> None:
        self._records.pop(anchor, None)

    def __contains__(self, anchor_id: object) -> bool:
        """Whether a record exists for the anchor tensor whose ``id()`` is ``anchor_id``."""
        return anchor_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def clear(self) -> None:
        """Drop every record."""
        self._records.clear()
