"""LayoutCache: a value per set of layout tensors, computed again after any of them is replaced
or edited in place, dropped with its anchor tensor; nothing cached for inference tensors."""

from __future__ import annotations

import doctest
import gc

import pytest
import torch

from tilesparse.kernels import cache
from tilesparse.kernels.cache import LayoutCache


def test_module_doctest_runs() -> None:
    assert doctest.testmod(cache).failed == 0


def _counted(cache: LayoutCache[int], tensors: tuple[torch.Tensor, ...], key: str = "k") -> int:
    calls: list[int] = []

    def compute() -> int:
        calls.append(1)
        return int(sum(int(t.sum()) for t in tensors))

    cache.get(tensors, (len(tensors[0]),), key, compute)
    return len(calls)


def test_a_value_is_computed_once_per_key_and_again_after_a_change() -> None:
    c: LayoutCache[int] = LayoutCache()
    a, b = torch.arange(4), torch.arange(3)
    assert _counted(c, (a, b)) == 1
    assert _counted(c, (a, b)) == 0  # cached
    assert _counted(c, (a, b), "other") == 1  # another key of the same record
    b.add_(1)  # an in-place edit of a non-anchor tensor bumps its version
    assert _counted(c, (a, b)) == 1
    b2 = b.clone()  # the same values in another tensor
    assert _counted(c, (a, b2)) == 1
    assert _counted(c, (a, b2)) == 0
    assert len(c) == 1


def test_a_record_leaves_with_its_anchor() -> None:
    c: LayoutCache[int] = LayoutCache()
    a, b = torch.arange(4), torch.arange(3)
    _counted(c, (a, b))
    key = id(a)
    assert key in c
    del b  # not the anchor: the record stays
    gc.collect()
    assert key in c
    del a
    gc.collect()
    assert key not in c and len(c) == 0


def test_a_failed_computation_records_nothing() -> None:
    c: LayoutCache[int] = LayoutCache()
    a = torch.arange(4)

    def fail() -> int:
        raise ValueError("bad layout")

    with pytest.raises(ValueError, match="bad layout"):
        c.get((a,), (), "k", fail)
    assert c.get((a,), (), "k", lambda: 7) == 7


def test_inference_tensors_are_computed_every_time() -> None:
    c: LayoutCache[int] = LayoutCache()
    with torch.inference_mode():
        a = torch.arange(4)
    assert _counted(c, (a,)) == 1
    assert _counted(c, (a,)) == 1
    assert len(c) == 0
    c.clear()
