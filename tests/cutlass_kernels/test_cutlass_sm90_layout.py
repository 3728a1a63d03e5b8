"""The sm_90a gmma kernel's gathered loads, checked on the CPU: ``csrc/tw_sm90_address_check.cu``
builds the producer's CuTe tensors and copy partition (host-device code) for every manifest
gmma tile and checks each cp.async address against ``xt + row_idx[k]·ldx + n``, the coverage of
the predicated copies, and the accumulator partition the epilogue scatters from."""

from __future__ import annotations

import re
import subprocess

import pytest

from cutlass_kernels import emit
from cutlass_kernels.build import _key
from cutlass_kernels.manifest import Arch, Mainloop, manifest
from cutlass_kernels.toolchain import cache_dir, find_nvcc, nvcc_version

SRC = emit.csrc_dir() / "tw_sm90_address_check.cu"


@pytest.mark.slow
def test_gathered_loads_and_accumulators_of_every_gmma_tile(require) -> None:
    nvcc = find_nvcc()
    require(nvcc is not None, "nvcc")
    require(bool(manifest(Arch.SM90A, nvcc_version(nvcc))), "a CUDA toolkit that targets sm_90a")
    flags = [*emit.NVCC_FLAGS, *emit.nvcc_arch_flags(Arch.SM90A)]
    includes = [emit.csrc_dir(), *emit.cutlass_include_dirs()]
    key = _key(SRC.read_text(), emit._template_text(), " ".join(flags), str(nvcc_version(nvcc)))
    exe = cache_dir() / "checks" / key[:24] / "tw_sm90_address_check"
    if not exe.is_file():
        exe.parent.mkdir(parents=True, exist_ok=True)
        tmp = exe.with_suffix(".tmp")
        cmd = [nvcc, *flags, *(f"-I{d}" for d in includes), str(SRC), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-4000:]
        tmp.replace(exe)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    tiles = {tuple(map(int, m)) for m in re.findall(r"^tile (\d+)x(\d+)x(\d+):", run.stdout, re.M)}
    gmma = {k.threadblock for k in manifest(Arch.SM90A) if k.mainloop is Mainloop.SM90_CPASYNC_GMMA}
    assert tiles == gmma  # every gmma tile of the manifest is checked
    total = re.search(r"^total: (\d+) checked, (\d+) errors$", run.stdout, re.M)
    assert total and int(total.group(2)) == 0 and int(total.group(1)) > 100_000
