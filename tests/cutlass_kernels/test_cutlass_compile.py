"""``nvcc -c`` of one sm_80 and one sm_90a instance (no GPU needed), cached by input hash."""

from __future__ import annotations

import pytest

from cutlass_kernels.build import compile_object, cuda_toolkit_root, find_nvcc, nvcc_version
from cutlass_kernels.manifest import Arch, DType, Mainloop, manifest

_MS, _GMMA = Mainloop.SM80_MULTISTAGE, Mainloop.SM90_CPASYNC_GMMA


def _pick(arch: Arch, dtype: DType, mainloop: Mainloop):
    tb = (128, 128, 64) if mainloop is _GMMA else (128, 128, 32)
    return next(
        k for k in manifest(arch)
        if k.dtype is dtype and k.mainloop is mainloop and k.threadblock == tb
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "dtype", "mainloop"),
    [(Arch.SM80, DType.F16, _MS), (Arch.SM90A, DType.BF16, _MS), (Arch.SM90A, DType.F16, _GMMA)],
)
def test_instance_compiles_with_nvcc(require, arch, dtype, mainloop) -> None:
    nvcc = find_nvcc()
    require(nvcc is not None, "nvcc")
    require(bool(manifest(arch, nvcc_version(nvcc))), f"a CUDA toolkit that targets {arch.value}")
    kernel = _pick(arch, dtype, mainloop)
    first = compile_object(kernel, nvcc=nvcc)
    data = first.path.read_bytes()
    assert data[:4] == b"\x7fELF"
    assert kernel.name.encode() in data  # the extern "C" launcher symbol
    device_fn = b"tw_gemm_sm90_device" if mainloop is _GMMA else b"tw_gemm_device"
    assert device_fn in data  # the kernel itself was instantiated
    again = compile_object(kernel, nvcc=nvcc)
    assert again.cached and again.path == first.path and again.key == first.key


def test_toolkit_root_and_version(require) -> None:
    nvcc = find_nvcc()
    require(nvcc is not None, "nvcc")
    root = cuda_toolkit_root(nvcc)
    assert (root / "include" / "cuda_runtime_api.h").is_file() or (
        root / "targets" / "x86_64-linux" / "include" / "cuda_runtime_api.h"
    ).is_file()
    major, minor = nvcc_version(nvcc)
    assert major >= 11 and minor >= 0


def test_compile_without_nvcc_says_so(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        compile_object(manifest(Arch.SM80)[0])
