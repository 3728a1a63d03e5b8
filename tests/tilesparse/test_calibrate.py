"""Calibration: activation-aware importance, least-squares reconstruction layer by layer,
and what a bad calibration does (a clear error naming the layer, the model unchanged)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrize

import tilesparse
from tests.tolerances import tol
from tilesparse.calibrate import HOLD_OUT, CalibrationError, reconstruct


def _dependent_inputs(rows: int, seed: int) -> torch.Tensor:
    """``(rows, 6)``: inputs 3..5 are combinations of inputs 0..2, so a layer keeping rows
    0..2 can reproduce any dense layer's outputs on them exactly."""
    g = torch.Generator().manual_seed(seed)
    x0, x1, x2 = torch.randn(rows, 3, generator=g).unbind(1)
    return torch.stack([x0, x1, x2, x0 + x1, 2 * x2, x0 - x2], dim=1)


def _exact_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8))
    with torch.no_grad():  # inputs 0..2 get the large weights, so magnitude keeps those rows
        model[0].weight[:, :3] += 5.0
    return model


def test_reconstruction_is_exact_in_a_constructed_case() -> None:
    model = _exact_model()
    x = _dependent_inputs(256, 1)
    x_new = _dependent_inputs(64, 2)  # held out, from the same subspace
    want = model(x_new).detach()
    cfg = tilesparse.TileSparseConfig(
        pattern="tw_rows", sparsity=0.5, tile=4, column_share=0.0, damping=0.0
    )
    masked_only = _exact_model()
    tilesparse.prune_(masked_only, cfg)
    pruner = tilesparse.prune_(model, cfg, calibration=[(x[:128],), (x[128:],)])
    keep_rows_0_2 = torch.zeros(6, 8, dtype=torch.bool)
    keep_rows_0_2[:3] = True
    assert torch.equal(pruner.mask("0"), keep_rows_0_2)
    torch.testing.assert_close(model(x_new), want, **tol("tw_layer", torch.float32))
    assert (masked_only(x_new) - want).abs().max() > 1.0  # the mask alone is far off
    (rec,) = pruner.reconstructions
    assert rec.fqn == "0" and (rec.rows, rec.held_out_rows) == (192, 64)  # every 4th row held
    assert rec.masked_error > 1e-3 and rec.reconstructed_error < 1e-10
    assert rec.accepted and rec.held_out_reconstructed_error < 1e-10 < rec.held_out_masked_error


def test_reconstruct_solves_each_tile_on_its_own_rows() -> None:
    """Against a direct least-squares solve per tile (float64, no damping)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(200, 10, generator=g, dtype=torch.float64)
    w = torch.randn(10, 6, generator=g, dtype=torch.float64)
    mask = torch.zeros(10, 6, dtype=torch.bool)
    mask[[0, 2, 5, 7], :3] = True  # tile {0,1,2}: rows 0 2 5 7
    mask[[1, 2, 9], 3:5] = True  # tile {3,4}: rows 1 2 9; column 5 pruned whole
    got = reconstruct(w, mask, x.T @ x, damping=0.0)
    for cols, rows in (([0, 1, 2], [0, 2, 5, 7]), ([3, 4], [1, 2, 9])):
        want = torch.linalg.lstsq(x[:, rows], x @ w[:, cols]).solution
        torch.testing.assert_close(got[rows][:, cols], want, **tol("tw_layer", torch.float64))
    assert torch.equal(got != 0, mask)


def test_reconstruct_damping_pulls_toward_the_kept_weights() -> None:
    """The damped solve against the stacked least squares ``[X; √λ·I]·Ŵ ≈ [X·W; √λ·W[R]]``,
    and along directions the inputs never take (fewer rows than inputs) the kept weights stay
    as they were instead of shrinking toward zero."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 10, generator=g, dtype=torch.float64)  # 6 rows for 10 inputs: rank 6
    w = torch.randn(10, 4, generator=g, dtype=torch.float64)
    mask = torch.zeros(10, 4, dtype=torch.bool)
    rows = [0, 1, 3, 4, 6, 7, 8, 9]
    mask[rows, :] = True
    h = x.T @ x
    got = reconstruct(w, mask, h, damping=0.1)
    lam = 0.1 * float(h.diagonal().mean())
    a = torch.cat([x[:, rows], lam**0.5 * torch.eye(len(rows), dtype=torch.float64)])
    b = torch.cat([x @ w, lam**0.5 * w[rows]])
    want = torch.linalg.lstsq(a, b).solution
    torch.testing.assert_close(got[rows], want, **tol("tw_layer", torch.float64))
    assert torch.equal(got != 0, mask)
    # the part of the change outside the inputs' row space: zero (the kept weights there are
    # the dense ones); a ridge toward zero would shrink them
    _, _, vh = torch.linalg.svd(x[:, rows])
    null = vh[6:].T  # (8, 2): directions of the kept inputs no calibration row takes
    torch.testing.assert_close(
        null.T @ (got[rows] - w[rows]),
        torch.zeros(2, 4, dtype=torch.float64),
        **tol("tw_layer", torch.float64),
    )
    assert float((null.T @ w[rows]).abs().max()) > 0.1  # there was something to keep
    # no damping, dependent inputs: the least-norm change, still none along those directions
    exact = reconstruct(w, mask, h, damping=0.0)
    torch.testing.assert_close(
        null.T @ (exact[rows] - w[rows]),
        torch.zeros(2, 4, dtype=torch.float64),
        **tol("tw_layer", torch.float64),
    )
    fit = torch.linalg.lstsq(x[:, rows], x @ w).solution  # the same outputs on the inputs
    torch.testing.assert_close(
        x[:, rows] @ exact[rows], x[:, rows] @ fit, **tol("tw_layer", torch.float64)
    )


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 16))


