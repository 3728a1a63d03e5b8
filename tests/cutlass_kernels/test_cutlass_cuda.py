"""The compiled kernels on a CUDA device: exact against the emulation from the same packed
arguments (integer-valued inputs). Skipped only where no CUDA device exists (the layer-level
checks through ``tilesparse::tw_linear`` are in tests/tilesparse/kernels/test_cuda_device.py)."""

from __future__ import annotations

import pytest
import torch

from cutlass_kernels import build, launch, toolchain
from cutlass_kernels.manifest import DType, manifest
from cutlass_kernels.reference import emulate, pack_launch, pack_weight
from tests.cutlass_kernels.layouts import int_layout

pytestmark = pytest.mark.gpu

_DT = {DType.F16: torch.float16, DType.BF16: torch.bfloat16}


@pytest.fixture(scope="module")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if toolchain.find_nvcc() is None:
        pytest.fail("a CUDA device but no nvcc: the TW kernels cannot be built")
    return build.load_extension()


CASES = [  # (M, K, N, G): K and N not multiples of G, M=1, a batch over one CTA tile
    (1, 100, 300, 128),
    (77, 301, 257, 128),
    (300, 64, 130, 64),
    (8, 513, 129, 128),
]


@pytest.mark.parametrize("case", CASES)
def test_kernels_equal_emulation_exactly(ext, case) -> None:
    M, K, N, G = case
    layout = int_layout(K, N, G, seed=M + K)
    arch = toolchain.device_arch()
    for kernel in manifest(arch):
        if kernel.tile_g < G:
            continue
        dt = _DT[kernel.dtype]
        x = torch.randint(-1, 2, (M, K), generator=torch.Generator().manual_seed(1)).to(dt)
        bias = torch.randint(-2, 3, (N,)).to(dt)
        cpu = pack_launch(x, pack_weight(layout, dtype=dt), bias)
        want = emulate(cpu)
        gpu = pack_launch(x.cuda(), pack_weight(layout, dtype=dt, device="cuda"), bias.cuda())
        got = launch.tw_gemm_kmajor(gpu, kernel=kernel, ext=ext)
        assert torch.equal(got[:, :M].cpu(), want[:, :M]), kernel.name
