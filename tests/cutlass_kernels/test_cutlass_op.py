"""The CUDA implementation of ``tilesparse::tw_linear`` (``build._op_impl``) without a GPU:
it runs the same argument and layout checks as the CPU implementation, and packs a layer's
weight once (again only after its tensors change). Called directly on CPU tensors, with the
kernel launch replaced by a stand-in where a launch would happen."""

from __future__ import annotations

import gc

import pytest
import torch

from cutlass_kernels import build, reference
from tilesparse.format import TWLayout, condense

REAL_PACK_WEIGHT = reference.pack_weight


def _layout(dtype: torch.dtype = torch.float32, seed: int = 0) -> TWLayout:
    gen = torch.Generator().manual_seed(seed)
    lay = condense(torch.randint(-3, 4, (8, 6), generator=gen).float(), torch.rand(8, 6, generator=gen) < 0.5, 4)
    lay.values = lay.values.to(dtype)
    return lay


def _call(x: torch.Tensor, lay: TWLayout, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    return build._op_impl(x, lay.col_idx, lay.tile_ptr, lay.row_idx, lay.row_ptr, lay.values,
                          lay.val_ptr, bias, lay.out_features, backend)


@pytest.mark.parametrize("backend", ["auto", "reference", "emulated", "cutlass"])
def test_op_impl_checks_its_arguments(backend) -> None:
    lay = _layout()
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="x has dtype torch.float32 but the layer's values are torch.float64"):
        _call(x, _layout(torch.float64), None, backend)
    with pytest.raises(ValueError, match="needs a contiguous x"):
        _call(torch.randn(8, 3).T, lay, None, backend)
    with pytest.raises(ValueError, match=r"bias must have shape \(6,\), got \(5,\)"):
        _call(x, lay, torch.zeros(5), backend)
    with pytest.raises(ValueError, match="bias has dtype torch.float64 but x has torch.float32"):
        _call(x, lay, torch.zeros(6, dtype=torch.float64), backend)
    with pytest.raises(ValueError, match=r"takes x of shape \(M, K\)"):
        _call(torch.randn(2, 3, 8), lay, None, backend)


@pytest.mark.parametrize("backend", ["auto", "reference", "emulated"])
def test_op_impl_refuses_a_corrupt_layout(backend) -> None:
    x = torch.ones(2, 8)
    lay = _layout()
    lay.tile_ptr = lay.tile_ptr + 1  # starts at 1: the first column silently dropped before
    with pytest.raises(ValueError, match=r"tile_ptr must start at 0, got tile_ptr\[0\]=1"):
        _call(x, lay, None, backend)
    lay = _layout()
    lay.row_ptr = lay.row_ptr.clone()
    lay.row_ptr[0] = -2
    with pytest.raises(ValueError, match=r"row_ptr must start at 0, got row_ptr\[0\]=-2"):
        _call(x, lay, None, backend)
    lay = _layout()
    lay.row_idx = lay.row_idx.clone()
    lay.row_idx[0] = 8
    with pytest.raises(ValueError, match=r"row_idx must lie in \[0, K=8\)"):
        _call(x, lay, None, backend)


def test_op_impl_backend_rules() -> None:
    lay = _layout()
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="unknown tw_linear backend 'fast'"):
        _call(x, lay, None, "fast")
    with pytest.raises(ValueError, match="backend 'cpu' is the CPU kernel"):
        _call(x, lay, None, "cpu")
    with pytest.raises(ValueError, match="backend 'cutlass' runs on CUDA tensors"):
        _call(x.half(), _layout(torch.float16), None, "cutlass")
    # the device rule itself, for a tensor that is not on the CPU (meta: no data, no GPU)
    meta = [t.to("meta") for t in (x, lay.col_idx, lay.tile_ptr, lay.row_idx, lay.row_ptr, lay.values, lay.val_ptr)]
    with pytest.raises(ValueError, match="backend 'cpu' runs on CPU tensors, got a meta tensor"):
        build._op_impl(*meta, None, 6, "cpu")


@pytest.fixture
def counted(monkeypatch):
    """(pack_weight calls, launches): pack_weight counted, the kernel launch a stand-in."""
    packs: list[int] = []
    launches: list[reference.TWLaunch] = []

    def pack(layout, *args, **kwargs):
        packs.append(layout.num_tiles)  # (not the layout: the test checks what is freed)
        return REAL_PACK_WEIGHT(layout, *args, **kwargs)

    def launch(launch, kernel=None):
        launches.append(launch)
        return launch.yt

    monkeypatch.setattr(reference, "pack_weight", pack)
    monkeypatch.setattr(build, "tw_gemm_kmajor", launch)
    return packs, launches


def test_op_impl_packs_a_layer_once_and_again_after_an_edit(counted) -> None:
    packs, launches = counted
    lay = _layout(torch.float16)
    x = torch.randn(4, 8).half()
    for _ in range(3):
        _call(x, lay, None, "auto")
    assert len(packs) == 1 and len(launches) == 3
    assert all(launch.weight is launches[0].weight for launch in launches)
    lay.values.add_(1)  # in place: the version counter moves
    _call(x, lay, None, "auto")
    assert len(packs) == 2
    assert torch.equal(launches[-1].weight.w, REAL_PACK_WEIGHT(lay).w)  # the new values
    lay.row_idx = lay.row_idx.clone()  # same content, another tensor
    _call(x, lay, None, "auto")
    _call(x, lay, None, "auto")
    assert len(packs) == 3
    _call(x, lay, None, "reference")  # the reference needs no packed weight
    assert len(packs) == 3


def test_packed_weight_follows_the_layout_tensors(counted) -> None:
    packs, _ = counted
    lay = _layout(torch.float16)
    first = build.packed_weight(lay, torch.float16, "cpu")
    assert build.packed_weight(lay, torch.float16, "cpu") is first and len(packs) == 1
    build.packed_weight(lay, torch.float32, "cpu")  # another dtype: its own pack
    assert len(packs) == 2
    lay.values.mul_(2)
    again = build.packed_weight(lay, torch.float16, "cpu")
    assert again is not first and len(packs) == 3
    assert torch.equal(again.w, 2 * first.w)


def test_a_packed_weight_leaves_with_its_values(counted) -> None:
    lay = _layout(torch.float16)
    x = torch.randn(2, 8).half()
    build.packed_weight(lay, torch.float16, "cpu")
    key = id(lay.values)
    assert key in build._PACKED
    del lay
    gc.collect()
    assert key not in build._PACKED
    lay = _layout(torch.float16)
    _call(x, lay, None, "auto")
    key = id(lay.values)
    assert key in build._PACKED
    del lay
    gc.collect()
    assert key not in build._PACKED