def _batches(n: int = 4, seed: int = 1) -> list[tuple[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 24, generator=g),) for _ in range(n)]


def test_calibration_keeps_the_magnitude_mask_and_tile_structure() -> None:
    """Explicit knobs win: magnitude scores under one global threshold keep their masks, and
    only the kept weights are refitted."""
    cfg = tilesparse.TileSparseConfig(
        sparsity=0.75, tile=8, importance="magnitude", global_threshold=True, column_share=0.5
    )
    plain, calibrated = _mlp(), _mlp()
    p0 = tilesparse.prune_(plain, cfg)
    p1 = tilesparse.prune_(calibrated, cfg, calibration=_batches())
    for fqn in ("0", "2"):
        mask = p1.mask(fqn)
        assert torch.equal(mask, p0.mask(fqn))
        assert tilesparse.is_tile_wise(mask, 8)
        weight_kn = calibrated.get_submodule(fqn).weight.detach().T
        assert torch.equal(weight_kn != 0, mask)  # reconstructed values only where kept
    for r in p1.reconstructions:  # refitted where the held-out samples agree, else as plain
        same = torch.equal(
            calibrated.get_submodule(r.fqn).weight, plain.get_submodule(r.fqn).weight
        )
        assert same is not r.accepted, r
    # layer 0's inputs are independent (H ∝ I): a refit cannot help; layer 2's are not
    assert [r.accepted for r in p1.reconstructions] == [False, True]


def test_layers_are_reconstructed_in_order_on_pruned_inputs() -> None:
    """The second layer is fitted on the inputs that the pruned, reconstructed first layer
    gives it (SparseGPT's order), against its dense weight."""
    dense = _mlp()
    model = _mlp()
    batches = _batches()
    # an explicit column share: layer by layer, not as a neuron pair (test_oneshot_neurons)
    cfg = tilesparse.TileSparseConfig(sparsity=0.5, tile=8, damping=0.01, column_share=0.5)
    pruner = tilesparse.prune_(model, cfg, calibration=batches)
    with torch.no_grad():
        h = torch.cat([model[1](model[0](x)) for (x,) in batches]).double()
    fit = h[torch.arange(h.shape[0]) % HOLD_OUT != HOLD_OUT - 1]  # rows numbered across calls
    want = reconstruct(dense[2].weight.detach().T, pruner.mask("2"), fit.T @ fit, damping=0.01)
    assert pruner.reconstructions[1].accepted
    torch.testing.assert_close(model[2].weight.detach().T, want, **tol("tw_layer", torch.float32))
    assert [r.fqn for r in pruner.reconstructions] == ["0", "2"]


