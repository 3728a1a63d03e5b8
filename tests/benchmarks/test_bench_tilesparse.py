"""The TW sparse benchmarks (benchmarks/tilesparse): interleaved timing, and both scripts'
``--quick`` runs end to end — every row complete, finite, correct and self-consistent.

No timing thresholds here: speed is what the benchmarks measure, not what tests assert."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from benchmarks.tilesparse import bench_gemm, bench_models
from benchmarks.tilesparse.timing import Timing, interleaved, interleaved_medians, set_threads
from tilesparse.kernels import auto, cpu_kernel_available

GEMM_FIELDS = (
    "bench",
    "shape",
    "M",
    "K",
    "N",
    "dtype",
    "G",
    "sparsity",
    "threads",
    "bias",
    "repeats",
    "dense_ms",
    "tw_ms",
    "csr_ms",
    "speedup",
    "csr_speedup",
    "ideal",
    "fraction_of_ideal",
    "tw_max_abs_err",
    "correct",
    "values_fraction",
    "index_fraction",
    "memory_fraction",
    "csr_variant",
    "csr_skipped",
    "tw_density",
    "tiles",
    "kept_columns",
)
GEMM_POSITIVE = (
    "dense_ms",
    "tw_ms",
    "speedup",
    "ideal",
    "fraction_of_ideal",
    "values_fraction",
    "index_fraction",
    "memory_fraction",
    "tw_density",
    "dense_min_ms",
    "tw_min_ms",
    "tw_atol",
)
DLRM_FIELDS = (
    "batch",
    "dtype",
    "G",
    "sparsity",
    "threads",
    "repeats",
    "dense_ms",
    "tw_ms",
    "speedup",
    "ideal",
    "fraction_of_ideal",
    "target",
    "meets_target",
    "max_abs_err",
    "within_tolerance",
    "masked_dense_max_abs_err",
    "correct",
    "tw_linear_calls",
    "memory_fraction",
    "index_fraction",
    "dense_weight_bytes",
    "weight_bytes",
    "sparse_layers",
)
ENCODER_FIELDS = (
    "d_model",
    "heads",
    "ffn",
    "layers",
    "tokens",
    "dtype",
    "G",
    "sparsity",
    "threads",
    "dense_fused_ms",
    "dense_unfused_ms",
    "tw_ms",
    "speedup",
    "speedup_vs_fused",
    "dense_fused_path",
    "tw_fused_path",
    "dense_unfused_path_fused",
    "tw_linear_calls",
    "max_abs_err",
    "within_tolerance",
    "masked_dense_max_abs_err",
    "correct",
    "memory_fraction",
)
DLRM_LINEARS = 14  # 3 bottom + 3·2 cross + 5 top


@pytest.fixture
def one_thread() -> Iterator[None]:
    """The scripts call torch.set_num_threads: restore the session's count afterwards."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def kernel(require) -> None:
    require(
        cpu_kernel_available(),
        "the compiled tilesparse CPU kernel (python -m tilesparse.build_ext)",
    )


def _load(path: Path) -> dict[str, Any]:
    doc = json.loads(path.read_text())
    assert set(doc) >= {"meta", "rows", "cpu_features"}
    assert doc["cpu_features"]["tw_kernel_avx512"] in (True, False)
    assert doc["cpu_features"]["tw_kernel_simd"] in ("avx512", "avx2", "scalar")
    assert doc["cpu_features"]["tw_kernel_avx512"] == (
        doc["cpu_features"]["tw_kernel_simd"] == "avx512"
    )
    assert doc["cpu_features"]["tw_kernel_bf16"] in ("amx", "avx512_bf16", "fp32", "mm")
    assert doc["meta"]["torch_threads"] == 1
    return doc


