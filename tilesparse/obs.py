"""Optimal-brain-surgeon pruning of one layer from its inputs' Gram matrix: the mask and the
kept weights chosen together, so the kept weights absorb what the pruned ones contributed on
the calibration inputs.

:func:`sparsegpt` (Frantar & Alistarh 2023, "SparseGPT: Massive Language Models Can Be
Accurately Pruned in One-Shot") gives an unstructured (EW) mask. With ``W`` the dense
``(K, N)`` weight (K inputs, in order) and ``H = Σ Xᵀ·X + λ·I``, let ``U`` be the upper
Cholesky factor of ``H⁻¹``. Inputs are visited in blocks of ``B``; in each block the weights
with the lowest saliency ``w[k, n]² / U[k, k]²`` are dropped, then input by input the pruned
weight's error ``e = (w - q) / U[k, k]`` is spread over the later inputs of the same output::

    W[k', n] -= e[n] · U[k, k']          for k' > k

The comparison group is either the whole block (``round(B·N·s)`` weights of the block) or,
with ``per_output=True``, each output's part of the block (Wanda's group): output ``n`` drops
exactly ``K - round(K·(1 - s))`` weights in all, the count of
:func:`~tilesparse.patterns.ew_per_output_mask`, its blocks' shares cut from the running total
so no block's rounding adds up. Cost: one ``K × K`` Cholesky and ``O(K²·N)`` updates.

:func:`tile_obs` gives a TW rows-only mask: the ``N`` outputs are cut into tiles of ``G``
columns, and each tile removes the same number of whole input rows, greedily by the rise of
the tile's output error, updating its other rows to absorb each removal (OBC, Frantar &
Alistarh 2022, on row segments). For example ``K = 4``, ``N = 4``, ``G = 2``, ``s = 0.5``:
each tile keeps 2 whole rows, chosen per tile::

    x x . .       tile 0 (columns 0, 1) keeps rows 0 and 2
    . . x x       tile 1 (columns 2, 3) keeps rows 1 and 3
    x x . .
    . . x x

Both treat an input whose Gram diagonal is <= 0 (never non-zero in the calibration) as dead:
its weights become zero.
"""

from __future__ import annotations

import math

import torch

__all__ = ["OBS_BLOCK", "OBC_STEPS", "sparsegpt", "tile_obs"]

# Inputs per block whose masks are chosen together (SparseGPT's "lazy batch" and adaptive
# mask selection block, 128 in the paper).
OBS_BLOCK = 128
# :func:`tile_obs` removes each tile's rows in at most this many groups: each group is the
# rows cheapest under the current inverse, removed with one block update. The arithmetic is
# the same O(K²·removed) as removing them one at a time, done in 32 matrix-matrix steps
# instead of one rank-one step per removed row.
OBC_STEPS = 32


def _pruned_before(i: int, sparsity: float) -> int:
    """How many of an output's first ``i`` inputs the per-output mask prunes:
    ``i - round(i·(1 - sparsity))``, the count of :func:`~tilesparse.patterns.ew_per_output_mask`
    at ``K = i`` (non-decreasing in ``i``, by at most 1 per input)."""
    return i - round(i * (1.0 - sparsity))


