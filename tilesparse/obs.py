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

__all__ = ["OBS_BLOCK", "sparsegpt"]

# Inputs per block whose masks are chosen together (SparseGPT's "lazy batch" and adaptive
# mask selection block, 128 in the paper).
OBS_BLOCK = 128


@torch.no_grad()
def sparsegpt(
    weight_kn: torch.Tensor,
    gram: torch.Tensor,
    sparsity: float,
    damping: float,
    block: int = OBS_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """An unstructured mask at ``sparsity`` and the kept weights (module docstring).

    Args:
        weight_kn: ``(K, N)`` the dense weight.
        gram: ``(K, K)``, ``Σ Xᵀ·X`` of the layer's calibration inputs.
        sparsity: the fraction of weights pruned, in [0, 1).
        damping: ``λ / mean(diag H)``, > 0.
        block: inputs per mask-selection block.

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
        drop = round(saliency.numel() * sparsity)
        m1 = torch.ones(w1.shape, dtype=torch.bool)
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
