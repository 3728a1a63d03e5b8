"""The leaf's own API on plain tensors: the package doctest, the index checks of
``pack_weight``, and ``tw_linear_packed`` on a faked device (the extension's launch emulated)."""

from __future__ import annotations

import doctest

import pytest
import torch

import cutlass_kernels
from cutlass_kernels import launch
from cutlass_kernels.manifest import Arch, manifest
from cutlass_kernels.reference import check_weight, pack_weight
from tests.cutlass_kernels.fake_device import fake_device
from tests.cutlass_kernels.layouts import random_layout
from tilesparse.format import reference_matmul


def test_package_doctest_and_public_names() -> None:
    assert doctest.testmod(cutlass_kernels).failed == 0
    missing = [n for n in cutlass_kernels.__all__ if not hasattr(cutlass_kernels, n)]
    assert not missing


@pytest.mark.parametrize(
    ("field", "edit", "message"),
    [
        ("col_idx", lambda t: t.int(), "col_idx must be a 1-D int64 tensor"),
        ("row_ptr", lambda t: t[:-1], r"must have T\+1 >= 1 entries each"),
        ("col_idx", lambda t: t + 100, r"col_idx out of range \[0, 41\)"),
        ("row_idx", lambda t: t - 100, r"row_idx out of range \[0, 33\)"),
        ("col_idx", lambda t: t.flip(0), "col_idx must be strictly ascending"),
        ("tile_ptr", lambda t: t + 1, "tile_ptr must run from 0 to"),
        ("val_ptr", lambda t: t * 2, "val_ptr must run from 0 to"),
        ("values", lambda t: t.view(-1, 1), "values must be 1-D"),
    ],
)
def test_pack_weight_refuses_indices_the_kernel_cannot_run(field, edit, message) -> None:
    layout = random_layout(33, 41, 8, 0.8, 0.5, False, 2)
    setattr(layout, field, edit(getattr(layout, field)))
    with pytest.raises(ValueError, match=message):
        check_weight(layout)
    with pytest.raises(ValueError, match=message):
        pack_weight(layout)


def test_unsorted_rows_of_a_tile_are_refused() -> None:
    layout = random_layout(33, 41, 8, 0.8, 1.0, False, 2)  # every tile keeps every row
    layout.row_idx = layout.row_idx.clone()
    layout.row_idx[[0, 1]] = layout.row_idx[[1, 0]]
    with pytest.raises(ValueError, match="rows of every tile must be strictly ascending"):
        pack_weight(layout)


@pytest.mark.parametrize("arch", [Arch.SM90A, Arch.SM80])
def test_tw_linear_packed_equals_the_reference_exactly(monkeypatch, arch) -> None:
    ext = fake_device(monkeypatch, arch)
    layout = random_layout(40, 300, 64, 0.9, 0.5, True, 7)
    layout.values = layout.values.half()
    x = torch.randint(-1, 2, (2, 5, 40)).half()
    bias = torch.randint(-2, 3, (300,)).half()
    want = reference_matmul(x, layout, bias)
    limit = launch.tile_limit(torch.float16)
    assert limit == 128
    pw = pack_weight(layout, dtype=torch.float16, max_tile_width=limit)
    assert torch.equal(launch.tw_linear_packed(x, pw, bias), want)
    g64 = next(k for k in manifest(arch) if k.tile_g == 64 and k.dtype.value == "f16")
    assert torch.equal(launch.tw_linear_packed(x, pw, bias, kernel=g64), want)
    assert ext.calls[-1] == g64.name
    with pytest.raises(ValueError, match="x has 39 features, the layer expects 40"):
        launch.tw_linear_packed(x[..., :39], pw)