def _positive_finite(row: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        v = row[name]
        assert isinstance(v, int | float) and not isinstance(v, bool), (name, v)
        assert math.isfinite(v) and v > 0, (name, v)


# -- timing ------------------------------------------------------------------------------------
def test_interleaved_runs_round_robin_with_caps():
    calls: list[str] = []
    fns = {k: (lambda k=k: calls.append(k)) for k in "abc"}
    t = interleaved(fns, repeats=3, warmup=1, caps={"c": 1})
    # warm-up a b c, then rounds: a b c | a b | a b
    assert "".join(calls) == "abc" + "abc" + "ab" + "ab"
    assert list(t) == ["a", "b", "c"]
    assert [t[k].samples for k in "abc"] == [3, 3, 1]
    for v in t.values():
        assert isinstance(v, Timing) and 0 <= v.min_s <= v.median_s and v.iqr_s >= 0
    assert t["c"].iqr_s == 0.0  # one sample has no spread


def test_interleaved_medians_and_bad_arguments():
    med = interleaved_medians(
        {"x": lambda: None, "y": lambda: sum(range(100))}, repeats=2, warmup=0
    )
    assert list(med) == ["x", "y"] and all(v >= 0 for v in med.values())
    with pytest.raises(ValueError, match="repeats"):
        interleaved({"x": lambda: None}, repeats=0)
    with pytest.raises(ValueError, match="warmup"):
        interleaved({"x": lambda: None}, repeats=1, warmup=-1)
    with pytest.raises(ValueError, match="not among"):
        interleaved({"x": lambda: None}, repeats=1, caps={"z": 1})
    with pytest.raises(ValueError, match=">= 1"):
        interleaved({"x": lambda: None}, repeats=1, caps={"x": 0})
    with pytest.raises(ValueError, match="--threads"):
        set_threads(0)


def test_bad_cli_arguments_are_rejected():
    for argv in (
        ["--only", "nope"],
        ["--dtypes", "fp8"],
        ["--sparsities", "1.0"],
        ["--tiles", "0"],
        ["--repeats", "0"],
    ):
        with pytest.raises(SystemExit):
            bench_gemm.parse_args(argv)
    for argv in (["--only", "resnet"], ["--seq", "0"], ["--dlrm-batch", "-1"]):
        with pytest.raises(SystemExit):
            bench_models.parse_args(argv)
    knobs = bench_models.knobs_for(
        bench_models.parse_args(["--seq", "128", "--encoder-batch", "32"])
    )
    assert (knobs["batch"], knobs["seq"], knobs["d_model"]) == (32, 128, 768)
    assert bench_models.knobs_for(bench_models.parse_args(["--quick"]))["d_model"] == 96


def test_dlrm_shapes_follow_the_workload():
    shapes = [(s.K, s.N) for s in bench_gemm.dlrm_shapes() if s.group == "dlrm"]
    assert shapes == [(3456, 1024), (1024, 1024), (1024, 512), (512, 256)]


# -- bench_gemm --quick ------------------------------------------------------------------------
def test_bench_gemm_quick(kernel, one_thread, tmp_path, capsys):
    out = bench_gemm.main(["--quick", "--threads", "1", "--out", str(tmp_path / "gemm.json")])
    doc = _load(out)
    rows = doc["rows"]
    csr_ok = {d: bench_gemm.csr_support(bench_gemm.DTYPES[d]) is None for d in bench_gemm.DTYPES}
    # one shape × one sparsity × both dtypes × both tiles
    assert sorted((r["dtype"], r["G"]) for r in rows) == [
        ("bf16", 64),
        ("bf16", 128),
        ("fp32", 64),
        ("fp32", 128),
    ]
    for r in rows:
        missing = [f for f in GEMM_FIELDS if f not in r]
        assert not missing, missing
        _positive_finite(r, GEMM_POSITIVE)
        assert r["correct"] is True, r
        assert math.isfinite(r["tw_max_abs_err"]) and r["tw_max_abs_err"] >= 0
        assert (r["M"], r["K"], r["N"], r["threads"], r["bias"], r["repeats"]) == (
            256,
            512,
            512,
            1,
            False,
            3,
        )
        s = r["sparsity"]
        assert s == 0.75
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["tw_ms"], rel=1e-12)
        # AUTO: timed beside them, correct, and its route the one the table measured
        _positive_finite(r, ("auto_ms", "auto_vs_dense", "auto_min_ms"))
        assert r["auto_vs_dense"] == pytest.approx(r["dense_ms"] / r["auto_ms"], rel=1e-12)
        assert r["auto_correct"] is True and r["auto_route"] in ("tw", "dense")
        tw_s, dense_s = r["auto_calibration_tw_ms"], r["auto_calibration_dense_ms"]
        assert (r["auto_route"] == "tw") is (tw_s * auto.MARGIN <= dense_s)
        assert r["ideal"] == pytest.approx(1.0 / (1.0 - s), rel=1e-12)
        assert r["fraction_of_ideal"] == pytest.approx(r["speedup"] / r["ideal"], rel=1e-12)
        # the layout: as sparse as asked (within one tile-row of G), memory = values + indices
        assert r["tw_density"] == pytest.approx(1.0 - s, abs=r["G"] / (r["K"] * r["N"]) + 1e-9)
        assert r["values_fraction"] == pytest.approx(r["tw_density"], rel=1e-12)
        assert r["memory_fraction"] == pytest.approx(
            r["values_fraction"] + r["index_fraction"], rel=1e-12
        )
        assert r["index_fraction"] < 0.03
        assert r["kept_columns"] <= r["N"] and r["tiles"] >= math.ceil(r["kept_columns"] / r["G"])
        if csr_ok[r["dtype"]]:
            _positive_finite(r, ("csr_ms", "csr_speedup", "tw_vs_csr", "csr_memory_fraction"))
            assert r["csr_skipped"] is None and r["csr_variant"] and 1 <= r["csr_repeats"] <= 3
            assert r["csr_speedup"] == pytest.approx(r["dense_ms"] / r["csr_ms"], rel=1e-12)
            assert r["tw_vs_csr"] == pytest.approx(r["csr_ms"] / r["tw_ms"], rel=1e-12)
        else:
            assert r["csr_ms"] is None and r["csr_speedup"] is None and r["csr_repeats"] == 0
            assert isinstance(r["csr_skipped"], str) and r["csr_skipped"]
    assert (doc["csr_support"]["fp32"] == "supported") is csr_ok["fp32"]
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    assert len(table) == 2 + len(rows) and "speedup" in table[0]


