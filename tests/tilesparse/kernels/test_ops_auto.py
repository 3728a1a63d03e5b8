"""``Backend.AUTO`` on the CPU (:mod:`tilesparse.kernels.auto`): both routes give the TW result,
the crossover is measured once per layer signature and batch range and kept in the machine's
table, the cached dense weight follows the layout's tensors, and the op still traces, compiles
and differentiates."""

from __future__ import annotations

import json
import time

import pytest
import torch

from tests.tilesparse.tw_cases import int_tensor, tw_random_mask
from tests.tolerances import tol
from tilesparse import ops
from tilesparse.format import TWLayout, condense, reference_matmul
from tilesparse.kernels import auto
from tilesparse.kernels import cpu as cpu_kernels
from tilesparse.linear import TileSparseLinear


@pytest.fixture
def table(tmp_path, monkeypatch, ext):
    """The process's AUTO table, emptied and backed by a file in ``tmp_path``."""
    monkeypatch.setenv(auto.AUTO_CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(auto.AUTO_ROUTE_ENV, raising=False)
    auto.crossover_table().clear()
    yield auto.crossover_table()
    auto.crossover_table().clear()


def _layout(K: int, N: int, G: int, seed: int, dtype=torch.float32) -> TWLayout:
    gen = torch.Generator().manual_seed(seed)
    w = int_tensor((K, N), gen, dtype=dtype)
    return condense(w, tw_random_mask(K, N, G, 0.5, gen, drop_cols=0.25), G)


class _Counter:
    """Wraps :func:`tilesparse.kernels.auto.calibrate`, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.real = auto.calibrate

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.mark.parametrize("route", ["tw", "dense"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_both_routes_give_the_tw_result(table, monkeypatch, route, dtype):
    monkeypatch.setenv(auto.AUTO_ROUTE_ENV, route)
    lay = _layout(200, 150, 32, 1, dtype)
    gen = torch.Generator().manual_seed(2)
    x = int_tensor((33, 200), gen, dtype=dtype)
    b = int_tensor((150,), gen, dtype=dtype)
    for bias in (None, b):
        got = ops.tw_linear(x, lay, bias, "auto")
        torch.testing.assert_close(got, ops.tw_linear(x, lay, bias, "cpu"), **tol("tw_gemm", dtype))
        if dtype != torch.bfloat16:  # integer-valued fp32/fp64 sums are exact on both routes
            assert torch.equal(got, reference_matmul(x, lay, bias))
    xr = torch.randn(17, 200, generator=gen).to(dtype)
    torch.testing.assert_close(
        ops.tw_linear(xr, lay, b, "auto"), reference_matmul(xr, lay, b), **tol("tw_gemm", dtype)
    )
    assert len(table) == 0  # a forced route measures nothing


def test_measured_once_per_batch_range_and_kept_in_the_file(table, monkeypatch, tmp_path):
    counter = _Counter()
    monkeypatch.setattr(auto, "calibrate", counter)
    lay = _layout(96, 80, 16, 3)
    gen = torch.Generator().manual_seed(4)
    xs = {m: int_tensor((m, 96), gen) for m in (5, 7, 8)}
    assert ops.auto_decision(lay, 5) is None
    for m in (5, 7, 5):  # 5 and 7 share the range [4, 8)
        assert torch.equal(ops.tw_linear(xs[m], lay, None, "auto"), reference_matmul(xs[m], lay))
    assert counter.calls == 1
    d = ops.auto_decision(lay, 6)
    assert d is not None and d.route in (auto.Route.TW, auto.Route.DENSE) and d.rounds >= 2
    assert d.tw_s > 0 and d.dense_s > 0
    assert (d.route is auto.Route.TW) == (d.tw_s * auto.MARGIN <= d.dense_s)
    ops.tw_linear(xs[8], lay, None, "auto")  # [8, 16): measured again
    assert counter.calls == 2 and len(table) == 2
    # another thread count is another signature
    assert ops.auto_decision(lay, 6, threads=torch.get_num_threads() + 1) is None
    # the file holds both; a fresh process (a cleared table) reads them instead of measuring
    (path,) = tmp_path.glob("*.json")
    doc = json.loads(path.read_text())
    assert doc["version"] == 1 and len(doc["decisions"]) == 2
    assert {r["key"]["batch_lo"] for r in doc["decisions"]} == {4, 8}
    table.clear()
    assert ops.auto_decision(lay, 7) == d
    ops.tw_linear(xs[7], lay, None, "auto")
    assert counter.calls == 2


def test_memory_only_table_and_an_unreadable_file(table, monkeypatch, tmp_path, caplog):
    lay = _layout(64, 48, 16, 5)
    x = int_tensor((9, 64), torch.Generator().manual_seed(6))
    monkeypatch.setenv(auto.AUTO_CACHE_ENV, "0")
    table.clear()
    ops.tw_linear(x, lay, None, "auto")
    assert len(table) == 1 and not list(tmp_path.glob("*.json"))
    # a corrupt file is reported and measured over, never trusted
    monkeypatch.setenv(auto.AUTO_CACHE_ENV, str(tmp_path))
    table.clear()
    ops.tw_linear(x, lay, None, "auto")
    (path,) = tmp_path.glob("*.json")
    path.write_text("{not json")
    table.clear()
    with caplog.at_level("WARNING", logger="tilesparse.kernels.auto"):
        assert ops.auto_decision(lay, 9) is None
    assert any("unreadable" in r.getMessage() for r in caplog.records)


def test_calibration_rule_prefers_dense_on_a_tie():
    def slow() -> torch.Tensor:
        time.sleep(0.004)
        return torch.zeros(1)

    def fast() -> torch.Tensor:
        return torch.ones(1)

    y, d = auto.calibrate(fast, slow, budget_s=0.0)
    assert d.route is auto.Route.TW and d.rounds == 2 and d.tw_speedup > auto.MARGIN
    assert torch.equal(y, torch.zeros(1))  # the last call's result (dense ran last)
    _, d = auto.calibrate(slow, fast, budget_s=0.0)
    assert d.route is auto.Route.DENSE
    _, d = auto.calibrate(slow, slow, budget_s=1.0, max_rounds=3)
    assert d.route is auto.Route.DENSE and d.rounds == 3  # a tie: TW is not MARGIN faster


def test_dense_weight_follows_the_layout(table, monkeypatch):
    monkeypatch.setenv(auto.AUTO_ROUTE_ENV, "dense")
    dense = torch.nn.Linear(40, 24)
    mask_kn = tw_random_mask(40, 24, 8, 0.5, torch.Generator().manual_seed(7))
    layer = TileSparseLinear.from_dense(dense, mask_kn=mask_kn, tile=8)
    x = torch.randn(6, 40)
    want = x @ (dense.weight.detach().T * mask_kn) + dense.bias.detach()
    with torch.no_grad():
        torch.testing.assert_close(layer(x), want, **tol("tw_layer", torch.float32))
        layer.values.mul_(2)  # an in-place edit: the cached dense weight is rebuilt
        want2 = x @ (2 * dense.weight.detach().T * mask_kn) + dense.bias.detach()
        torch.testing.assert_close(layer(x), want2, **tol("tw_layer", torch.float32))
        other = torch.zeros(40, 24, dtype=torch.bool)
        other[:8, :8] = True
        layer.set_layout(condense(dense.weight.detach().T, other, 8))  # replaced tensors
        want3 = x @ (dense.weight.detach().T * other) + dense.bias.detach()
        torch.testing.assert_close(layer(x), want3, **tol("tw_layer", torch.float32))


def test_a_layer_that_chose_tw_keeps_no_dense_copy(table, monkeypatch):
    monkeypatch.setattr(
        auto,
        "calibrate",
        lambda run_tw, run_dense: (run_tw(), auto.AutoDecision(auto.Route.TW, 1, 2, 2)),
    )
    lay = _layout(64, 64, 16, 8)
    x = torch.randn(4, 64)
    torch.testing.assert_close(
        ops.tw_linear(x, lay, None, "auto"), reference_matmul(x, lay), **tol("tw_gemm")
    )
    assert id(lay.values) not in auto._DENSE
    monkeypatch.setattr(
        auto,
        "calibrate",
        lambda run_tw, run_dense: (run_dense(), auto.AutoDecision(auto.Route.DENSE, 2, 1, 2)),
    )
    lay2 = _layout(64, 64, 16, 9)
    ops.tw_linear(x, lay2, None, "auto")
    assert id(lay2.values) in auto._DENSE


def test_inference_mode_layout_takes_tw_without_measuring(table):
    with torch.inference_mode():
        lay = _layout(48, 40, 8, 10)
        x = torch.randn(5, 48)
        y = ops.tw_linear(x, lay, None, "auto")
    torch.testing.assert_close(y, reference_matmul(x, lay), **tol("tw_gemm"))
    assert len(table) == 0


def test_without_the_kernel_auto_is_dense(table, monkeypatch):
    lay = _layout(30, 20, 4, 11)
    x = int_tensor((3, 30), torch.Generator().manual_seed(12))
    monkeypatch.setenv(cpu_kernels.DISABLE_ENV, "1")
    cpu_kernels.load_extension.cache_clear()
    try:
        assert torch.equal(ops.tw_linear(x, lay, None, "auto"), reference_matmul(x, lay))
        assert id(lay.values) in auto._DENSE and len(table) == 0
    finally:
        monkeypatch.delenv(cpu_kernels.DISABLE_ENV)
        cpu_kernels.load_extension.cache_clear()


def test_bad_settings_and_arguments_are_named(table, monkeypatch):
    lay = _layout(16, 16, 4, 13)
    monkeypatch.setenv(auto.AUTO_ROUTE_ENV, "fastest")
    with pytest.raises(ValueError, match="TILESPARSE_AUTO_ROUTE='fastest'"):
        ops.tw_linear(torch.randn(2, 16), lay, None, "auto")
    monkeypatch.delenv(auto.AUTO_ROUTE_ENV)
    with pytest.raises(ValueError, match=r"got \[0, -3\]"):
        ops.calibrate_auto(lay, [4, 0, -3])
    assert len(table) == 0
    with pytest.raises(ValueError, match="got -1"):
        auto.batch_range(-1)
    assert [auto.batch_range(m) for m in (0, 1, 3, 4, 4096)] == [
        (0, 1),
        (1, 2),
        (2, 4),
        (4, 8),
        (4096, 8192),
    ]


def test_calibrate_auto_ahead_of_the_calls(table, monkeypatch):
    lay = _layout(64, 32, 16, 14)
    decisions = ops.calibrate_auto(lay, [1, 3, 200])
    assert [ops.auto_decision(lay, m) for m in (1, 2, 255)] == decisions
    counter = _Counter()
    monkeypatch.setattr(auto, "calibrate", counter)
    ops.tw_linear(torch.randn(130, 64), lay, None, "auto")
    assert counter.calls == 0


@pytest.mark.parametrize("route", ["", "dense"])
def test_autograd_and_compile_through_auto(table, monkeypatch, route):
    """Gradients in float64 (measured route, and dense forced); ``torch.compile`` traces the
    op's fake kernel and runs AUTO (``torch.export`` of an AUTO layer: test_ops.py)."""
    monkeypatch.setenv(auto.AUTO_ROUTE_ENV, route)
    gen = torch.Generator().manual_seed(15)
    dense = torch.nn.Linear(12, 10, dtype=torch.float64)
    mask = tw_random_mask(12, 10, 4, 0.5, gen, 0.2)
    layer = TileSparseLinear.from_dense(dense, mask_kn=mask, tile=4)
    x = torch.randn(3, 12, dtype=torch.float64, generator=gen, requires_grad=True)
    assert torch.autograd.gradcheck(layer, (x,))
    model = torch.nn.Sequential(layer.float(), torch.nn.ReLU())
    x32 = torch.randn(7, 12, generator=gen)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x32), model(x32))
