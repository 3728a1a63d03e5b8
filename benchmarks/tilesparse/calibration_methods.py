"""Per-layer statistics and pruning methods of :mod:`benchmarks.tilesparse.bench_calibration_variants`
on the packaged MiniLM-L6's FFN linears: augmented input Grams over the calibration's real
tokens, the neuron-pair prune, tile-structured OBS after a neuron prune, Wanda, magnitude and
SparseGPT (optionally per output, or on a dense-target weight)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tilesparse
from recipes.prune_transformer import is_ffn

# TW tile width G of the tile-structured OBS variants (the library's default)
TILE = 128


def encode(model: Any, sentences: list[str], batch_size: int = 16) -> torch.Tensor:
    return model.encode(sentences, batch_size=batch_size, convert_to_tensor=True).float().cpu()


def ffn_layers(model: Any) -> list[tuple[str, nn.Linear]]:
    """The 12 FFN linears in call order (fc1, fc2 of block 0, then block 1, ...)."""
    return [(f, m) for f, m in model.named_modules() if isinstance(m, nn.Linear) and is_ffn(m, f)]


@dataclass
class Gram:
    """``Σ [x, 1]ᵀ·[x, 1]`` of one layer's (weighted) input rows: the last row and column hold
    the sums and the (weighted) count."""

    g: torch.Tensor
    rows: int = 0

    @property
    def h(self) -> torch.Tensor:
        """``(K, K)`` the Gram of the inputs alone."""
        return self.g[:-1, :-1]


@dataclass(frozen=True)
class Calib:
    """How the calibration statistics are gathered.

    Attributes:
        sentences: the calibration text (A).
        weighting: ``token`` (rows as they are), ``sentence`` (each sentence's rows scaled by
            ``1/sqrt(tokens)``) or ``norm`` (each row scaled by ``1/‖x_t‖``).
        padded: encode 64 sentences a call and let padded positions into the Gram (what a
            hook-only calibration such as ``prune_``'s sees); else only real tokens.
    """

    sentences: list[str]
    weighting: str = "token"
    padded: bool = False


def grams(model: Any, modules: list[nn.Linear], calib: Calib, diagonal: bool = False) -> list[Gram]:
    """Each module's augmented input Gram over the calibration sentences (``diagonal``: only
    its diagonal, the rest zero — all Wanda needs)."""
    out = [
        Gram(torch.zeros(m.in_features + 1, m.in_features + 1, dtype=torch.float64))
        for m in modules
    ]
    ctx: dict[str, torch.Tensor] = {}

    def hook_for(i: int) -> Callable[..., None]:
        def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach().double()
            b, t, k = x.shape
            keep = ctx["mask"].bool() if "mask" in ctx else torch.ones(b, t, dtype=torch.bool)
            x = torch.cat([x, torch.ones(b, t, 1, dtype=x.dtype)], dim=-1)
            if calib.weighting == "sentence":
                x = x / keep.sum(1).clamp_min(1).double().sqrt().view(b, 1, 1)
            elif calib.weighting == "norm":
                x = x / x[..., :-1].norm(dim=-1, keepdim=True).clamp_min(1e-6)
            rows = x[keep]
            if diagonal:
                out[i].g.diagonal().add_(rows.pow(2).sum(0))
            else:
                out[i].g.addmm_(rows.T, rows)
            out[i].rows += rows.shape[0]

        return hook

    handles = [m.register_forward_pre_hook(hook_for(i)) for i, m in enumerate(modules)]
    first = model[0]
    orig = first.forward

    def forward_noting_mask(features: dict[str, torch.Tensor], *a: Any, **kw: Any) -> Any:
        if not calib.padded:
            ctx["mask"] = features["attention_mask"]
        return orig(features, *a, **kw)

    first.forward = forward_noting_mask
    try:
        with torch.no_grad():
            model.encode(calib.sentences, batch_size=64 if calib.padded else 16)
    finally:
        del first.forward
        for hd in handles:
            hd.remove()
    return out


def layer_inputs(model: Any, module: nn.Linear, calib: Calib) -> torch.Tensor:
    """``(rows, K) float64``: ``module``'s inputs on the calibration's real tokens, in order."""
    out: list[torch.Tensor] = []
    ctx: dict[str, torch.Tensor] = {}

    def hook(_m: nn.Module, args: tuple[Any, ...]) -> None:
        out.append(args[0].detach().double()[ctx["mask"].bool()])

    first = model[0]
    orig = first.forward

    def forward_noting_mask(features: dict[str, torch.Tensor], *a: Any, **kw: Any) -> Any:
        ctx["mask"] = features["attention_mask"]
        return orig(features, *a, **kw)

    handle = module.register_forward_pre_hook(hook)
    first.forward = forward_noting_mask
    try:
        with torch.no_grad():
            model.encode(calib.sentences, batch_size=16)
    finally:
        del first.forward
        handle.remove()
    return torch.cat(out)


def dense_target_weight(
    layer: nn.Linear, x_pruned: torch.Tensor, x_dense: torch.Tensor, damping: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W', H)``: the ``(N, K)`` weight whose outputs on the pruned model's inputs best
    match the dense model's outputs at this layer (``(H + λI)⁻¹·X_pᵀ·X_d·Wᵀ``, damped), and
    ``H = X_pᵀ·X_p``: pruning ``W'`` under ``H`` minimises ``‖X_p·Ŵ - X_d·W‖²``."""
    h = x_pruned.T @ x_pruned
    hd = h.clone()
    hd.diagonal().add_(_ridge(h, damping))
    w = layer.weight.detach().double()
    target = torch.linalg.solve(hd, x_pruned.T @ (x_dense @ w.T))  # (K, N)
    return target.T.contiguous(), h


