"""The parts of the GPU check that run without a GPU: the sparsity split, the random TW layers
it benchmarks, its exit without a device, and its isolation of a faulting main loop."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks.cutlass_kernels import gpu_check
from cutlass_kernels.manifest import Arch, Mainloop, manifest


@pytest.mark.parametrize(("s", "want"), [(0, 0.0), (75, 50.0), (50, 29.289), (90, 68.377)])
def test_split_sparsity_composes_to_the_target(s, want) -> None:
    step = gpu_check.split_sparsity(s)
    assert step == pytest.approx(want, abs=1e-3)
    assert 1 - (1 - step / 100) ** 2 == pytest.approx(s / 100)


@pytest.mark.parametrize("s", [50, 75, 90])
def test_random_tw_layer_has_the_target_density(s) -> None:
    gen = torch.Generator().manual_seed(s)
    layout = gpu_check.tw_layout(1024, 768, 128, s, gen, torch.float32)
    assert layout.density == pytest.approx(1 - s / 100, abs=0.01)
    dense = layout.to_dense()
    assert dense.shape == (1024, 768)
    kept_cols = (dense != 0).any(0).sum().item()
    assert kept_cols == round(768 * (1 - gpu_check.split_sparsity(s) / 100))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the exit without a CUDA device")
def test_exits_3_without_a_cuda_device(capsys) -> None:
    assert gpu_check.main(["--out", "/dev/null"]) == 3
    assert "no CUDA device" in capsys.readouterr().err


def _kernels():
    ks = manifest(Arch.SM90A)
    ms = [k for k in ks if k.mainloop is Mainloop.SM80_MULTISTAGE][:2]
    gmma = [k for k in ks if k.mainloop is Mainloop.SM90_CPASYNC_GMMA][:2]
    return ms, gmma


# A stand-in for the child: passes every sm80_multistage instance, dies (SIGABRT, like a kernel
# fault taking the process down) on the gmma ones.
_CHILD = r"""
import json, os, sys
names = sys.argv[sys.argv.index("--verify-kernels") + 1].split(",")
out = sys.argv[sys.argv.index("--verify-out") + 1]
if any("_gmma_" in n for n in names):
    sys.stderr.write("CUDA error: an illegal memory access was encountered\n")
    sys.stderr.flush()
    os.abort()
json.dump({"checks": [{"check": "exact_vs_emulation", "kernel": n, "ok": True} for n in names],
           "failures": []}, open(out, "w"))
"""


def test_a_crashing_main_loop_is_marked_broken_and_the_rest_verified() -> None:
    ms, gmma = _kernels()
    failures: list[str] = []
    checks = gpu_check.verify_in_children(ms + gmma, failures, timeout_s=60,
                                          child_cmd=[sys.executable, "-c", _CHILD])
    ok = {c["kernel"] for c in checks if c["ok"]}
    bad = {c["kernel"] for c in checks if not c["ok"]}
    assert ok == {k.name for k in ms}
    assert bad == {k.name for k in gmma}
    assert len(failures) == 1 and "sm90_cpasync_gmma" in failures[0]
    assert "illegal memory access" in failures[0]


def test_a_hanging_child_times_out() -> None:
    ms, _ = _kernels()
    failures: list[str] = []
    checks = gpu_check.verify_in_children(ms, failures, timeout_s=1,
                                          child_cmd=[sys.executable, "-c", "import time; time.sleep(30)"])
    assert [c["ok"] for c in checks] == [False] * len(ms)
    assert "timed out after 1 s" in failures[0]
