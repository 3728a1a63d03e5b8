"""SparseGPT (Frantar & Alistarh 2023, "SparseGPT: Massive Language Models Can Be Accurately
Pruned in One-Shot"): an unstructured mask and the kept weights chosen together from the
inverse of the inputs' Gram matrix, input by input (optimal brain surgeon updates).

With ``W`` the dense ``(K, N)`` weight (K inputs, in order) and ``H = Σ Xᵀ·X + λ·I``, let
``U`` be the upper Cholesky factor of ``H⁻¹``. Inputs are visited in blocks of ``B``; in each
block every output column drops the weights with the lowest saliency ``w[k, n]² / U[k, k]²``
over the block (the block's share of the target), then input by input the pruned weight's
error ``e = (w - q) / U[k, k]`` is spread over the later inputs of the same output::

    W[k', n] -= e[n] · U[k, k']          for k' > k

so the kept weights absorb what the pruned ones contributed, on the calibration inputs.
Cost: one ``K × K`` Cholesky and ``O(K²·N)`` updates per layer.
"""

from __future__ import annotations

import math

import torch

__all__ = ["OBS_BLOCK", "OBC_STEPS", "sparsegpt", "tile_obs"]

# Inputs per block whose masks are chosen together (SparseGPT's "lazy batch" and adaptive
# mask selection block, 128 in the paper).
OBS_BLOCK = 128
# Removal steps of :func:`tile_obs` per tile: the rows are removed in this many groups (each
# group the cheapest rows under the current inverse, one block update), not one at a time;
# K rank-one updates of a (K, K) inverse per tile cost minutes at K = 1536.
OBC_STEPS = 32


def _pruned_before(i: int, sparsity: float) -> int:
    """How many of an output's first ``i`` inputs the per-output mask prunes:
    ``i - round(i·(1 - sparsity))``, the count of :func:`~tilesparse.patterns.ew_per_output_mask`
    at ``K = i`` (non-decreasing in ``i``, by at most 1 per input)."""
    return i - round(i * (1.0 - sparsity))


@torch.no_grad()
def sparsegpt(
    weight_kn: torch.Tensor,
    gram: torch.Tensor,
    sparsity: float,
    damping: float,
    block: int = OBS_BLOCK,
    per_output: bool = False,
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

    Returns:
        ``(mask_kn, weight_kn)``: ``(K, N) bool`` and the weights in ``weight_kn.dtype``, zero
        where the mask is False. Inputs that were always zero get zero weights.

    Raises:
        ValueError: for mismatched shapes, a sparsity outside [0, 1) or a damping <= 0.
    """
    k, n = weight_kn.shape
    if tuple(gram.shape) != (k, k):
        raise ValueError(f"sparsegpt: gram {tuple(gram.shape)} must be (K, K) = ({k}, {k})")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"sparsegpt: sparsity must be in [0, 1), got {sparsity!r}")
    if not (math.isfinite(damping) and damping > 0):
        raise ValueError(f"sparsegpt: damping must be finite and > 0, got {damping!r}")
    w = weight_kn.detach().double().cpu().T.clone()  # (N, K): one row per output
    h = gram.detach().double().cpu().clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h.diagonal().add_(damping * float(h.diagonal().mean()))
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """TW rows-only mask and kept weights by structured optimal brain surgeon (OBC's greedy
    removal, Frantar & Alistarh 2022, applied to row segments): the output columns are cut
    into tiles of ``tile`` consecutive columns, and inside each tile whole input rows are
    removed one at a time, always the row whose removal raises the tile's output error least,
    ``‖W[k, C]‖² / [H⁻¹]_kk``, the tile's remaining rows updated to absorb it::

        W[:, C] -= H⁻¹[:, k] · W[k, C] / [H⁻¹]_kk      H⁻¹ -= H⁻¹[:, k] · H⁻¹[k, :] / [H⁻¹]_kk

    so each tile ends with the damped least-squares weights of the rows it keeps. Every tile
    keeps ``round(K · (1 - sparsity))`` rows.

    Args:
        weight_kn: ``(K, N)`` the dense weight.
        gram: ``(K, K)``, ``Σ Xᵀ·X`` of the layer's calibration inputs.
        sparsity: the fraction of each tile's rows removed, in [0, 1).
        damping: ``λ / mean(diag H)``, > 0.
        tile: ``G``, output columns per tile (> 0; the last tile may be narrower).

    Returns:
        ``(mask_kn, weight_kn)``: ``(K, N) bool`` (a TW mask with column share 0) and the
        weights in ``weight_kn.dtype``, zero where the mask is False.

    Raises:
        ValueError: for mismatched shapes, a sparsity outside [0, 1), a damping <= 0 or a tile
            <= 0.
    """
    k, n = weight_kn.shape
    if tuple(gram.shape) != (k, k):
        raise ValueError(f"tile_obs: gram {tuple(gram.shape)} must be (K, K) = ({k}, {k})")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"tile_obs: sparsity must be in [0, 1), got {sparsity!r}")
    if not (math.isfinite(damping) and damping > 0):
        raise ValueError(f"tile_obs: damping must be finite and > 0, got {damping!r}")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile <= 0:
        raise ValueError(f"tile_obs: tile must be a positive integer, got {tile!r}")
    w = weight_kn.detach().double().cpu().clone()
    h = gram.detach().double().cpu().clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    w[dead] = 0.0
    h.diagonal().add_(damping * float(h.diagonal().mean()))
    hinv0 = torch.cholesky_inverse(torch.linalg.cholesky(h))
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
