"""Calibrated TW prune of layer pairs as neurons (tilesparse.neurons), and the last check that
keeps the uncalibrated prune when the calibrated one is worse on held-out samples."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import tilesparse
import tilesparse.refit
from tilesparse.calibrate import InputStats
from tilesparse.neurons import bias_refit


def _ffn(act: nn.Module, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 64), act, nn.Linear(64, 16))


def _batches(n: int = 8, seed: int = 1) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 24, 16, generator=g),) for _ in range(n)]


def _error(model: nn.Module, dense: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        want = dense(x)
        return float((model(x) - want).pow(2).sum() / want.pow(2).sum())


def test_an_ffn_is_pruned_as_neurons_and_beats_the_uncalibrated_prune() -> None:
    dense = _ffn(nn.GELU())
    model, plain = copy.deepcopy(dense), copy.deepcopy(dense)
    cfg = tilesparse.TileSparseConfig(sparsity=0.5, tile=16)
    tilesparse.prune_(plain, cfg)
    pruner = tilesparse.prune_(model, cfg, calibration=_batches())
    a, b = pruner.mask("0"), pruner.mask("2")
    kept = a.any(0)
    assert int(kept.sum()) == 32 and torch.equal(a, kept.expand_as(a))  # whole columns
    assert torch.equal(b, kept.unsqueeze(1).expand_as(b))  # the same neurons' rows
    assert tilesparse.is_tile_wise(a, 16) and tilesparse.is_tile_wise(b, 16)
    assert abs(pruner.overall_sparsity() - 0.5) < 1e-9
    assert [(r.fqn, r.neurons_with) for r in pruner.reconstructions] == [("0", "2"), ("2", "0")]
    check = pruner.output_check
    assert check is not None and check.calibrated_kept
    assert check.calibrated_error < check.uncalibrated_error
    x = torch.randn(512, 16)  # new inputs
    assert _error(model, dense, x) < 0.5 * _error(plain, dense, x)


def test_a_pair_not_joined_elementwise_is_pruned_layer_by_layer() -> None:
    """A LayerNorm between the layers mixes the units: no neuron pair."""
    model = _ffn(nn.LayerNorm(64))
    pruner = tilesparse.prune_(
        model, tilesparse.TileSparseConfig(sparsity=0.5, tile=16), calibration=_batches()
    )
    assert [r.neurons_with for r in pruner.reconstructions] == [None, None]


def test_bias_refit_matches_a_direct_least_squares_solve() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(300, 6, generator=g, dtype=torch.float64) + 2.0
    w = torch.randn(6, 3, generator=g, dtype=torch.float64)
    bias = torch.randn(3, generator=g, dtype=torch.float64)
    st = InputStats(torch.zeros(6, 6, dtype=torch.float64))
    st.add(h.unsqueeze(0))  # one sample: nothing held out
    kept = torch.tensor([True, False, True, True, False, True])
    wf, bf = bias_refit(w, bias, kept, st, damping=0.0)
    design = torch.cat([h[:, kept], torch.ones(300, 1, dtype=torch.float64)], 1)
    want = torch.linalg.lstsq(design, h @ w + bias).solution
    torch.testing.assert_close(wf[kept], want[:-1])
    assert bf is not None
    torch.testing.assert_close(bf, want[-1])
    assert bool((wf[~kept] == 0).all())


def test_a_calibrated_prune_worse_on_held_out_samples_is_replaced_by_the_uncalibrated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A (sabotaged) refit that makes the outputs worse: the last check keeps the magnitude
    prune, exactly as prune_ without calibration gives it."""
    real = tilesparse.refit.fit_layer

    def bad_fit(*args, **kwargs):  # type: ignore[no-untyped-def]
        mask, weight, rec = real(*args, **kwargs)
        return mask, weight * 5.0, rec

    monkeypatch.setattr(tilesparse.refit, "fit_layer", bad_fit)
    dense = _ffn(nn.GELU())
    model, plain = copy.deepcopy(dense), copy.deepcopy(dense)
    cfg = tilesparse.TileSparseConfig(pattern=tilesparse.Pattern.EW, sparsity=0.5)
    tilesparse.prune_(plain, cfg)
    pruner = tilesparse.prune_(model, cfg, calibration=_batches())
    check = pruner.output_check
    assert check is not None and not check.calibrated_kept
    assert check.calibrated_error > check.uncalibrated_error
    for i in (0, 2):
        torch.testing.assert_close(model[i].weight, plain[i].weight)
        torch.testing.assert_close(model[i].bias, plain[i].bias)
    assert pruner.reconstructions == []
