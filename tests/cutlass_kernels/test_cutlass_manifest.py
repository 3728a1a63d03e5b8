"""Kernel instances as data, and their emission: complete, gated, deterministic, stamped."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from cutlass_kernels import emit
from cutlass_kernels.manifest import ALIGNMENT, Arch, DType, Mainloop, TWKernel, manifest, select


def test_manifest_covers_every_dtype_and_arch() -> None:
    ks = manifest()
    assert {(k.dtype, k.arch) for k in ks} == {(d, a) for d in DType for a in Arch}
    assert len({k.name for k in ks}) == len(ks)
    assert {(k.mainloop, k.arch) for k in ks} == {
        (Mainloop.SM80_MULTISTAGE, Arch.SM80),
        (Mainloop.SM80_MULTISTAGE, Arch.SM90A),
        (Mainloop.SM90_CPASYNC_GMMA, Arch.SM90A),
    }
    for k in ks:
        assert k.alignment == ALIGNMENT
        assert k.tile_g in (64, 128)
        td = k.tile_description()
        assert list(td.threadblock_shape) == list(k.threadblock)
        assert td.stages == k.stages
        gmma = k.mainloop is Mainloop.SM90_CPASYNC_GMMA
        want = [64, k.threadblock[1], 16] if gmma else [16, 8, 16]
        assert list(td.math_instruction.instruction_shape) == want
        assert k.threads == (384 if gmma else 32 * k.warps[0] * k.warps[1] * k.warps[2])


def test_manifest_gates_arch_by_cuda_version() -> None:
    assert {k.arch for k in manifest(cuda_version=(11, 8))} == {Arch.SM80}
    assert {k.arch for k in manifest(cuda_version=(12, 0))} == {Arch.SM80, Arch.SM90A}
    assert manifest(cuda_version=(10, 2)) == ()
    assert all(k.arch is Arch.SM90A for k in manifest("sm_90a"))


@pytest.mark.parametrize(
    ("tb", "warps", "stages", "match"),
    [
        ((128, 128, 32), (3, 2, 1), 4, "split into warps"),
        ((128, 128, 32), (2, 2, 1), 2, "stages must be >= 3"),
        ((128, 256, 64), (2, 4, 1), 6, "shared memory"),
    ],
)
def test_invalid_instances_are_rejected(tb, warps, stages, match) -> None:
    with pytest.raises(ValueError, match=match):
        TWKernel(DType.F16, Arch.SM80, tb, warps, stages)


def test_gmma_instances_need_sm90a_and_one_warp_group() -> None:
    gmma = Mainloop.SM90_CPASYNC_GMMA
    with pytest.raises(ValueError, match="needs sm_90a"):
        TWKernel(DType.F16, Arch.SM80, (128, 128, 64), (4, 1, 1), 4, 8, gmma)
    with pytest.raises(ValueError, match=r"warps \(4, 1, 1\)"):
        TWKernel(DType.F16, Arch.SM90A, (128, 128, 64), (2, 2, 1), 4, 8, gmma)
    with pytest.raises(ValueError, match="shared memory"):
        TWKernel(DType.F16, Arch.SM90A, (128, 128, 64), (4, 1, 1), 8, 8, gmma)  # 8 × 32 KB


def test_select_picks_narrowest_fitting_tile() -> None:
    ks = manifest()
    assert select(ks, "f16", "sm_80", 64, 1000).tile_g == 64
    k = select(ks, "bf16", "sm_90a", 100, 65536, mainloop="sm80_multistage")
    assert (k.tile_g, k.threadblock[1], k.dtype, k.arch) == (128, 256, DType.BF16, Arch.SM90A)
    # sm_90a defaults to the multistage main loop (k tile 32), as sm_80 has only that one; the
    # gmma instances are picked when asked for. Wave model, 132 SMs: cost = waves × batch tile
    # × CTAs per SM (2 for 128 threads, 1 for the 256-thread n=256 instance, 1 for gmma's 384).
    # gmma, 3 tiles x 12800: n=128 → 300 CTAs / 132 → 3 waves → 384; n=64 → 5 → 320:
    # 384 <= 1.25 × 320, so the preferred n=128.
    k = select(ks, "f16", "sm_90a", 128, 12800, 3, 132, "sm90_cpasync_gmma")
    assert (k.mainloop, k.threadblock) == (Mainloop.SM90_CPASYNC_GMMA, (128, 128, 64))
    k = select(ks, "f16", "sm_90a", 128, 12800, 12, 132)
    assert (k.mainloop, k.threadblock) == (Mainloop.SM80_MULTISTAGE, (128, 128, 32))
    assert select(ks, "f16", "sm_90a", 64, 12800).threadblock == (64, 128, 32)
    assert select(ks, "f16", "sm_80", 128, 8).threadblock == (128, 128, 32)
    # Multistage: the 128-wide batch tile unless its modelled cost exceeds 1.25 × the cheapest,
    # then the cheapest (the widest of equals).
    # 3 tiles x 12800: n=256 150 CTAs → 2 waves → 512; n=128 300/264 → 2 → 512; n=64 600/264 →
    # 3 → 384: 512 > 1.25 × 384, so n=64.
    assert select(ks, "f16", "sm_90a", 128, 12800, 3, 132, "sm80_multistage").threadblock[1] == 64
    # 24 tiles x 12800: 256 → 10 waves → 2560, 128 → 2560, 64 → 19 → 2432: n=128.
    assert select(ks, "f16", "sm_90a", 128, 12800, 24, 132, "sm80_multistage").threadblock[1] == 128
    # 2 tiles x 6400: 256 → 256, 128 → 256, 64 → 1 wave → 128: n=64.
    assert select(ks, "f16", "sm_90a", 128, 6400, 2, 132, "sm80_multistage").threadblock[1] == 64
    # One CTA whatever the tile: 256 → 256, 128 → 256, 64 → 128: n=64.
    assert select(ks, "f16", "sm_90a", 128, 64, 1, 132, "sm80_multistage").threadblock[1] == 64
    # 1 tile x 65536: 256 → 256 CTAs / 132 → 2 waves → 512; 128 → 512/264 → 2 → 512;
    # 64 → 1024/264 → 4 → 512: all equal, so the preferred n=128.
    assert select(ks, "f16", "sm_90a", 128, 65536, 1, 132, "sm80_multistage").threadblock[1] == 128
    with pytest.raises(ValueError, match="129 columns wide"):
        select(ks, "f16", "sm_80", 129, 8)


def test_emission_of_the_whole_manifest_is_deterministic() -> None:
    ks = manifest()
    a, b = emit.emit_sources(ks), emit.emit_sources(ks)
    assert [f.text for f in a] == [f.text for f in b]
    assert len(a) == len(ks) + 1
    assert len({f.input_hash for f in a}) == len(a)  # every input set differs
    version = emit.cutlass_version()
    for f, k in zip(a, ks):
        head = f.text.splitlines()[:4]
        assert head[0].startswith(f"// Generated by {emit.GENERATOR_VERSION}")
        assert f"nvidia-cutlass {version}" in head[0]
        assert head[2] == f"// Input hash: sha256:{f.input_hash}"
        assert f'extern "C" int {k.name}(' in f.text
        m, n, kk = k.threadblock
        if k.mainloop is Mainloop.SM90_CPASYNC_GMMA:
            assert "tilerec::sm90::TwGemmSm90Traits<" in f.text and f"{m}, {n}, {kk}," in f.text
        else:
            assert f"cutlass::gemm::GemmShape<{m}, {n}, {kk}>" in f.text
        el = "cutlass::half_t" if k.dtype is DType.F16 else "cutlass::bfloat16_t"
        assert el in f.text
    registry = a[-1]
    assert registry.name == "tw_instances.h"
    assert registry.text.count("&tw_gemm_") == len(ks)
    assert f"kTwNumInstances = {len(ks)};" in registry.text


def test_hash_changes_with_the_instance() -> None:
    k1, k2 = manifest("sm_80")[:2]
    assert emit.emit_instance(k1).input_hash != emit.emit_instance(k2).input_hash


def test_registry_rejects_empty_and_duplicates() -> None:
    k = manifest("sm_80")[0]
    with pytest.raises(ValueError, match="at least one"):
        emit.emit_registry([])
    with pytest.raises(ValueError, match="duplicate"):
        emit.emit_registry([k, k])


def test_write_sources_leaves_identical_files_untouched(tmp_path) -> None:
    files = emit.emit_sources(manifest("sm_80")[:2])
    paths = emit.write_sources(files, tmp_path)
    stamps = [p.stat().st_mtime_ns for p in paths]
    assert [p.read_text() for p in paths] == [f.text for f in files]
    emit.write_sources(files, tmp_path)
    assert [p.stat().st_mtime_ns for p in paths] == stamps


def test_nvcc_arch_flags() -> None:
    assert emit.nvcc_arch_flags("sm_90a") == ["-gencode", "arch=compute_90a,code=sm_90a"]
    assert emit.nvcc_arch_flags(Arch.SM80) == [
        "-gencode",
        "arch=compute_80,code=[sm_80,compute_80]",
    ]


def test_import_needs_no_gpu_nvcc_or_cutlass(tmp_path) -> None:
    code = (
        "import sys, cutlass_kernels, cutlass_kernels.build, cutlass_kernels.emit;"
        "import cutlass_kernels.launch, cutlass_kernels.toolchain;"
        "bad = [m for m in ('cutlass_library', 'cutlass_cppgen', 'torch.utils.cpp_extension')"
        " if m in sys.modules]; assert not bad, bad;"
        "ours = [m for m in sys.modules if m.split('.')[0] in ('tilesparse', 'embark', 'hps')];"
        "assert not ours, ours  # a leaf: nothing else of the project"
    )
    repo = Path(__file__).resolve().parents[2]  # this checkout's packages, not an installed copy
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert not list(tmp_path.iterdir())  # no compiled_cache.db or anything else in the CWD


def test_instance_names_are_c_identifiers() -> None:
    for k in manifest():
        assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k.name)