class _Rank2(nn.Module):
    """A linear whose calibration inputs span 2 of its 16 dimensions, and whose held-out
    (and later) inputs do not: a refit on them generalises badly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_refit_that_does_not_lower_the_held_out_error_is_rejected() -> None:
    """Fit samples on a 2-dimensional subspace, held-out samples in general position: the
    undamped refit fits the fit samples and is worse than the mask alone on the held-out
    ones, so the plain masked weights are kept (and reported)."""
    g = torch.Generator().manual_seed(2)
    basis = torch.randn(2, 16, generator=g)
    batches = []
    for i in range(8):  # one sample (a 2-D batch row block) per call; every 4th held out
        x = (
            torch.randn(32, 16, generator=g)
            if i % 4 == 3
            else torch.randn(32, 2, generator=g) @ basis
        )
        batches.append((x.unsqueeze(0),))  # (1, 32, 16): one sample per call
    model, plain = _Rank2(), _Rank2()
    cfg = tilesparse.TileSparseConfig(
        pattern="ew", sparsity=0.5, importance="magnitude", damping=0.0
    )
    tilesparse.prune_(plain, cfg)
    pruner = tilesparse.prune_(model, cfg, calibration=batches)
    (rec,) = pruner.reconstructions
    assert rec.reconstructed_error < rec.masked_error  # it does fit the fit samples
    assert not rec.accepted and rec.held_out_error == rec.held_out_masked_error
    assert torch.equal(model.fc.weight, plain.fc.weight)  # the magnitude-pruned weights


def test_a_calibrated_layer_is_never_worse_than_magnitude_on_held_out_samples() -> None:
    """Defaults plus calibration: at the last layer's outputs, and per layer pruned alone, the
    held-out error of what was kept is at most the uncalibrated (magnitude) prune's, for each
    pattern."""
    for pattern in ("tw", "tw_rows", "ew", "nm"):
        model = _mlp()
        cfg = tilesparse.TileSparseConfig(
            pattern=pattern, sparsity=None if pattern == "nm" else 0.5
        )
        pruner = tilesparse.prune_(model, cfg, calibration=_batches(8))
        check = pruner.output_check
        assert check is not None and check.calibrated_kept, pattern
        assert check.calibrated_error <= check.uncalibrated_error, pattern
        for r in pruner.reconstructions:
            if r.neurons_with is None:  # a neuron pair is judged at its second layer's output
                assert r.held_out_error <= r.held_out_magnitude_error + 1e-12, (pattern, r)
        assert abs(pruner.overall_sparsity() - 0.5) < 0.02, pattern


def test_activation_importance_follows_the_inputs() -> None:
    """Equal weights: the inputs with the larger norms keep their rows, the structure stays TW."""
    model = nn.Sequential(nn.Linear(8, 4, bias=False))
    nn.init.constant_(model[0].weight, 1.0)
    scale = torch.tensor([1.0, 9, 1, 9, 1, 9, 1, 9])
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 8, generator=g) * scale,)]
    cfg = tilesparse.TileSparseConfig(
        pattern="tw_rows", sparsity=0.5, tile=4, importance="activation"
    )
    pruner = tilesparse.prune_(model, cfg, calibration=batches)
    mask = pruner.mask("0")
    assert torch.equal(mask.any(dim=1), scale > 1)
    assert tilesparse.is_tile_wise(mask, 4)
    with pytest.raises(ValueError, match="importance='activation' .* pass calibration="):
        tilesparse.prune_(nn.Sequential(nn.Linear(8, 4)), cfg)


def _unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    assert not any(parametrize.is_parametrized(m) for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def _nan_second_batch() -> list[tuple[torch.Tensor]]:
    b = _batches(2)
    b[1][0][3, 5] = float("nan")
    return b


def _raises(model: nn.Module) -> None:
    model(torch.randn(2, 24))
    raise RuntimeError("tokenizer failed")


@pytest.mark.parametrize(
    ("calibration", "match"),
    [
        (lambda m: None, r"never ran pruned layer\(s\) \['0', '2'\]"),
        ([(torch.randn(2, 7),)], r"fed layer '0' inputs of 7 features, it takes 24"),
        (_raises, r"raised RuntimeError: tokenizer failed \(last pruned layer entered: '2'\)"),
        (_nan_second_batch(), r"layer '0' a non-finite input .*1 of 768 values"),
        ([], "empty iterable"),
        ([torch.randn(2, 24)], r"calibration\[0\] must be a tuple"),
        (42, "must be a callable"),
    ],
)
def test_bad_calibration_names_the_layer_and_changes_nothing(calibration, match) -> None:
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for importance in ("magnitude", "activation"):
        cfg = tilesparse.TileSparseConfig(sparsity=0.5, tile=8, importance=importance)
        with pytest.raises(CalibrationError, match=match):
            tilesparse.prune_(model, cfg, calibration=calibration)
        _unchanged(model, before)


def test_nan_in_a_later_pass_rolls_back() -> None:
    """A calibration that turns bad after the first pass (the layer-by-layer passes) raises
    naming the layer, and the layers already pruned and reconstructed are put back."""
    model = _mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []

    def flaky(m: nn.Module) -> None:
        calls.append(1)
        x = torch.randn(16, 24)
        if len(calls) > 1:
            x[0, 0] = float("nan")
        m(x)

    with pytest.raises(CalibrationError, match="layer '[02]' (a|gave) non-finite"):
        tilesparse.prune_(
            model, tilesparse.TileSparseConfig(sparsity=0.5, tile=8), calibration=flaky
        )
    _unchanged(model, before)


def _fit_rows(x: torch.Tensor) -> torch.Tensor:
    """The rows of a ``(rows, K)`` calibration that the fit sees (the others are held out)."""
    return x[torch.arange(x.shape[0]) % HOLD_OUT != HOLD_OUT - 1]


def test_ew_with_calibration_defaults_to_sparsegpt_or_wanda_without_refit() -> None:
    """EW, default config plus calibration: each layer takes SparseGPT (damping 0.1 on the
    fit samples, saliencies compared within each output) or Wanda's per-output mask with the
    dense weights, whichever has the lower held-out error; no per-column refit."""
    torch.manual_seed(0)
    mix = torch.randn(3, 8) * torch.tensor([1.0, 8, 1, 8, 2, 4, 1, 8])
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(32, 3, generator=g) @ mix,) for _ in range(4)]  # rank 3 of 8
    x = torch.cat([b[0] for b in batches])
    model = nn.Sequential(nn.Linear(8, 6))
    dense = model[0].weight.detach().clone()
    pruner = tilesparse.prune_(
        model, tilesparse.TileSparseConfig(pattern="ew", sparsity=0.5), calibration=batches
    )
    (rec,) = pruner.reconstructions
    fit = _fit_rows(x).double()
    mask, weight = tilesparse.sparsegpt(dense.T, fit.T @ fit, 0.5, 0.1, per_output=True)
    assert rec.importance is None and rec.accepted and rec.damping == 0.1  # SparseGPT won
    assert torch.equal(pruner.mask("0"), mask)
    torch.testing.assert_close(model[0].weight.detach(), weight.T, **tol("tw_layer", torch.float32))
    assert rec.held_out_reconstructed_error < rec.held_out_masked_error

    # independent inputs of very different scales: Wanda's mask, dense weights kept
    scale = torch.tensor([1.0, 8, 1, 8, 2, 4, 1, 8])
    indep = [(torch.randn(32, 8, generator=g) * scale,) for _ in range(4)]
    xi = torch.cat([b[0] for b in indep])
    model = nn.Sequential(nn.Linear(8, 6))
    dense = model[0].weight.detach().clone()
    cfg = tilesparse.TileSparseConfig(pattern="ew", sparsity=0.5)
    pruner = tilesparse.prune_(model, cfg, calibration=indep)
    (rec,) = pruner.reconstructions
    if rec.importance is tilesparse.Importance.ACTIVATION:  # Wanda won: dense weights kept
        score = dense.T.abs() * xi.double().pow(2).sum(0).sqrt().float().unsqueeze(1)
        assert torch.equal(pruner.mask("0"), tilesparse.ew_per_output_mask(score, 0.5))
        assert torch.equal(model[0].weight.detach(), dense * pruner.mask("0").T)
        assert not rec.accepted and rec.reconstructed_error == rec.masked_error
    else:
        assert rec.importance is None and rec.accepted


def test_sparsegpt_is_the_masked_magnitude_on_a_diagonal_gram() -> None:
    """Uncorrelated inputs (diagonal ``H``): no update crosses inputs, the kept weights are
    the dense ones, the mask the best ``w²·(H_kk + λ)`` of each block; sparsity 0 is the
    identity; a correlated Gram lowers the error below the plain mask's."""
    w = torch.tensor([[4.0, -1, 2], [0.5, 3, -2], [1.5, 1.2, 0.9], [-3.2, 0.25, 2.2]])  # (K=4, N=3)
    h = torch.diag(torch.tensor([1.0, 4, 1, 0.25])).double()
    mask, out = tilesparse.sparsegpt(w, h, 0.5, damping=1e-6, block=4)
    saliency = w.double().pow(2) * h.diagonal().unsqueeze(1)
    expected = torch.zeros(12, dtype=torch.bool)
    expected[saliency.flatten().argsort(descending=True)[:6]] = True
    assert torch.equal(mask, expected.view(4, 3))
    torch.testing.assert_close(out, w * mask, **tol("tw_layer", torch.float32))
    per_out, _ = tilesparse.sparsegpt(w, h, 0.5, damping=1e-6, block=4, per_output=True)
    # per output (a column here): the 2 of 4 inputs with the largest w²·H_kk
    expected_per = torch.zeros(4, 3, dtype=torch.bool)
    expected_per.scatter_(0, saliency.argsort(dim=0, descending=True)[:2], True)
    assert torch.equal(per_out, expected_per)
    full_mask, same = tilesparse.sparsegpt(w, h, 0.0, damping=0.1)
    assert bool(full_mask.all()) and torch.equal(same, w)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g) @ torch.randn(3, 4, generator=g)
    gram = (x.T @ x).double()
    mask, out = tilesparse.sparsegpt(w, gram, 0.5, damping=0.01)
    err = tilesparse.calibrate.reconstruction_error
    assert err(w.double(), out.double(), gram) < err(w.double(), (w * mask).double(), gram)
    with pytest.raises(ValueError, match="damping must be finite and > 0"):
        tilesparse.sparsegpt(w, h, 0.5, damping=0.0)


