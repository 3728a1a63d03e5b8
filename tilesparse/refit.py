"""Per-layer choices of a calibrated prune, judged on held-out calibration samples.

For each pruned layer, in the order the calibration calls them (its inputs gathered with the
layers before it already pruned), :func:`fit_layer` tries:

- candidate masks: one per importance (``activation`` ``|w|·‖x‖`` and ``magnitude`` ``|w|``
  when the config leaves ``importance`` automatic) and per TW column share (0.5 and 0 when
  ``column_share`` is automatic) at the layer's sparsity — its share of a global threshold
  (the allocation), or the target; with both knobs explicit under a global threshold the
  mask is the one already set;
- for each mask, the least-squares reconstruction (:func:`tilesparse.calibrate.reconstruct`)
  fitted on the *fit* samples, with its damping chosen from :data:`DAMPINGS` by the held-out
  error on a spread of :data:`SEARCH_COLUMNS` output columns;

- for EW with ``importance`` automatic, no per-column refit of the masks above (Wanda's
  ``activation`` mask compared within each output, and ``magnitude``), and SparseGPT's mask
  and weights (:mod:`tilesparse.obs`) as one more candidate;

and keeps whichever (mask, reconstructed or not) has the lowest relative output error on the
*held-out* samples. A reconstruction that does not lower the held-out error is rejected, so a
calibrated layer is never worse on held-out data than its best plain mask, and — with
``magnitude`` among the candidates — than the uncalibrated (magnitude) mask at the same
sparsity. Each decision is reported as a :class:`~tilesparse.calibrate.LayerReconstruction`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from tilesparse.calibrate import (
    HOLD_OUT,
    CalibrationError,
    InputStats,
    LayerReconstruction,
    collect_inputs,
    reconstruct,
    reconstruction_error,
)
from tilesparse.config import Importance, Pattern, TileSparseConfig
from tilesparse.neurons import bias_refit, bias_refit_error, neuron_masks, neurons_are_elementwise
from tilesparse.obs import sparsegpt
from tilesparse.patterns import ew_per_output_mask, masks_for_config

log = logging.getLogger(__name__)

__all__ = [
    "DAMPINGS",
    "SEARCH_COLUMNS",
    "LayerSearch",
    "RefitTarget",
    "fit_layer",
    "fit_neuron_pair",
    "refit_layers",
]

# Ridge λ / mean(diag H) tried per layer. SparseGPT fixes 0.01; the Gram of a few hundred
# similar sentences is nearly rank-deficient for K = 384 or 1536, where a larger ridge
# generalises better (measured on MiniLM, docs/benchmarks.md), so the held-out error picks.
DAMPINGS = (0.01, 0.1, 1.0)
# Output columns (spread over the layer) on which the damping is chosen: a few tiles' solves
# instead of the whole layer's, per damping.
SEARCH_COLUMNS = 48
# Column shares tried for TW / TEW when the config leaves it automatic: the paper's even split,
# and rows only (an output column removed from a layer writing a residual stream cannot be
# reconstructed).
COLUMN_SHARES = (0.5, 0.0)
# SparseGPT's damping for EW with automatic knobs: of 0.01 (the paper's) and 0.1, 0.1 gave
# MiniLM embeddings closer to the dense model's on text unlike the calibration's
# (docs/benchmarks.md, "calibration variants").
OBS_DAMPING = 0.1
# SparseGPT's saliencies compared within each output's part of a block (every output keeps
# half of each block's inputs) rather than over the block: on MiniLM, 0.941 against 0.938
# cosine on the tuning set B (docs/benchmarks.md, "EW and TW: more tokens, per-output
# SparseGPT, tile-structured OBS").
OBS_PER_OUTPUT = True


@dataclass(frozen=True)
class LayerSearch:
    """What :func:`fit_layer` may choose for one layer.

    Attributes:
        config: the resolved config (pattern, tile, ...).
        sparsity: the layer's sparsity; ``None``: the sparsity of its current mask (the
            global threshold's allocation).
        importances: scores whose masks are tried.
        column_shares: TW / TEW column shares tried (one entry for other patterns).
        fixed_mask: keep the layer's current mask (a global threshold set it); only whether
            to reconstruct, and with which damping, is chosen.
        dampings: ridges tried (``λ / mean(diag H)``).
        refit: whether the kept weights may be refitted at all (not for a weight tensor
            that another, unfitted layer shares).
        neurons: whether two consecutive TW layers joined by an elementwise activation are
            pruned as neurons (:mod:`tilesparse.neurons`; when ``column_share`` is
            automatic).
        per_output: EW masks from ``activation`` scores compare weights within each output
            (Wanda's group, :func:`~tilesparse.patterns.ew_per_output_mask`) instead of over
            the whole layer.
        obs_damping: when set, SparseGPT's mask and weights (:func:`tilesparse.obs.sparsegpt`,
            this damping) are one more candidate.
    """

    config: TileSparseConfig
    sparsity: float | None
    importances: tuple[Importance, ...]
    column_shares: tuple[float, ...]
    fixed_mask: bool = False
    dampings: tuple[float, ...] = DAMPINGS
    refit: bool = True
    neurons: bool = False
    per_output: bool = False
    obs_damping: float | None = None


def search_for(user: TileSparseConfig, resolved: TileSparseConfig) -> LayerSearch:
    """The per-layer search a calibrated prune runs for the user's config (``None`` knobs are
    searched, explicit ones kept) and its resolved form."""
    imps = (
        (Importance.ACTIVATION, Importance.MAGNITUDE)
        if user.importance is None
        else (resolved.importance_kind,)
    )
    tw = resolved.pattern in (Pattern.TW, Pattern.TEW)
    shares = COLUMN_SHARES if (user.column_share is None and tw) else (resolved.share,)
    shared = resolved.global_threshold and resolved.pattern is not Pattern.NM
    fixed = shared and len(imps) == 1 and len(shares) == 1
    # automatic importance: every layer at the target (activation scores of different
    # layers are not comparable, a global threshold over them can empty a layer)
    sparsity = None if shared and user.importance is not None else resolved.target_sparsity
    dampings = DAMPINGS if user.damping is None else (float(user.damping),)
    neurons = user.column_share is None and resolved.pattern is Pattern.TW
    # EW, automatic importance: SparseGPT beside Wanda's and magnitude masks, no per-column
    # refit. On MiniLM, a per-column refit of a fixed mask fitted to one text domain lowered
    # the held-out error there and raised it on other text; SparseGPT's joint choice of mask
    # and weights (damping 0.1, chosen on a second domain) did better on both (benchmarks.md).
    ew_auto = resolved.pattern is Pattern.EW and user.importance is None
    refit = not ew_auto
    obs = (OBS_DAMPING if user.damping is None else float(user.damping)) if ew_auto else None
    return LayerSearch(
        resolved,
        sparsity,
        imps,
        shares,
        fixed,
        dampings,
        refit=refit,
        neurons=neurons,
        per_output=ew_auto,
        obs_damping=obs,
    )


def _layer_sparsity(current: torch.Tensor, search: LayerSearch) -> float:
    if search.sparsity is not None:
        return search.sparsity
    return 1.0 - float(current.float().mean()) if current.numel() else 0.0


def _score(w_kn: torch.Tensor, imp: Importance, stats: InputStats) -> torch.Tensor:
    if imp is Importance.ACTIVATION:
        norms = stats.total.diagonal().clamp_min(0).sqrt()
        return (w_kn.abs().double() * norms.unsqueeze(1)).float()
    return w_kn.abs().float()


def _candidates(
    w_kn: torch.Tensor, current: torch.Tensor, stats: InputStats, search: LayerSearch
) -> list[tuple[Importance, float | None, torch.Tensor]]:
    """``(importance, column_share, mask)`` per distinct candidate mask."""
    cfg = search.config
    if search.fixed_mask:
        return [(cfg.importance_kind, cfg.column_share, current)]
    out: list[tuple[Importance, float | None, torch.Tensor]] = []
    for imp in search.importances:
        score = _score(w_kn, imp, stats)
        if search.per_output and imp is Importance.ACTIVATION:
            mask = ew_per_output_mask(score, _layer_sparsity(current, search))
            if not any(torch.equal(mask, m) for _, _, m in out):
                out.append((imp, None, mask))
            continue
        for share in search.column_shares:
            c = replace(cfg, column_share=share)
            mask = masks_for_config(c, [score], _layer_sparsity(current, search), 0.0)[0]
            if not any(torch.equal(mask, m) for _, _, m in out):
                tw = cfg.pattern in (Pattern.TW, Pattern.TEW)
                out.append((imp, share if tw else None, mask))
    return out


def _magnitude_mask(w_kn: torch.Tensor, current: torch.Tensor, search: LayerSearch) -> torch.Tensor:
    """The uncalibrated prune's mask of the layer: magnitude scores, the config's column
    share (the layer's current mask under a global threshold)."""
    if search.fixed_mask:
        return current
    sparsity = _layer_sparsity(current, search)
    return masks_for_config(search.config, [w_kn.abs().float()], sparsity, 0.0)[0]


def _choose_damping(
    w_kn: torch.Tensor, mask_kn: torch.Tensor, stats: InputStats, dampings: tuple[float, ...]
) -> tuple[float, float]:
    """``(damping, held-out error on the search columns)``: the entry of ``dampings`` whose
    fit on a spread of output columns has the lowest held-out error there."""
    if len(dampings) == 1:
        return dampings[0], float("nan")
    n = w_kn.shape[1]
    cols = torch.linspace(0, n - 1, min(n, SEARCH_COLUMNS)).round().long().unique()
    w_sub, m_sub = w_kn[:, cols], mask_kn[:, cols]
    best = (dampings[0], float("inf"))
    for d in dampings:
        err = reconstruction_error(w_sub, reconstruct(w_sub, m_sub, stats.gram, d), stats.held_gram)
        if err < best[1]:
            best = (d, err)
    return best


def fit_layer(
    fqn: str, w_kn: torch.Tensor, current: torch.Tensor, stats: InputStats, search: LayerSearch
) -> tuple[torch.Tensor, torch.Tensor, LayerReconstruction]:
    """Choose one layer's mask and weights (module docstring).

    Args:
        fqn: the layer's name (for messages).
        w_kn: ``(K, N)`` its dense weight.
        current: ``(K, N) bool`` its current mask.
        stats: its inputs, with the layers before it pruned.
        search: what may be chosen.

    Returns:
        ``(mask_kn, weight_kn, report)``: the kept entries, the weights to store (zero where
        pruned) and what was chosen.

    Raises:
        CalibrationError: naming the layer, when a reconstruction is not finite.
    """
    k = w_kn.shape[0]
    w = w_kn.detach().double().cpu()
    if search.refit and stats.rows < k:
        log.warning(
            "tilesparse: layer %r: the calibration gave %d fit input rows for its %d inputs; "
            "its Gram matrix is rank-deficient, the damping and the held-out check decide",
            fqn,
            stats.rows,
            k,
        )
    if stats.held_rows == 0:
        log.warning(
            "tilesparse: layer %r: no calibration sample was held out (fewer than %d "
            "samples); choices are judged on the fit samples",
            fqn,
            HOLD_OUT,
        )
    hh = stats.held_gram
    magnitude_error = reconstruction_error(w, w * _magnitude_mask(w, current, search), hh)
    best: tuple[float, torch.Tensor, torch.Tensor, LayerReconstruction] | None = None
    for imp, share, mask in _candidates(w, current, stats, search):
        masked = w * mask
        held_masked = reconstruction_error(w, masked, hh)
        if search.refit:
            damping, _ = _choose_damping(w, mask, stats, search.dampings)
            fitted = reconstruct(w, mask, stats.gram, damping)
        else:
            damping, fitted = 0.0, masked
        if not bool(torch.isfinite(fitted).all()):
            raise CalibrationError(f"layer {fqn!r}: the reconstruction is not finite")
        held_fitted = reconstruction_error(w, fitted, hh)
        accepted = search.refit and held_fitted < held_masked
        rec = LayerReconstruction(
            fqn=fqn,
            masked_error=reconstruction_error(w, masked, stats.gram),
            reconstructed_error=reconstruction_error(w, fitted, stats.gram),
            rows=stats.rows,
            held_out_rows=stats.held_rows,
            held_out_masked_error=held_masked,
            held_out_reconstructed_error=held_fitted,
            held_out_magnitude_error=magnitude_error,
            accepted=accepted,
            damping=damping,
            importance=imp,
            column_share=share,
        )
        score = min(held_fitted, held_masked)
        if best is None or score < best[0]:
            best = (score, mask, fitted if accepted else masked, rec)
    if search.obs_damping is not None:
        mask, fitted = sparsegpt(
            w,
            stats.gram,
            _layer_sparsity(current, search),
            search.obs_damping,
            per_output=OBS_PER_OUTPUT,
            layer=fqn,
        )
        if not bool(torch.isfinite(fitted).all()):
            raise CalibrationError(f"layer {fqn!r}: the SparseGPT weights are not finite")
        held_fitted = reconstruction_error(w, fitted, hh)
        rec = LayerReconstruction(
            fqn=fqn,
            masked_error=reconstruction_error(w, w * mask, stats.gram),
            reconstructed_error=reconstruction_error(w, fitted, stats.gram),
            rows=stats.rows,
            held_out_rows=stats.held_rows,
            held_out_masked_error=reconstruction_error(w, w * mask, hh),
            held_out_reconstructed_error=held_fitted,
            held_out_magnitude_error=magnitude_error,
            accepted=True,
            damping=search.obs_damping,
            importance=None,
        )
        if best is None or held_fitted < best[0]:
            best = (held_fitted, mask, fitted, rec)
    assert best is not None
    _, mask, weight, rec = best
    return mask, weight.to(w_kn.dtype), rec


@dataclass(frozen=True)
class RefitTarget:
    """One pruned layer of a calibrated prune.

    Attributes:
        fqn: its name in the model.
        module: the layer (the calibration's hook goes on it).
        dense_nk: ``(N, K)`` the dense weight whose outputs are reproduced.
        set_weights: ``(mask_kn, weight_kn)`` → stores the layer's mask and kept weights.
        current_mask: ``() -> (K, N) bool``, the layer's mask now.
        refit: whether its kept weights may be refitted (not when another layer shares the
            tensor: its outputs were not part of the fit).
        bias: the layer's bias (refitted with the weights of a neuron pair's second layer).
    """

    fqn: str
    module: nn.Module
    dense_nk: torch.Tensor
    set_weights: Callable[[torch.Tensor, torch.Tensor], None]
    current_mask: Callable[[], torch.Tensor]
    refit: bool = True
    bias: torch.Tensor | None = None


@torch.no_grad()
def refit_layers(
    model: nn.Module,
    targets: Sequence[RefitTarget],
    first: InputStats,
    run: Callable[[nn.Module], None],
    search: LayerSearch,
    progress: bool = False,
) -> list[LayerReconstruction]:
    """:func:`fit_layer` on each of ``targets`` in order, each layer's inputs gathered with the
    layers before it already chosen (the first one's are ``first``).

    Raises:
        CalibrationError: as :func:`tilesparse.calibrate.collect_inputs` or :func:`fit_layer`.
    """
    from tqdm.auto import tqdm

    out: list[LayerReconstruction] = []
    bar = tqdm(total=len(targets), desc="calibrate", unit="layer", disable=not progress)
    i = 0
    while i < len(targets):
        t = targets[i]
        if i + 1 < len(targets) and _pair_eligible(t, targets[i + 1], search):
            u = targets[i + 1]
            mask_a0 = t.current_mask()
            t.set_weights(torch.ones_like(mask_a0), t.dense_nk.T.cpu())  # b's dense inputs
            both = collect_inputs(model, {t.fqn: t.module, u.fqn: u.module}, run)[0]
            recs = fit_neuron_pair(model, t, u, mask_a0, both[t.fqn], both[u.fqn], run, search)
            if recs is not None:
                out.extend(recs)
                bar.update(2)
                i += 2
                continue
            st = both[t.fqn]
        else:
            st = first if i == 0 else collect_inputs(model, {t.fqn: t.module}, run)[0][t.fqn]
        out.append(_fit_one(t, st, search))
        bar.update(1)
        i += 1
    bar.close()
    return out


def _fit_one(t: RefitTarget, st: InputStats, search: LayerSearch) -> LayerReconstruction:
    w_kn = t.dense_nk.T.cpu()
    s = search if t.refit else replace(search, refit=False, obs_damping=None)
    mask, weight, rec = fit_layer(t.fqn, w_kn, t.current_mask(), st, s)
    t.set_weights(mask, weight)
    log.info(
        "tilesparse: %s: %s mask%s, held-out output error %.4g (masked %.4g, magnitude "
        "%.4g), reconstruction %s (damping %g)",
        t.fqn,
        rec.importance.value if rec.importance else "?",
        "" if rec.column_share is None else f" column share {rec.column_share:g}",
        rec.held_out_error,
        rec.held_out_masked_error,
        rec.held_out_magnitude_error,
        "kept" if rec.accepted else "rejected",
        rec.damping,
    )
    return rec


def _pair_eligible(a: RefitTarget, b: RefitTarget, search: LayerSearch) -> bool:
    """Two consecutive layers that may be pruned as neurons: TW with the split automatic,
    both refittable, ``a``'s outputs as wide as ``b``'s inputs."""
    return (
        search.neurons
        and not search.fixed_mask
        and a.refit
        and b.refit
        and a.dense_nk.shape[0] == b.dense_nk.shape[1]
    )


@torch.no_grad()
def fit_neuron_pair(
    model: nn.Module,
    a: RefitTarget,
    b: RefitTarget,
    mask_a0: torch.Tensor,
    st_a: InputStats,
    st_b: InputStats,
    run: Callable[[nn.Module], None],
    search: LayerSearch,
) -> list[LayerReconstruction] | None:
    """Prune ``a``'s output columns and ``b``'s input rows as one set of neurons and refit
    ``b`` with its bias (:mod:`tilesparse.neurons`); ``None`` (nothing changed) when ``b``'s
    inputs turn out not to be an elementwise function of ``a``'s outputs (``a`` is then
    left with its mask ``mask_a0``; it is dense while ``st_a``, ``st_b`` are gathered).

    Both layers get the size-weighted mean of their sparsities (the total is kept).
    """
    w_a, w_b = a.dense_nk.T.cpu().double(), b.dense_nk.T.cpu().double()
    mask_b0 = b.current_mask()
    s_a, s_b = _layer_sparsity(mask_a0, search), _layer_sparsity(mask_b0, search)
    sparsity = (s_a * w_a.numel() + s_b * w_b.numel()) / (w_a.numel() + w_b.numel())
    kept, mask_a, mask_b = neuron_masks(w_b, st_b, w_a.shape[0], sparsity)
    bias0 = None if b.bias is None else b.bias.detach().clone()
    fits = []
    for d in search.dampings:
        wf, bf = bias_refit(w_b, bias0, kept, st_b, d)
        if not bool(torch.isfinite(wf).all()) or (bf is not None and not torch.isfinite(bf).all()):
            raise CalibrationError(f"layer {b.fqn!r}: the reconstruction is not finite")
        fits.append((bias_refit_error(w_b, bias0, wf, bf, st_b, held=True), d, wf, bf))
    held_fit, damping, w_fit, b_fit = min(fits, key=lambda f: f[0])
    b_masked = None if bias0 is None else bias0.double()
    held_masked = bias_refit_error(w_b, bias0, w_b * mask_b, b_masked, st_b, held=True)
    if not held_fit < held_masked:  # the refit does not help: plain masked weights
        w_fit, b_fit, accepted = w_b * mask_b, b_masked, False
    else:
        accepted = True
    a.set_weights(mask_a, (w_a * mask_a).to(a.dense_nk.dtype))
    b.set_weights(mask_b, w_fit.to(b.dense_nk.dtype))
    if b.bias is not None and b_fit is not None:
        b.bias.copy_(b_fit.to(b.bias.dtype))
    after = collect_inputs(model, {b.fqn: b.module}, run)[0][b.fqn]
    if not neurons_are_elementwise(st_b, after, kept):
        log.info(
            "tilesparse: %s -> %s: not an elementwise activation; layer by layer", a.fqn, b.fqn
        )
        a.set_weights(mask_a0, a.dense_nk.T.cpu() * mask_a0)
        b.set_weights(mask_b0, b.dense_nk.T.cpu() * mask_b0)
        if b.bias is not None and bias0 is not None:
            b.bias.copy_(bias0)
        return None
    recs = []
    for t, w, mask, st, fitted, acc in (
        (a, w_a, mask_a, st_a, w_a * mask_a, False),
        (b, w_b, mask_b, st_b, w_fit, accepted),
    ):
        cur = t.current_mask()
        magnitude = reconstruction_error(w, w * _magnitude_mask(w, cur, search), st.held_gram)
        recs.append(
            LayerReconstruction(
                fqn=t.fqn,
                masked_error=reconstruction_error(w, w * mask, st.gram),
                reconstructed_error=reconstruction_error(w, fitted, st.gram),
                rows=st.rows,
                held_out_rows=st.held_rows,
                held_out_masked_error=reconstruction_error(w, w * mask, st.held_gram),
                held_out_reconstructed_error=reconstruction_error(w, fitted, st.held_gram),
                held_out_magnitude_error=magnitude,
                accepted=acc,
                damping=damping if t is b else 0.0,
                importance=Importance.ACTIVATION,
                column_share=1.0 if t is a else 0.0,
                neurons_with=b.fqn if t is a else a.fqn,
            )
        )
    log.info(
        "tilesparse: %s -> %s pruned as neurons (%d of %d kept), held-out output error of %s "
        "%.4g (masked %.4g, damping %g)",
        a.fqn,
        b.fqn,
        int(kept.sum()),
        kept.numel(),
        b.fqn,
        held_fit if accepted else held_masked,
        held_masked,
        damping,
    )
    return recs