def _ridge(h: torch.Tensor, damping: float) -> float:
    d = h.diagonal()
    return damping * float(d[d > 0].mean())


Masks = dict[nn.Linear, torch.Tensor]


# -- TW: neuron pairs -------------------------------------------------------------------------
@torch.no_grad()
def neuron_prune(
    fc1: nn.Linear, fc2: nn.Linear, g2: Gram, sparsity: float, damping: float | None
) -> Masks:
    """Remove ``fc1``'s output rows and ``fc2``'s input columns of the lowest-energy neurons
    (``‖h_j‖²·‖W2[:, j]‖²``); with a ``damping``, refit ``fc2``'s kept weights and bias by
    damped least squares on ``g2`` (fc2's inputs, fc1 dense). In place; returns both masks
    (torch layout)."""
    w2 = fc2.weight.detach().double().T  # (N, M)
    n = w2.shape[0]
    energy = g2.h.diagonal().clamp_min(0) * w2.pow(2).sum(1)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[energy.argsort(descending=True)[: round(n * (1 - sparsity))]] = True
    fc1.weight[~kept] = 0
    target = torch.cat([w2, fc2.bias.detach().double().unsqueeze(0)])
    rows = torch.cat([kept.nonzero().squeeze(1), torch.tensor([n])])
    if damping is None:
        sol = target[rows]
    else:
        a = g2.g[rows][:, rows].clone()
        a.diagonal()[:-1] += _ridge(g2.h, damping)
        sol = torch.linalg.solve(a, g2.g[rows] @ target)
    w = torch.zeros_like(w2)
    w[kept] = sol[:-1]
    fc2.weight.copy_(w.T.float())
    fc2.bias.copy_(sol[-1].float())
    return {
        fc1: kept.unsqueeze(1).expand_as(fc1.weight).clone(),
        fc2: kept.unsqueeze(0).expand_as(fc2.weight).clone(),
    }


@torch.no_grad()
def neurons_then_tile_obs(
    model: Any,
    fc1: nn.Linear,
    fc2: nn.Linear,
    calib: Calib,
    neuron_share: float,
    damping: float,
    sparsity: float,
) -> Masks:
    """``fc1``'s lowest-energy neurons (output rows) at ``neuron_share``, then ``fc2``
    (on its inputs with ``fc1`` pruned) by tile-structured OBS at the sparsity that keeps the
    pair's total at ``sparsity``."""
    g2 = grams(model, [fc2], calib)[0]
    w2 = fc2.weight.detach().double().T
    n = w2.shape[0]
    energy = g2.h.diagonal().clamp_min(0) * w2.pow(2).sum(1)
    kept = torch.zeros(n, dtype=torch.bool)
    kept[energy.argsort(descending=True)[: round(n * (1 - neuron_share))]] = True
    fc1.weight[~kept] = 0
    g2 = grams(model, [fc2], calib)[0]
    s2 = 2 * sparsity - neuron_share
    mask_kn, w_kn = tilesparse.tile_obs(fc2.weight.detach().T, g2.h, s2, damping, TILE)
    fc2.weight.copy_(w_kn.T)
    return {
        fc1: kept.unsqueeze(1).expand_as(fc1.weight).clone(),
        fc2: mask_kn.T.contiguous(),
    }


# -- EW ---------------------------------------------------------------------------------------
@torch.no_grad()
def wanda_prune(layer: nn.Linear, g: Gram, sparsity: float) -> torch.Tensor:
    """Wanda (Sun et al. 2023): ``|w|·‖x‖`` compared within each output; no refit."""
    w = layer.weight.detach()
    score = w.abs() * g.h.diagonal().clamp_min(0).sqrt().float().unsqueeze(0)
    k = w.shape[1]
    drop = score.argsort(dim=1)[:, : round(k * sparsity)]
    mask = torch.ones_like(w, dtype=torch.bool).scatter_(1, drop, False)
    layer.weight.mul_(mask)
    return mask


@torch.no_grad()
def magnitude_prune(layer: nn.Linear, sparsity: float) -> torch.Tensor:
    """``|w|`` over the whole layer, no refit."""
    w = layer.weight.detach()
    thr = w.abs().flatten().kthvalue(max(1, round(w.numel() * sparsity))).values
    mask = w.abs() > thr
    layer.weight.mul_(mask)
    return mask


@torch.no_grad()
def sparsegpt_prune(
    layer: nn.Linear,
    g: Gram | None,
    sparsity: float,
    damping: float,
    block: int = 128,
    h: torch.Tensor | None = None,
    per_output: bool = False,
) -> torch.Tensor:
    """SparseGPT through the library's :func:`tilesparse.sparsegpt` (masks chosen per block of
    ``block`` inputs, ``per_output``: within each output's part of the block); the layer's
    weight is replaced by the kept weights. ``h`` replaces ``g``'s input Gram when given.
    Returns the ``(N, K)`` mask."""
    if h is None:
        if g is None:
            raise ValueError("sparsegpt_prune: pass a Gram g or an input Gram h")
        h = g.h
    mask_kn, w_kn = tilesparse.sparsegpt(
        layer.weight.detach().T, h, sparsity, damping, block=block, per_output=per_output
    )
    layer.weight.copy_(w_kn.T)
    return mask_kn.T.contiguous()