def test_ew_per_output_mask_keeps_the_same_count_in_every_output() -> None:
    scores = torch.tensor([[5.0, 0, 1], [4, 1, 2], [0, 2, 3], [1, 3, 0], [2, 9, 9]])
    mask = tilesparse.ew_per_output_mask(scores, 0.4)  # K = 5: keep 3 per column
    expected = torch.tensor([[1, 0, 0], [1, 0, 1], [0, 1, 1], [0, 1, 0], [1, 1, 1]]).bool()
    assert torch.equal(mask, expected)
    assert not tilesparse.ew_per_output_mask(scores, 0.9).any()  # round(5 * 0.1) = 0
    with pytest.raises(ValueError, match="sparsity must be in"):
        tilesparse.ew_per_output_mask(scores, 1.0)


def test_tile_obs_keeps_whole_rows_per_tile_with_their_least_squares_weights() -> None:
    """Tile-structured OBS: every tile of ``G`` output columns keeps the same number of whole
    input rows; the kept weights are the damped least-squares fit of the dense tile's outputs
    on those rows (checked against ``lstsq``); inputs 3..5 depend on inputs 0..2, so the
    greedy removal drops dependent rows and every tile's output is reproduced exactly."""
    x = _dependent_inputs(200, seed=0).double()
    g = torch.Generator().manual_seed(1)
    w = torch.randn(6, 5, generator=g).double()  # (K=6, N=5): tiles {0, 1}, {2, 3}, {4}
    gram = x.T @ x
    mask, out = tilesparse.tile_obs(w, gram, 0.5, damping=1e-9, tile=2)
    assert torch.equal(mask.sum(0), torch.full((5,), 3))
    for cols in ([0, 1], [2, 3], [4]):
        rows = mask[:, cols[0]].nonzero().flatten()
        assert torch.equal(mask[:, cols], mask[:, cols[:1]].expand(6, len(cols)))
        ls = torch.linalg.lstsq(x[:, rows], x @ w[:, cols]).solution
        torch.testing.assert_close(out[rows][:, cols], ls, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x @ out[:, cols], x @ w[:, cols], atol=1e-5, rtol=1e-5)
    assert not out[~mask].any()
    with pytest.raises(ValueError, match="tile must be a positive integer"):
        tilesparse.tile_obs(w, gram, 0.5, damping=0.1, tile=0)