# -- bench_models --quick ----------------------------------------------------------------------
def test_bench_models_quick(kernel, one_thread, tmp_path, capsys):
    out = bench_models.main(["--quick", "--threads", "1", "--out", str(tmp_path / "models.json")])
    rows = _load(out)["rows"]
    dlrm = [r for r in rows if r["bench"] == "dlrm_dcnv2_dense_forward"]
    enc = [r for r in rows if r["bench"] == "transformer_encoder"]
    assert sorted(r["dtype"] for r in dlrm) == ["bf16", "fp32"] == sorted(r["dtype"] for r in enc)
    assert len(rows) == 4
    for r in dlrm:
        missing = [f for f in DLRM_FIELDS if f not in r]
        assert not missing, missing
        _positive_finite(
            r, ("dense_ms", "tw_ms", "speedup", "ideal", "fraction_of_ideal", "memory_fraction")
        )
        assert r["correct"] is True, r
        assert r["threads"] == 1 and r["G"] == 128 and r["sparsity"] == 0.75
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["tw_ms"], rel=1e-12)
        assert r["auto_vs_dense"] == pytest.approx(r["dense_ms"] / r["auto_ms"], rel=1e-12)
        assert r["auto_correct"] is True and sum(r["auto_routes"].values()) == DLRM_LINEARS
        assert set(r["auto_routes"]) <= {"tw", "dense"}
        assert r["ideal"] == pytest.approx(4.0) and r["fraction_of_ideal"] == pytest.approx(
            r["speedup"] / 4.0
        )
        if r["dtype"] == "fp32":  # the target holds fp32; bf16 is reported beside it
            assert r["target"] == 2.0 and r["meets_target"] is (r["speedup"] >= 2.0)
        else:
            assert r["target"] is None and r["meets_target"] is None
        # every linear condensed and run through the kernel; the memory bound
        assert r["tw_linear_calls"] == DLRM_LINEARS and r["sparse_layers"] == DLRM_LINEARS
        assert r["memory_fraction"] <= 0.25 + 0.005 + 0.03
        assert r["weight_bytes"] == pytest.approx(
            r["memory_fraction"] * r["dense_weight_bytes"], rel=1e-12
        )
    for r in enc:
        missing = [f for f in ENCODER_FIELDS if f not in r]
        assert not missing, missing
        _positive_finite(
            r, ("dense_fused_ms", "dense_unfused_ms", "tw_ms", "speedup", "speedup_vs_fused")
        )
        assert r["correct"] is True, r
        assert r["speedup"] == pytest.approx(r["dense_unfused_ms"] / r["tw_ms"], rel=1e-12)
        assert r["speedup_vs_fused"] == pytest.approx(r["dense_fused_ms"] / r["tw_ms"], rel=1e-12)
        assert r["auto_vs_dense"] == pytest.approx(r["dense_unfused_ms"] / r["auto_ms"], rel=1e-12)
        assert r["auto_correct"] is True and sum(r["auto_routes"].values()) == 2 * r["layers"]
        # the TW model runs its FFNs through the kernel, never torch's fused layer kernel; the
        # unfused baseline really is unfused
        assert r["tw_linear_calls"] == 2 * r["layers"] and r["tw_fused_path"] is False
        assert r["dense_unfused_path_fused"] is False
        assert r["tokens"] == r["batch"] * r["seq"]
    assert next(r for r in enc if r["dtype"] == "fp32")["dense_fused_path"] is True
    for r in rows:  # fp32 within tolerance outright; bf16 rows also carry the dtype's own error
        if r["dtype"] == "fp32":
            assert r["within_tolerance"] is True and r["masked_dense_max_abs_err"] is None
        else:
            assert (
                math.isfinite(r["masked_dense_max_abs_err"]) and r["masked_dense_max_abs_err"] >= 0
            )
        assert r["correct"] is (
            r["within_tolerance"] or r["max_abs_err"] <= 2 * r["masked_dense_max_abs_err"]
        )
    printed = capsys.readouterr().out
    assert "DLRM-DCNv2 dense part" in printed and "TransformerEncoder" in printed


def test_default_dtypes_drop_bf16_only_without_native_bf16(monkeypatch, caplog) -> None:
    from benchmarks.tilesparse import timing

    monkeypatch.setattr(timing, "cpu_flags", lambda: {"avx2", "fma"})
    with caplog.at_level("WARNING"):
        assert timing.default_dtypes(["fp32", "bf16"], quick=False) == ["fp32"]
    assert "--dtypes fp32,bf16" in caplog.text
    assert timing.default_dtypes(["fp32", "bf16"], quick=True) == ["fp32", "bf16"]
    assert bench_gemm.parse_args([]).dtype_list == ["fp32"]
    assert bench_gemm.parse_args(["--dtypes", "bf16"]).dtype_list == ["bf16"]
    assert bench_models.parse_args([]).dtype_list == ["fp32"]
    assert bench_models.parse_args(["--dtypes", "fp32,bf16"]).dtype_list == ["fp32", "bf16"]
    monkeypatch.setattr(timing, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    assert timing.default_dtypes(["fp32", "bf16"], quick=False) == ["fp32", "bf16"]
    assert bench_gemm.parse_args([]).dtype_list == ["fp32", "bf16"]
