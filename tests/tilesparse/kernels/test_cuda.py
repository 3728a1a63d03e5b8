"""The CUDA implementation of ``tilesparse::tw_linear`` (``cuda._op_impl``) without a GPU:
it runs the same argument and layout checks as the CPU implementation, and packs a layer's
weight once (again only after its tensors change). Called directly on CPU tensors, with the
device queries faked and the kernel launch replaced by a stand-in where a launch would happen
(the compiled extension's ``tw_gemm`` by the CPU emulation of the arguments it receives)."""

from __future__ import annotations

import gc

import pytest
import torch

from cutlass_kernels import launch as launcher
from cutlass_kernels import reference
from cutlass_kernels.manifest import Arch, manifest
from tests.cutlass_kernels.fake_device import fake_device
from tests.cutlass_kernels.layouts import random_layout
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.kernels import cuda
from tilesparse.linear import TileSparseLinear

REAL_PACK_WEIGHT = reference.pack_weight


def _layout(dtype: torch.dtype = torch.float32, seed: int = 0) -> TWLayout:
    gen = torch.Generator().manual_seed(seed)
    lay = condense(
        torch.randint(-3, 4, (8, 6), generator=gen).float(),
        torch.rand(8, 6, generator=gen) < 0.5,
        4,
    )
    lay.values = lay.values.to(dtype)
    return lay


def _call(x: torch.Tensor, lay: TWLayout, bias: torch.Tensor | None, backend: str) -> torch.Tensor:
    return cuda._op_impl(
        x,
        lay.col_idx,
        lay.tile_ptr,
        lay.row_idx,
        lay.row_ptr,
        lay.values,
        lay.val_ptr,
        bias,
        lay.out_features,
        backend,
    )


@pytest.mark.parametrize("backend", ["auto", "reference", "emulated", "cutlass"])
def test_op_impl_checks_its_arguments(backend) -> None:
    lay = _layout()
    x = torch.randn(3, 8)
    with pytest.raises(
        ValueError, match="x has dtype torch.float32 but the layer's values are torch.float64"
    ):
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
    lay.tile_ptr = lay.tile_ptr + 1  # starts at 1: unchecked, the first column would be dropped
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
    meta = [
        t.to("meta")
        for t in (x, lay.col_idx, lay.tile_ptr, lay.row_idx, lay.row_ptr, lay.values, lay.val_ptr)
    ]
    with pytest.raises(ValueError, match="backend 'cpu' runs on CPU tensors, got a meta tensor"):
        cuda._op_impl(*meta, None, 6, "cpu")


def allow_cutlass_on_cpu(monkeypatch) -> None:
    """``check_op_inputs`` refuses backend 'cutlass' for a CPU tensor: run its checks as for
    'auto' and hand back CUTLASS, as it does for a CUDA tensor."""
    from tilesparse.backend import Backend

    real = cuda.check_op_inputs

    def check(*args):
        be = real(*args[:-1], "auto" if args[-1] == "cutlass" else args[-1])
        return Backend.CUTLASS if args[-1] == "cutlass" else be

    monkeypatch.setattr(cuda, "check_op_inputs", check)


@pytest.fixture
def counted(monkeypatch):
    """(pack_weight calls, launches): pack_weight counted, the kernel launch a stand-in."""
    fake_device(monkeypatch)
    packs: list[int] = []
    launches: list[reference.TWLaunch] = []

    def pack(layout, *args, **kwargs):
        packs.append(layout.num_tiles)  # (not the layout: the test checks what is freed)
        return REAL_PACK_WEIGHT(layout, *args, **kwargs)

    def launch(launch, kernel=None):
        launches.append(launch)
        return launch.yt

    monkeypatch.setattr(reference, "pack_weight", pack)
    monkeypatch.setattr(launcher, "tw_gemm_kmajor", launch)
    return packs, launches