@pytest.mark.parametrize("sparsity", [0.3, 0.7])
def test_sparsegpt_per_output_prunes_the_exact_count_of_every_output(sparsity: float) -> None:
    """``K = 384`` spans three blocks of 128: every output still drops exactly the count of
    Wanda's per-output mask, ``K - round(K·(1 - s))`` (115 at 0.3, 269 at 0.7), not the
    per-block rounded ``3 · round(128·s)``."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 32, generator=g).double()
    x = torch.randn(512, 384, generator=g).double()
    mask, _ = tilesparse.sparsegpt(w, x.T @ x, sparsity, 0.1, per_output=True)
    wanda = tilesparse.ew_per_output_mask(w.abs(), sparsity)
    assert torch.equal(mask.sum(0), wanda.sum(0))
    assert torch.equal(mask.sum(0), torch.full((32,), 384 - round(384 * sparsity)))


def test_tile_obs_in_groups_ends_with_the_least_squares_weights_of_the_kept_rows() -> None:
    """``K = 100`` at 0.5 removes 50 rows per tile, more than ``OBC_STEPS``: the rows go in
    groups of 2, and every tile still ends with the least-squares fit (``lstsq``) of its dense
    outputs on the 50 rows it keeps."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 100, generator=g).double()
    w = torch.randn(100, 6, generator=g).double()
    mask, out = tilesparse.tile_obs(w, x.T @ x, 0.5, damping=1e-10, tile=3)
    assert torch.equal(mask.sum(0), torch.full((6,), 50))
    for cols in ([0, 1, 2], [3, 4, 5]):
        rows = mask[:, cols[0]].nonzero().flatten()
        assert torch.equal(mask[:, cols], mask[:, cols[:1]].expand(100, 3))
        ls = torch.linalg.lstsq(x[:, rows], x @ w[:, cols]).solution
        torch.testing.assert_close(out[rows][:, cols], ls, atol=1e-6, rtol=1e-6)
    assert not out[~mask].any()


