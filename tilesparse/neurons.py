"""Neuron pruning of two layers joined by an elementwise activation (a transformer's FFN,
an MLP's hidden layer), for a calibrated TW prune (Kwon et al. 2022, "A Fast Post-Training
Pruning Framework for Transformers": a mask by activation importance, then a layer-wise
least-squares reconstruction).

Two consecutive pruned layers ``a`` (``K_a → N``) and ``b`` (``N → N_b``) with ``b``'s input
``h = f(a(x))`` for an elementwise ``f`` share the ``N`` hidden units ("neurons"). Removing
neuron ``j`` removes output column ``j`` of ``a`` and input row ``j`` of ``b`` together: both
masks are tile-wise (``a`` prunes whole columns, ``b`` keeps the same rows in every tile),
``a``'s kept weights are the dense ones (its kept outputs do not change) and, since ``b``'s
kept inputs are exactly the dense ones, ``b``'s kept weights *and bias* are refitted by one
damped least-squares solve to the dense ``b``'s outputs (the neuron's average contribution
moves into the bias)::

    [Ŵ; b̂] = (G[R, R] + λ·I')⁻¹ · G[R, :] · [W; b]        G = Σ [h, 1]ᵀ·[h, 1]

over the kept neurons ``R`` plus the constant input (whose ridge is 0). Neuron ``j`` is scored
``‖h_j‖² · ‖W_b[j, :]‖²``: the energy it feeds into ``b``'s outputs.

Whether ``f`` really is elementwise is checked on the data: after ``a`` is pruned, ``b``'s
inputs from removed neurons must be constant and its other inputs unchanged
(:func:`neurons_are_elementwise`); otherwise the pair is pruned layer by layer.
"""

from __future__ import annotations

import torch

from tilesparse.calibrate import InputStats

__all__ = ["bias_refit", "bias_refit_error", "neuron_masks", "neurons_are_elementwise"]

# relative tolerance of the elementwise check (float32 activations computed twice)
_SAME = 1e-4


def neuron_masks(
    w_b_kn: torch.Tensor, stats_b: InputStats, k_a: int, sparsity: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept neurons and both layers' masks.

    Args:
        w_b_kn: ``(N, N_b)`` the dense weight of ``b``.
        stats_b: ``b``'s inputs with ``a`` dense.
        k_a: ``a``'s input width.
        sparsity: the fraction of neurons removed (each layer's sparsity).

    Returns:
        ``(kept, mask_a_kn, mask_b_kn)``: ``(N,) bool``; ``(k_a, N)`` whole columns;
        ``(N, N_b)`` whole rows.
    """
    n = w_b_kn.shape[0]
    energy = stats_b.total.diagonal().clamp_min(0) * w_b_kn.double().pow(2).sum(1)
    keep = max(1, min(n, round(n * (1.0 - sparsity))))
    kept = torch.zeros(n, dtype=torch.bool)
    kept[energy.argsort(descending=True, stable=True)[:keep]] = True
    mask_a = kept.unsqueeze(0).expand(k_a, n).clone()
    mask_b = kept.unsqueeze(1).expand(n, w_b_kn.shape[1]).clone()
    return kept, mask_a, mask_b


def _augmented(stats: InputStats, held: bool) -> torch.Tensor:
    """``(K+1, K+1)`` Gram of ``[h, 1]`` over the fit (or held-out) samples."""
    g, s, n = (
        (stats.held_gram, stats.held_sum_vector, stats.held_count)
        if held
        else (stats.gram, stats.sum_vector, stats.rows)
    )
    k = g.shape[0]
    out = torch.empty(k + 1, k + 1, dtype=torch.float64)
    out[:k, :k] = g
    out[:k, k] = s
    out[k, :k] = s
    out[k, k] = float(n)
    return out


def bias_refit(
    w_kn: torch.Tensor,
    bias: torch.Tensor | None,
    kept: torch.Tensor,
    stats: InputStats,
    damping: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``b``'s weights on its kept input rows and its bias, refitted to the dense layer's
    outputs on the fit samples (module docstring); without a bias, the plain refit.

    Args:
        w_kn: ``(K, N)`` the dense weight; ``bias``: ``(N,)`` or ``None``.
        kept: ``(K,) bool``, the kept input rows (the same in every column).
        stats: the layer's inputs (``sum_vector`` is needed with a bias).
        damping: ``λ / mean(diag H)``.

    Returns:
        ``(weight_kn, bias)`` in float64, the weight zero on removed rows.
    """
    k = w_kn.shape[0]
    w = w_kn.double().cpu()
    if bias is None:
        g = stats.gram.double()
        target = w
        rows = kept.nonzero().squeeze(1)
    else:
        g = _augmented(stats, held=False)
        target = torch.cat([w, bias.detach().double().cpu().unsqueeze(0)])
        rows = torch.cat([kept.nonzero().squeeze(1), torch.tensor([k])])
    diag = stats.gram.diagonal()
    lam = damping * float(diag[diag > 0].mean()) if bool((diag > 0).any()) else damping
    a = g[rows][:, rows].clone()
    ridge = torch.full((rows.numel(),), lam, dtype=torch.float64)
    if bias is not None:
        ridge[-1] = 0.0
    a.diagonal().add_(ridge)
    rhs = g[rows] @ target
    chol, info = torch.linalg.cholesky_ex(a)
    sol = (
        torch.cholesky_solve(rhs, chol)
        if int(info) == 0
        else torch.linalg.lstsq(a, rhs, driver="gelsd").solution
    )
    out = torch.zeros_like(w)
    nk = int(kept.sum())
    out[kept] = sol[:nk]
    return out, (None if bias is None else sol[nk])


def bias_refit_error(
    w_kn: torch.Tensor,
    bias: torch.Tensor | None,
    approx_kn: torch.Tensor,
    approx_bias: torch.Tensor | None,
    stats: InputStats,
    held: bool = True,
) -> float:
    """``‖[h,1]·([W;b] - [Ŵ;b̂])‖² / ‖[h,1]·[W;b]‖²`` on the held-out (or fit) samples."""
    w, a = w_kn.double().cpu(), approx_kn.double().cpu()
    if bias is None or approx_bias is None:
        g = stats.held_gram if held and stats.held_rows > 0 else stats.gram
    else:
        g = _augmented(stats, held=held and stats.held_rows > 0)
        w = torch.cat([w, bias.detach().double().cpu().unsqueeze(0)])
        a = torch.cat([a, approx_bias.double().cpu().unsqueeze(0)])
    d = w - a
    den = float((w * (g @ w)).sum())
    return float((d * (g @ d)).sum()) / den if den > 0 else 0.0


def neurons_are_elementwise(dense: InputStats, pruned: InputStats, kept: torch.Tensor) -> bool:
    """Whether ``b``'s inputs after removing ``a``'s columns behave as an elementwise function
    of ``a``'s outputs: kept inputs unchanged (their mean squares), removed ones constant."""
    n = max(1, pruned.rows + pruned.held_rows)
    sq_dense = dense.total.diagonal()
    sq = pruned.total.diagonal()
    mean = pruned.total_sum / n
    scale = float(sq_dense.max().clamp_min(1e-30))
    same = bool(((sq[kept] - sq_dense[kept]).abs() <= _SAME * scale + _SAME * sq_dense[kept]).all())
    var = (sq[~kept] / n - mean[~kept] ** 2).clamp_min(0)
    constant = bool((var <= _SAME * scale / n).all())
    return same and constant