def test_op_impl_packs_a_layer_once_and_again_after_an_edit(counted, monkeypatch) -> None:
    packs, launches = counted
    allow_cutlass_on_cpu(monkeypatch)
    lay = _layout(torch.float16)
    x = torch.randn(4, 8).half()
    for _ in range(3):
        _call(x, lay, None, "cutlass")
    assert len(packs) == 1 and len(launches) == 3
    assert all(launch.weight is launches[0].weight for launch in launches)
    lay.values.add_(1)  # in place: the version counter moves
    _call(x, lay, None, "cutlass")
    assert len(packs) == 2
    assert torch.equal(launches[-1].weight.w, REAL_PACK_WEIGHT(lay).w)  # the new values
    lay.row_idx = lay.row_idx.clone()  # same content, another tensor
    _call(x, lay, None, "cutlass")
    _call(x, lay, None, "cutlass")
    assert len(packs) == 3
    _call(x, lay, None, "reference")  # neither the reference nor "auto" packs a weight
    _call(x, lay, None, "auto")
    assert len(packs) == 3 and len(launches) == 6


def test_packed_weight_follows_the_layout_tensors(counted) -> None:
    packs, _ = counted
    lay = _layout(torch.float16)
    first = cuda.packed_weight(lay, torch.float16, "cpu")
    assert cuda.packed_weight(lay, torch.float16, "cpu") is first and len(packs) == 1
    cuda.packed_weight(lay, torch.float32, "cpu")  # another dtype: its own pack
    assert len(packs) == 2
    lay.values.mul_(2)
    again = cuda.packed_weight(lay, torch.float16, "cpu")
    assert again is not first and len(packs) == 3
    assert torch.equal(again.w, 2 * first.w)


def test_a_packed_weight_leaves_with_its_values(counted, monkeypatch) -> None:
    allow_cutlass_on_cpu(monkeypatch)
    lay = _layout(torch.float16)
    x = torch.randn(2, 8).half()
    cuda.packed_weight(lay, torch.float16, "cpu")
    key = id(lay.values)
    assert key in cuda._PACKED
    del lay
    gc.collect()
    assert key not in cuda._PACKED
    lay = _layout(torch.float16)
    _call(x, lay, None, "cutlass")
    key = id(lay.values)
    assert key in cuda._PACKED
    del lay
    gc.collect()
    assert key not in cuda._PACKED


def _int_layer(K: int, N: int, tile: int, dtype: torch.dtype, seed: int = 0) -> TileSparseLinear:
    """A TileSparseLinear with values in {-1, 0, 1} (exact in fp16/bf16 for K <= 256), some
    columns pruned, every kept column keeping the same rows (so tiles are ``tile`` wide)."""
    gen = torch.Generator().manual_seed(seed)
    dense = torch.nn.Linear(K, N)
    with torch.no_grad():
        dense.weight.copy_(torch.randint(-1, 2, dense.weight.shape, generator=gen).float())
        dense.bias.copy_(torch.randint(-2, 3, dense.bias.shape, generator=gen).float())
    mask = torch.zeros(K, N, dtype=torch.bool)
    mask[torch.rand(K, generator=gen) < 0.6] = True
    mask[:, torch.rand(N, generator=gen) < 0.05] = False
    return TileSparseLinear.from_dense(dense, mask_kn=mask, tile=tile).to(dtype)


@pytest.mark.parametrize("arch", [Arch.SM90A, Arch.SM80])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tiles_wider_than_every_instance_run_on_the_kernel(monkeypatch, arch, dtype) -> None:
    # TileSparseConfig(tile=256) is valid, the widest instance has G = 128: the layer is packed
    # as 128-wide sub-tiles and runs on a G = 128 instance, exactly.
    ext = fake_device(monkeypatch, arch)
    allow_cutlass_on_cpu(monkeypatch)
    module = _int_layer(40, 600, 256, dtype)
    lay = module.layout
    assert int((lay.tile_ptr[1:] - lay.tile_ptr[:-1]).max()) == 256
    bias = module.bias.detach()
    for M in (1, 9, 64):
        x = torch.randint(-1, 2, (M, 40)).to(dtype)
        got = _call(x, lay, bias, "cutlass")
        assert torch.equal(got, reference_matmul(x, lay, bias)), M
    assert len(ext.calls) == 3
    assert all(next(k for k in manifest(arch) if k.name == n).tile_g == 128 for n in ext.calls), (
        ext.calls
    )
    pw = cuda.packed_weight(lay, dtype, "cpu", 128)
    assert pw.max_tile_width == 128 and pw.num_tiles > lay.num_tiles


