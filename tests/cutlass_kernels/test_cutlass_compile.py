"""``nvcc -c`` of one sm_80 and one sm_90a instance (no GPU needed), cached by input hash;
the torch extension built from such an object, linked, imported and its argument checks run."""

from __future__ import annotations

import re

import pytest
import torch

from cutlass_kernels.build import compile_object, compile_objects, load_extension
from cutlass_kernels.manifest import MIN_CUDA, Arch, DType, Mainloop, manifest
from cutlass_kernels.reference import pack_launch, pack_weight
from cutlass_kernels.toolchain import cuda_toolkit_root, find_nvcc, nvcc_version, toolkit_include
from tilesparse.format import condense

_MS, _GMMA = Mainloop.SM80_MULTISTAGE, Mainloop.SM90_CPASYNC_GMMA


def _pick(arch: Arch, dtype: DType, mainloop: Mainloop):
    tb = (128, 128, 64) if mainloop is _GMMA else (128, 128, 32)
    return next(
        k
        for k in manifest(arch)
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
    header = toolkit_include(root) / "cuda_runtime_api.h"
    assert header.is_file()
    major, minor = nvcc_version(nvcc)
    assert (major, minor) >= MIN_CUDA[Arch.SM80]  # the oldest toolkit the manifest builds with
    # nvcc's "release X.Y" against the toolkit's own header: CUDART_VERSION = 1000·X + 10·Y
    m = re.search(r"^#define CUDART_VERSION\s+(\d+)", header.read_text(), re.MULTILINE)
    assert m, f"no CUDART_VERSION in {header}"
    assert (major, minor) == divmod(int(m.group(1)) // 10, 100), (header, m.group(1))


def test_compile_without_nvcc_says_so(monkeypatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    with pytest.raises(RuntimeError, match="nvcc not found"):
        compile_object(manifest(Arch.SM80)[0])


@pytest.mark.slow
def test_extension_builds_links_and_imports_without_a_gpu(require) -> None:
    """The same build path as on a CUDA machine (objects → binding → link with libcudart),
    against this machine's torch; a kernel cannot run here, so the binding's checks are run."""
    nvcc = find_nvcc()
    require(nvcc is not None, "nvcc")
    kernel = _pick(Arch.SM80, DType.F16, _MS)  # the object test_instance_compiles_with_nvcc made
    ext = load_extension(Arch.SM80, [kernel])
    assert ext.instances() == [kernel.name]
    assert ext.failed == {}
    assert load_extension(Arch.SM80, [kernel]) is ext  # memoised in the process

    g = torch.Generator().manual_seed(0)
    mask = torch.rand(40, 50, generator=g) < 0.5
    layout = condense(torch.randn(40, 50, generator=g), mask, 128)
    pw = pack_weight(layout, dtype=torch.float16)
    launch = pack_launch(torch.randn(3, 40, generator=g).half(), pw)
    args = (
        pw.tile_meta,
        pw.col_idx,
        pw.row_idx,
        pw.w,
        pw.lda,
        launch.xt,
        launch.yt,
        launch.batch,
        1.0,
        0.0,
        None,  # bias
        0,  # activation: none
        0,  # stream
    )
    with pytest.raises(RuntimeError, match="not in this build"):
        ext.tw_gemm("tw_gemm_no_such_instance", *args)
    with pytest.raises(RuntimeError, match="xt must be a CUDA tensor"):
        ext.tw_gemm(kernel.name, *args)


@pytest.mark.slow
def test_failed_instance_is_skipped_or_raised(require, monkeypatch, tmp_path) -> None:
    """A compile error names the instance; with ``skip_failed`` the rest still build."""
    from cutlass_kernels import emit

    nvcc = find_nvcc()
    require(nvcc is not None, "nvcc")
    good = _pick(Arch.SM80, DType.F16, _MS)
    bad = next(k for k in manifest(Arch.SM80) if k.dtype is DType.BF16 and k.mainloop is _MS)
    real = emit.emit_instance

    def broken(kernel):
        f = real(kernel)
        if kernel is bad:
            return emit.EmittedFile(
                f.name, f.text + "\n#error planted compile error\n", f.input_hash
            )
        return f

    monkeypatch.setattr(emit, "emit_instance", broken)
    with pytest.raises(RuntimeError, match=f"nvcc failed .* on {bad.name}"):
        compile_objects([bad], nvcc=nvcc, cache=tmp_path)
    objects, failed = compile_objects([good, bad], nvcc=nvcc, skip_failed=True, jobs=2)
    assert set(objects) == {good.name} and set(failed) == {bad.name}
    assert "planted compile error" in failed[bad.name]


def test_cudart_is_found_in_lib64_targets_or_nowhere(tmp_path, monkeypatch) -> None:
    from cutlass_kernels.toolchain import cudart_library

    monkeypatch.setattr("cutlass_kernels.toolchain._nvidia_runtime_markers", lambda: [])
    tk = tmp_path / "cuda"
    with pytest.raises(RuntimeError, match="no shared libcudart"):
        cudart_library(tk)
    lib = tk / "targets" / "x86_64-linux" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcudart.so.13").write_bytes(b"")
    assert cudart_library(tk) == lib / "libcudart.so.13"  # only a versioned one: linked as -l:name
    (tk / "lib64").mkdir()
    (tk / "lib64" / "libcudart.so.13").write_bytes(b"")
    (tk / "lib64" / "libcudart.so").write_bytes(b"")
    assert cudart_library(tk) == tk / "lib64" / "libcudart.so"