def _damped_inverse(
    fn: str,
    weight_kn: torch.Tensor,
    gram: torch.Tensor,
    sparsity: float,
    damping: float,
    layer: str | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checks the arguments; returns ``(W, H⁻¹)``: the ``(K, N)`` float64 weight with dead
    inputs zeroed and the inverse of the damped Gram (module docstring)."""
    where = fn if layer is None else f"{fn}: layer {layer!r}"
    if weight_kn.dim() != 2:
        raise ValueError(f"{where}: weight must be (K, N), got {tuple(weight_kn.shape)}")
    k = weight_kn.shape[0]
    if tuple(gram.shape) != (k, k):
        raise ValueError(f"{where}: gram {tuple(gram.shape)} must be (K, K) = ({k}, {k})")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"{where}: sparsity must be in [0, 1), got {sparsity!r}")
    if not (math.isfinite(damping) and damping > 0):
        raise ValueError(f"{where}: damping must be finite and > 0, got {damping!r}")
    for what, t in (("weight", weight_kn), ("gram", gram)):
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise ValueError(
                f"{where}: {what} has {bad} non-finite entries of {t.numel()}; expected all finite"
            )
    w = weight_kn.detach().double().cpu().clone()
    h = gram.detach().double().cpu().clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h.diagonal().add_(damping * float(h.diagonal().mean()))
    chol, info = torch.linalg.cholesky_ex(h)
    if int(info):
        raise ValueError(
            f"{where}: the damped gram is not positive definite (its leading minor of order "
            f"{int(info)} is not positive); a Gram Σ Xᵀ·X is positive semi-definite: check "
            f"the gram, or raise the damping above {damping!r}"
        )
    return w, torch.cholesky_inverse(chol)


@torch.no_grad()
def sparsegpt(
    weight_kn: torch.Tensor,
    gram: torch.Tensor,
    sparsity: float,
    damping: float,
    block: int = OBS_BLOCK,
    per_output: bool = False,
    layer: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An unstructured mask at ``sparsity`` and the kept weights (module docstring).

    Args:
        weight_kn: ``(K, N)`` the dense weight.
        gram: ``(K, K)``, ``Σ Xᵀ·X`` of the layer's calibration inputs.
        sparsity: the fraction of weights pruned, in [0, 1).
        damping: ``λ / mean(diag H)``, > 0.
        block: inputs per mask-selection block.
        per_output: compare saliencies within each output's part of the block (every output
            keeps the same share of each block, Wanda's comparison group) instead of over the
            whole block.
        layer: the layer's name, for messages.

    Returns:
        ``(mask_kn, weight_kn)``: ``(K, N) bool`` and the weights in ``weight_kn.dtype``, zero
        where the mask is False. Inputs that were always zero get zero weights.

    Raises:
        ValueError: naming the bad value, for mismatched shapes, a sparsity outside [0, 1), a
            damping <= 0, non-finite entries in the weight or the Gram (with their count), or
            a Gram that is not positive definite after damping.
    """
    w_kn, hinv = _damped_inverse("sparsegpt", weight_kn, gram, sparsity, damping, layer)
    k = w_kn.shape[0]
    w = w_kn.T.contiguous()  # (N, K): one row per output
    u, info = torch.linalg.cholesky_ex(hinv, upper=True)
    if int(info):
        where = "sparsegpt" if layer is None else f"sparsegpt: layer {layer!r}"
        raise ValueError(
            f"{where}: the inverse of the damped gram has no Cholesky factor (leading minor "
            f"of order {int(info)}); the gram is too ill-conditioned: raise the damping above "
            f"{damping!r}"
        )
    mask = torch.ones(w.shape, dtype=torch.bool)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        u1 = u[i1:i2, i1:i2]
        saliency = w1.pow(2) / u1.diagonal().pow(2).unsqueeze(0)
        m1 = torch.ones(w1.shape, dtype=torch.bool)
        if per_output:
            # the block's share of each output's total, so every output drops exactly what
            # ew_per_output_mask drops, K - round(K·(1 - sparsity)), whatever the block cuts
            drop = _pruned_before(i2, sparsity) - _pruned_before(i1, sparsity)
            if drop:
                m1.scatter_(1, saliency.argsort(dim=1, stable=True)[:, :drop], False)
        else:
            drop = round(saliency.numel() * sparsity)
            if drop:
                order = saliency.flatten().argsort(stable=True)[:drop]
                m1.view(-1)[order] = False
        err = torch.zeros_like(w1)
        for i in range(i2 - i1):
            kept = w1[:, i] * m1[:, i]
            e = (w1[:, i] - kept) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err[:, i] = e
        w[:, i1:i2] = w1 * m1
        mask[:, i1:i2] = m1
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return mask.T.contiguous(), (w * mask).T.to(weight_kn.dtype).contiguous()


@torch.no_grad()
def tile_obs(
    weight_kn: torch.Tensor,
    gram: torch.Tensor,
    sparsity: float,
    damping: float,
    tile: int,
    layer: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TW rows-only mask and kept weights by structured optimal brain surgeon (OBC's greedy
    removal, Frantar & Alistarh 2022, applied to row segments): the output columns are cut
    into tiles ``C`` of ``tile`` consecutive columns, and each tile removes
    ``round(K · sparsity)`` whole input rows (keeps ``K - round(K · sparsity)``). The removal
    runs in at most :data:`OBC_STEPS` groups of ``c = ceil(removed / OBC_STEPS)`` rows (the
    last may be smaller): each group is the ``c`` alive rows whose removal alone raises the
    tile's output error least under the current inverse, ``‖W[k, C]‖² / [H⁻¹]_kk``, removed
    together, the tile's other rows updated to absorb them (``R`` the group)::

        W[:, C] -= H⁻¹[:, R] · ([H⁻¹]_RR)⁻¹ · W[R, C]
        H⁻¹     -= H⁻¹[:, R] · ([H⁻¹]_RR)⁻¹ · H⁻¹[R, :]

    so each tile ends with the damped least-squares weights of the rows it keeps (the group
    is chosen by the one-row cost, so the rows kept may differ from strictly one-at-a-time
    removal when ``c > 1``).

    Args:
        weight_kn: ``(K, N)`` the dense weight.
        gram: ``(K, K)``, ``Σ Xᵀ·X`` of the layer's calibration inputs.
        sparsity: the fraction of each tile's rows removed, in [0, 1).
        damping: ``λ / mean(diag H)``, > 0.
        tile: ``G``, output columns per tile (> 0; the last tile may be narrower).
        layer: the layer's name, for messages.

    Returns:
        ``(mask_kn, weight_kn)``: ``(K, N) bool`` (a TW mask with column share 0) and the
        weights in ``weight_kn.dtype``, zero where the mask is False.

    Raises:
        ValueError: naming the bad value, for mismatched shapes, a sparsity outside [0, 1), a
            damping <= 0, a tile <= 0, non-finite entries in the weight or the Gram (with their
            count), or a Gram that is not positive definite after damping.
    """
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        where = "tile_obs" if layer is None else f"tile_obs: layer {layer!r}"
        raise ValueError(f"{where}: tile must be a positive integer, got {tile!r}")
    w, hinv0 = _damped_inverse("tile_obs", weight_kn, gram, sparsity, damping, layer)
    k, n = w.shape
    drop = round(k * sparsity)
    mask = torch.zeros(k, n, dtype=torch.bool)
    step = max(1, math.ceil(drop / OBC_STEPS))
    for s in range(0, n, tile):
        # one tile at a time, one (K, K) inverse alive: the tiles never interact
        x = w[:, s : s + tile]  # a view: the tile's weights are updated in place
        hinv = hinv0.clone()
        alive = torch.ones(k, dtype=torch.bool)
        done = 0
        while done < drop:
            c = min(step, drop - done)
            cost = x.pow(2).sum(1) / hinv.diagonal().clamp_min(1e-300)
            r = torch.where(alive, cost, torch.inf).topk(c, largest=False).indices
            cols = hinv[:, r]  # (K, c): H⁻¹[:, R]
            inv = torch.linalg.inv(cols[r])  # ([H⁻¹]_RR)⁻¹
            x -= cols @ (inv @ x[r])
            x[r] = 0.0
            hinv -= cols @ inv @ cols.T
            hinv[r, :] = 0.0
            hinv[:, r] = 0.0
            alive[r] = False
            done += c
        x.mul_(alive.unsqueeze(1))
        mask[:, s : s + tile] = alive.unsqueeze(1)
    return mask, w.to(weight_kn.dtype).contiguous()
