"""A TW layer on a CUDA device through ``tilesparse::tw_linear``: ``tw_linear_cuda`` close to
the reference (exact on integer-valued inputs), ``TileSparseLinear`` on the CUTLASS kernel, the
CUDA implementation's checks and its packed-weight cache. Skipped only where no CUDA device
exists."""

from __future__ import annotations

import pytest
import torch

from cutlass_kernels import build, reference, toolchain
from tests.cutlass_kernels.layouts import int_layout, random_layout
from tests.tolerances import tol
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.kernels import cuda as cuda_glue

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ext():
    """The CUTLASS extension of this device (the glue loads the same one by default)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if toolchain.find_nvcc() is None:
        pytest.fail("a CUDA device but no nvcc: the TW kernels cannot be built")
    return build.load_extension()


def test_all_pruned_and_empty_tile(ext) -> None:
    empty = condense(torch.ones(40, 50), torch.zeros(40, 50, dtype=torch.bool), 128)
    x = torch.ones(5, 40, dtype=torch.float16, device="cuda")
    bias = torch.arange(50, dtype=torch.float16, device="cuda")
    assert torch.equal(cuda_glue.tw_linear_cuda(x, empty, bias), bias.expand(5, 50))
    layout = random_layout(90, 200, 64, 0.8, 0.5, True, seed=5)  # its first tile keeps no rows
    assert int(layout.row_ptr[1]) == 0
    xi = torch.randint(-1, 2, (33, 90)).half()
    got = cuda_glue.tw_linear_cuda(xi.cuda(), layout).cpu()
    assert torch.equal(got, reference_matmul(xi, layout))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_random_layer_close_to_reference(ext, dtype) -> None:
    torch.manual_seed(0)
    K, N, M = 768, 1000, 1000
    w = torch.randn(K, N) / K**0.5
    layout = int_layout(K, N, 128, seed=2)
    layout = condense(w, layout.mask(), 128)
    x = torch.randn(M, K)
    want = reference_matmul(x, layout)
    got = cuda_glue.tw_linear_cuda(x.to(dtype).cuda(), layout).float().cpu()
    torch.testing.assert_close(got, want, **tol("cutlass", dtype))


def test_tile_sparse_linear_runs_the_cutlass_kernel(ext) -> None:
    from tilesparse.linear import TileSparseLinear

    assert cuda_glue.register_cuda_kernel()
    torch.manual_seed(0)
    dense = torch.nn.Linear(300, 260)
    mask_kn = torch.rand(300, 260) < 0.5
    module = TileSparseLinear.from_dense(dense, mask_kn=mask_kn, tile=128).to(
        device="cuda", dtype=torch.float16
    )
    module.backend = "cutlass"
    x = torch.randn(64, 300, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        got = module(x).float()
    want = (x.float() @ (dense.weight.T.cuda() * mask_kn.cuda()) + dense.bias.cuda()).float()
    torch.testing.assert_close(got, want, **tol("cutlass", torch.float16))


def test_cuda_op_checks_like_the_cpu_op_and_packs_once(ext, monkeypatch) -> None:
    from tilesparse import ops

    assert cuda_glue.register_cuda_kernel()
    layout = int_layout(96, 80, 32, seed=3)
    cuda = TWLayout(
        96,
        80,
        32,
        *(
            getattr(layout, n).cuda()
            for n in ("col_idx", "tile_ptr", "row_idx", "row_ptr", "values", "val_ptr")
        ),
    )
    cuda.values = cuda.values.half()
    x = torch.randint(-1, 2, (7, 96)).half().cuda()
    with pytest.raises(ValueError, match="backend 'cpu' runs on CPU tensors, got a cuda tensor"):
        ops.tw_linear(x, cuda, None, "cpu")
    with pytest.raises(ValueError, match="bias has dtype torch.float32 but x has torch.float16"):
        ops.tw_linear(x, cuda, torch.zeros(80, device="cuda"), "cutlass")
    packs = []
    real = reference.pack_weight
    monkeypatch.setattr(reference, "pack_weight", lambda *a, **k: packs.append(1) or real(*a, **k))
    want = reference_matmul(x.cpu().float(), layout)
    for _ in range(3):
        assert torch.equal(ops.tw_linear(x, cuda, None, "cutlass").float().cpu(), want)
    assert len(packs) == 1
    cuda.values.mul_(2)
    assert torch.equal(ops.tw_linear(x, cuda, None, "cutlass").float().cpu(), 2 * want)
    assert len(packs) == 2
    broken = TWLayout(
        96,
        80,
        32,
        cuda.col_idx,
        cuda.tile_ptr + 1,
        cuda.row_idx,
        cuda.row_ptr,
        cuda.values,
        cuda.val_ptr,
    )
    with pytest.raises(ValueError, match="tile_ptr must start at 0"):
        ops.tw_linear(x, broken, None, "cutlass")


def test_tiles_wider_than_every_instance_run_split(ext) -> None:
    # A tile=256 layer on kernels of G <= 128: packed as 128-wide sub-tiles, exact.
    layout = int_layout(96, 700, 256, seed=9)
    assert int((layout.tile_ptr[1:] - layout.tile_ptr[:-1]).max()) == 256
    bias = torch.randint(-2, 3, (700,)).half()
    for M in (1, 40, 300):
        x = torch.randint(-1, 2, (M, 96)).half()
        got = cuda_glue.tw_linear_cuda(x.cuda(), layout, bias.cuda()).cpu()
        assert torch.equal(got, reference_matmul(x, layout, bias)), M


@pytest.mark.parametrize("M", [1, 5, 8, 16])
def test_in_features_one(ext, M) -> None:
    layout = int_layout(1, 40, 16, seed=M)
    x = torch.randint(-3, 4, (M, 1)).half()
    got = cuda_glue.tw_linear_cuda(x.cuda(), layout).cpu()
    assert torch.equal(got, reference_matmul(x, layout))


def test_auto_on_cuda_is_the_dense_gemm_of_the_pruned_weight(ext) -> None:
    # backend "auto" (the default) on a CUDA tensor multiplies by the cached dense
    # reconstruction: the masked dense layer's result, and no packed weight is made.
    from tilesparse.linear import TileSparseLinear

    assert cuda_glue.register_cuda_kernel()
    torch.manual_seed(0)
    dense = torch.nn.Linear(300, 260)
    mask_kn = torch.rand(300, 260) < 0.5
    module = TileSparseLinear.from_dense(dense, mask_kn=mask_kn, tile=128).to(
        device="cuda", dtype=torch.float16
    )
    assert module.backend == "auto"
    x = torch.randn(64, 300, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        got = module(x).float()
    want = x.float() @ (dense.weight.T.cuda() * mask_kn.cuda()) + dense.bias.cuda()
    torch.testing.assert_close(got, want, **tol("cutlass", torch.float16))
    assert id(module.layout.values) not in cuda_glue._PACKED
