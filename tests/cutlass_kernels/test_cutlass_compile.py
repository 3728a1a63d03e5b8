"""``nvcc -c`` of one sm_80 and one sm_90a instance (no GPU needed), cached by input hash."""

from __future__ import annotations

import pytest

from cutlass_kernels.build import compile_object, find_nvcc, nvcc_version
from cutlass_kernels.manifest import Arch, DType, manifest


def _pick(arch: Arch, dtype: DType):
    return next(k for k in manifest(arch) if k.dtype is dtype and k.threadblock == (128, 128, 32))


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "dtype"), [(Arch.SM80, DType.F16), (Arch.SM90A, DType.BF16)])
def test_instance_compiles_with_nvcc(require, arch, dtype) -> None:
    nvcc = find_nvcc()
    require(nvcc is not None, "nvcc")
    require(bool(manifest(arch, nvcc_version(nvcc))), f"a CUDA toolkit that targets {arch.value}")
    kernel = _pick(arch, dtype)
    first = compile_object(kernel, nvcc=nvcc)
    data = first.path.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert kernel.name.encode() in data  # the extern "C" launcher symbol
    assert b"tw_gemm_device" in data  # the kernel itself was instantiated
    again = compile_object(kernel, nvcc=nvcc)
    assert again.cached and again.path == first.path and again.key == first.key


def test_compile_without_nvcc_says_so(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        compile_object(manifest(Arch.SM80)[0])