def test_tw_linear_cuda_splits_tiles_for_an_explicit_kernel(monkeypatch) -> None:
    ext = fake_device(monkeypatch, Arch.SM80)
    module = _int_layer(24, 300, 256, torch.float16, seed=3)
    x = torch.randint(-1, 2, (2, 5, 24)).half()
    want = reference_matmul(x, module.layout, module.bias.detach())
    assert torch.equal(cuda.tw_linear_cuda(x, module.layout, module.bias.detach()), want)
    g64 = next(k for k in manifest(Arch.SM80) if k.tile_g == 64)
    assert torch.equal(
        cuda.tw_linear_cuda(x, module.layout, module.bias.detach(), kernel=g64), want
    )
    assert ext.calls[-1] == g64.name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_auto_runs_the_dense_gemm_on_a_cached_reconstruction(counted, dtype) -> None:
    # "auto" on a CUDA tensor: x @ W with W the layer's dense weight (pruned entries zero),
    # built once per set of layout tensors and again after an edit; no kernel, no packing.
    packs, launches = counted
    module = _int_layer(40, 70, 16, dtype)
    lay, bias = module.layout, module.bias.detach()
    built: list[int] = []
    real = TWLayout.to_dense
    TWLayout.to_dense = lambda self: built.append(1) or real(self)  # type: ignore[method-assign]
    try:
        x = torch.randint(-1, 2, (9, 40)).to(dtype)
        for _ in range(3):
            assert torch.equal(_call(x, lay, bias, "auto"), reference_matmul(x, lay, bias))
        assert len(built) == 1
        w = cuda.dense_weight(
            (lay.col_idx, lay.tile_ptr, lay.row_idx, lay.row_ptr, lay.values, lay.val_ptr),
            40,
            70,
            dtype,
            "cpu",
        )
        assert torch.equal(w, real(lay).to(dtype)) and len(built) == 1
        lay.values.mul_(2)  # in place: built again
        assert torch.equal(_call(x, lay, None, "auto"), reference_matmul(x, lay))
        assert len(built) == 2
    finally:
        TWLayout.to_dense = real  # type: ignore[method-assign]
    assert packs == [] and launches == []


def test_cutlass_without_an_instance_of_the_dtype_is_an_error(monkeypatch) -> None:
    bf16_only = [k.name for k in manifest(Arch.SM90A) if k.dtype.value == "bf16"]
    fake_device(monkeypatch, Arch.SM90A, bf16_only)
    allow_cutlass_on_cpu(monkeypatch)
    module = _int_layer(16, 40, 8, torch.float16)
    x = torch.randint(-1, 2, (3, 16)).half()
    assert torch.equal(_call(x, module.layout, None, "auto"), reference_matmul(x, module.layout))
    with pytest.raises(ValueError, match=r"no f16/sm_90a/sm80_multistage TW kernel serves tiles"):
        _call(x, module.layout, None, "cutlass")


@pytest.mark.parametrize("M", [1, 5, 8, 16])
def test_in_features_one_reaches_the_kernel_with_a_valid_pitch(monkeypatch, M) -> None:
    ext = fake_device(monkeypatch, Arch.SM90A)
    allow_cutlass_on_cpu(monkeypatch)
    module = _int_layer(1, 20, 8, torch.float16)
    x = torch.randint(-3, 4, (M, 1)).half()
    got = _call(x, module.layout, module.bias.detach(), "cutlass")
    assert torch.equal(got, reference_matmul(x, module.layout, module.bias.detach()))
    assert len(ext.calls) == 1


@pytest.mark.parametrize("backend", ["emulated", "reference"])
def test_op_schema_adapter_rebuilds_the_layout(backend) -> None:
    # The CUDA implementation of tilesparse::tw_linear receives the layout as the op schema's
    # tensors; its non-kernel branches run on any device, so the adapter is checked here.
    layout = random_layout(33, 41, 8, 0.8, 0.5, True, 11)
    x = torch.randint(-3, 4, (6, 33)).float()
    bias = torch.randint(-3, 4, (41,)).float()
    got = cuda._op_impl(
        x,
        layout.col_idx,
        layout.tile_ptr,
        layout.row_idx,
        layout.row_ptr,
        layout.values,
        layout.val_ptr,
        bias,
        41,
        backend,
    )
    assert torch.equal(got, reference_matmul(x, layout, bias))


def test_register_cuda_kernel_without_cuda_returns_false() -> None:
    from tilesparse.kernels import register_cuda_kernel

    if torch.cuda.is_available():
        pytest.skip("a CUDA device exists: registration is covered by test_cuda_device.py")
    assert register_cuda_kernel() is False