def test_tile_obs_on_a_diagonal_gram_drops_the_rows_of_least_damped_energy() -> None:
    """Uncorrelated inputs: no removal moves another row's weights, so each tile drops the
    rows with the smallest ``‖W[k, C]‖²·(H_kk + λ)``, ``λ = damping · mean(diag H)``, and keeps
    the dense weights; sparsity 0 is the identity."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 5, generator=g)
    hd = torch.rand(40, generator=g).double() * 4 + 0.1
    damping = 0.5
    mask, out = tilesparse.tile_obs(w, torch.diag(hd), 0.3, damping=damping, tile=2)
    lam = damping * float(hd.mean())
    expected = torch.zeros(40, 5, dtype=torch.bool)
    for s in (0, 2, 4):
        cost = w[:, s : s + 2].double().pow(2).sum(1) * (hd + lam)
        keep = cost.argsort(descending=True)[: 40 - 12]  # round(40 · 0.3) = 12 dropped
        expected[keep, s : s + 2] = True
    assert torch.equal(mask, expected)
    torch.testing.assert_close(out, w * mask, atol=1e-6, rtol=1e-6)
    full, same = tilesparse.tile_obs(w, torch.diag(hd), 0.0, damping=damping, tile=2)
    assert bool(full.all()) and torch.equal(same, w)


@pytest.mark.parametrize("fn", ["sparsegpt", "tile_obs"])
def test_obs_rejects_bad_arguments_naming_them(fn: str) -> None:
    w = torch.randn(4, 3)
    h = torch.eye(4, dtype=torch.float64)
    extra = {"tile": 2} if fn == "tile_obs" else {}

    def call(w: torch.Tensor, h: torch.Tensor, s: float = 0.5, d: float = 0.1) -> object:
        return getattr(tilesparse, fn)(w, h, s, d, layer="enc.fc1", **extra)

    with pytest.raises(ValueError, match=r"gram \(3, 3\) must be \(K, K\) = \(4, 4\)"):
        call(w, torch.eye(3))
    with pytest.raises(ValueError, match=r"sparsity must be in \[0, 1\), got 1.0"):
        call(w, h, s=1.0)
    with pytest.raises(ValueError, match="damping must be finite and > 0, got nan"):
        call(w, h, d=float("nan"))
    bad_w = w.clone()
    bad_w[1, 2] = float("inf")
    with pytest.raises(ValueError, match="layer 'enc.fc1': weight has 1 non-finite entries of 12"):
        call(bad_w, h)
    bad_h = h.clone()
    bad_h[0, 1] = bad_h[1, 0] = float("nan")
    with pytest.raises(ValueError, match="layer 'enc.fc1': gram has 2 non-finite entries of 16"):
        call(w, bad_h)
    indefinite = torch.tensor([[1.0, 2, 0, 0], [2, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    with pytest.raises(ValueError, match="damped gram is not positive definite"):
        call(w, indefinite.double())
