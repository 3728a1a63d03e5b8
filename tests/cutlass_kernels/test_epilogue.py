"""The fused epilogue: the emulation's formulas against the kernel headers (constants, codes, and
the header's own arithmetic compiled for the host, bit for bit), against torch's activations
(GELU: a stated absolute tolerance, the one place exactness is impossible), and the emulated
launch with a bias and an activation against the exact products."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cutlass_kernels import epilogue
from cutlass_kernels.emit import csrc_dir
from cutlass_kernels.epilogue import ACTIVATION_CODE, Activation, apply_activation
from cutlass_kernels.reference import TWLaunch, emulate, pack_launch, pack_weight
from tests.cutlass_kernels.layouts import random_layout

# Largest |formula - exact| over every fp32 x (measured on [-12, 12] in steps of 6e-5, tested in
# steps of 1.2e-4; both clamp outside, where the tails are below these bounds): erf_r 4.2e-7,
# GELU (erf form) 1.4e-6, tanh_r 4.0e-7, GELU (tanh form) 2.0e-6. Absolute, not relative: in the far negative tail GELU
# is below 1e-6 and the formula's is off by up to the bound (torch's own CPU GELU is no closer
# there, see epilogue.py).
_TOL = {"erf": 4.3e-7, "tanh": 4.1e-7, "gelu": 1.5e-6, "gelu_tanh": 2.1e-6}


def _header_macro(text: str, name: str) -> list[float]:
    m = re.search(rf"#define {name} ((?:[^\n]*\\\n)*[^\n]*)", text)
    assert m, name
    body = m.group(1).replace("\\\n", " ")
    return [float.fromhex(v.strip().rstrip("f")) for v in body.split(",")]


def test_header_constants_and_codes_are_the_emulations() -> None:
    text = (csrc_dir() / "tw_activation.h").read_text()
    pairs = {
        "TW_ERF_NUM": epilogue.ERF_NUM,
        "TW_ERF_DEN": epilogue.ERF_DEN,
        "TW_ERF_CLAMP": (epilogue.ERF_CLAMP,),
        "TW_TANH_NUM": epilogue.TANH_NUM,
        "TW_TANH_DEN": epilogue.TANH_DEN,
        "TW_TANH_CLAMP": (epilogue.TANH_CLAMP,),
        "TW_SQRT1_2": (epilogue.SQRT1_2,),
        "TW_SQRT_2_OVER_PI": (epilogue.SQRT_2_OVER_PI,),
        "TW_GELU_CUBIC": (epilogue.GELU_CUBIC,),
    }
    for macro, values in pairs.items():
        want = [float.fromhex(v) for v in values]
        assert _header_macro(text, macro) == want, macro
        # every constant is an fp32 value (no double rounding on either side)
        assert torch.tensor(want, dtype=torch.float32).double().tolist() == want, macro
    args = (csrc_dir() / "tw_args.h").read_text()
    names = {
        Activation.NONE: "kTwActNone",
        Activation.RELU: "kTwActRelu",
        Activation.GELU: "kTwActGelu",
        Activation.GELU_TANH: "kTwActGeluTanh",
    }
    for act, name in names.items():
        m = re.search(rf"{name} = (\d+)", args)
        assert m and int(m.group(1)) == ACTIVATION_CODE[act], name


def _grid() -> torch.Tensor:
    specials = [0.0, -0.0, 1e-30, -1e-30, 3.4e38, -3.4e38, float("inf"), float("-inf"), 4.0, -4.0]
    return torch.cat([torch.linspace(-12, 12, 400_001), torch.tensor(specials)]).float()


@pytest.mark.slow
def test_header_arithmetic_compiled_for_the_host_is_bit_equal(require, tmp_path: Path) -> None:
    """``tw_activation.h`` — the kernel's activation code, no CUDA in it — built by the host
    compiler with contraction off (the device side uses ``__fmul_rn``/``__fadd_rn``/
    ``__fdiv_rn``: the same IEEE operations) and run on 400k fp32 values and specials: every
    output bit-equal to :func:`apply_activation`."""
    cxx = shutil.which("g++") or shutil.which("c++")
    require(cxx is not None, "a host C++ compiler")
    assert cxx is not None
    src = tmp_path / "act.cpp"
    src.write_text(
        '#include <cstdio>\n#include <vector>\n#include "tw_activation.h"\n'
        "int main(int, char **argv) {\n"
        '  FILE *in = std::fopen(argv[1], "rb"); std::vector<float> x; float v;\n'
        "  while (std::fread(&v, 4, 1, in) == 1) x.push_back(v);\n"
        '  std::fclose(in); FILE *out = std::fopen(argv[2], "wb");\n'
        "  for (int act = 0; act < 4; ++act) for (float xi : x) {\n"
        "    float y = tilerec::tw_activation(xi, act); std::fwrite(&y, 4, 1, out); }\n"
        "  float e = tilerec::tw_epilogue_value(3.0f, 0.5f, 1.0f, 1.0f, true, 0);\n"
        "  std::fwrite(&e, 4, 1, out); std::fclose(out); return 0; }\n"
    )
    exe = tmp_path / "act"
    cmd = [
        cxx,
        "-std=c++17",
        "-O2",
        "-ffp-contract=off",
        f"-I{csrc_dir()}",
        str(src),
        "-o",
        str(exe),
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    x = _grid()
    x.numpy().tofile(tmp_path / "x.bin")
    subprocess.run([str(exe), str(tmp_path / "x.bin"), str(tmp_path / "y.bin")], check=True)
    out = torch.from_numpy(np.fromfile(tmp_path / "y.bin", dtype=np.float32))
    assert float(out[-1]) == 3.5
    y = out[:-1].view(4, -1)
    for act, code in ACTIVATION_CODE.items():
        want = apply_activation(x, act)
        assert torch.equal(want.view(torch.int32), y[code].view(torch.int32)), act


def test_formulas_against_torch_within_the_stated_tolerance() -> None:
    x = torch.linspace(-12, 12, 200_001, dtype=torch.float32)
    xd = x.double()
    err = {
        "erf": (epilogue.erf_fp32(x).double() - torch.erf(xd)).abs().max(),
        "tanh": (epilogue.tanh_fp32(x).double() - torch.tanh(xd)).abs().max(),
        "gelu": (apply_activation(x, Activation.GELU).double() - F.gelu(xd)).abs().max(),
        "gelu_tanh": (
            apply_activation(x, Activation.GELU_TANH).double() - F.gelu(xd, approximate="tanh")
        )
        .abs()
        .max(),
    }
    for name, e in err.items():
        assert float(e) <= _TOL[name], (name, float(e))
    assert torch.equal(apply_activation(x, Activation.RELU), torch.relu(x))
    nan = torch.tensor([float("nan")])
    for act in Activation:
        assert torch.isnan(apply_activation(nan, act)).all(), act


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("act", list(Activation))
def test_emulated_launch_with_bias_and_activation(dtype: torch.dtype, act: Activation) -> None:
    """Every written row ``act(acc + bias)`` in fp32 (exact products, integer inputs), rounded
    once; rows of pruned columns untouched; the batch tail (M = 13, padded to 16) included."""
    layout = random_layout(40, 70, 16, 0.8, 0.5, True, 3)
    layout.values = layout.values.round().clamp(-2, 2).to(dtype)
    pw = pack_weight(layout, dtype=dtype)
    g = torch.Generator().manual_seed(4)
    x = torch.randint(-2, 3, (13, 40), generator=g).to(dtype)
    bias = torch.randint(-3, 4, (70,), generator=g).to(dtype)
    base = pack_launch(x, pw)
    marker = torch.full_like(base.yt, 7.0)
    launch = TWLaunch(pw, base.xt, marker.clone(), base.batch, 13, 1.0, 0.0, bias, act)
    emulate(launch)
    dense = layout.to_dense().double()  # (K, N), pruned entries zero
    acc = (x.double() @ dense).float()  # exact: small integers
    want = apply_activation(acc + bias.float(), act).to(dtype)
    kept = layout.col_idx
    assert torch.equal(launch.yt[kept, :13].t(), want[:, kept])
    pruned = torch.ones(70, dtype=torch.bool)
    pruned[kept] = False
    assert torch.equal(launch.yt[pruned], marker[pruned])


def test_launch_with_bias_needs_alpha_one_beta_zero() -> None:
    layout = random_layout(16, 24, 8, 1.0, 0.5, False, 1)
    pw = pack_weight(layout, dtype=torch.float16)
    base = pack_launch(torch.ones(8, 16, dtype=torch.float16), pw)
    bias = torch.zeros(24, dtype=torch.float16)
    for alpha, beta in ((2.0, 0.0), (1.0, 1.0)):
        bad = TWLaunch(pw, base.xt, base.yt, base.batch, 8, alpha, beta, bias, Activation.RELU)
        with pytest.raises(ValueError, match="a launch with a bias needs alpha = 1 and beta = 0"):
            emulate(bad)
    short = TWLaunch(pw, base.xt, base.yt, base.batch, 8, 1.0, 0.0, bias[:16])
    with pytest.raises(ValueError, match=r"bias must be \(24,\), got \(16,\)"):
        emulate(short)


def test_bias_iterator_visits_the_rows_cutlass_loads(require) -> None:
    """``TwOutputTileIterator::load`` (the bias broadcast) walks the fragment with the row
    offsets and fragment indices of ``PredicatedTileIterator::load_with_byte_offset`` in the
    installed CUTLASS: both expressions appear, token for token, in both headers."""
    try:
        from cutlass_kernels.emit import cutlass_include_dirs

        inc = cutlass_include_dirs()[0]
    except (ImportError, FileNotFoundError):
        require(False, "nvidia-cutlass")
        return
    theirs = (inc / "cutlass/epilogue/threadblock/predicated_tile_iterator.h").read_text()
    ours = (csrc_dir() / "tw_epilogue.h").read_text()

    def tokens(text: str) -> str:
        return re.sub(r"\s+", "", text)

    for expr in (
        "row*ThreadMap::Delta::kRow+group*ThreadMap::Delta::kGroup+cluster*ThreadMap::Delta::kCluster;",
        "(row+ThreadMap::Iterations::kRow*(group+ThreadMap::Iterations::kGroup*cluster));",
        "frag_row_idx*ThreadMap::Iterations::kColumn+column",
    ):
        assert expr in tokens(theirs), expr
        assert expr.strip("();") in tokens(ours), expr
