"""Variants of one-shot calibrated pruning of the packaged MiniLM-L6's 12 FFN linears at 50 %,
side by side in one run: calibrate on A (Python Language Reference prose), choose on B
(scikit-learn dataset descriptions), report on C (Lee news stories; never used for a choice).

    pip download --no-deps gensim==4.4.0 -d DIR
    python -m benchmarks.tilesparse.bench_calibration_variants --lee-wheel DIR/gensim-*.whl

The library's defaults (``prune_`` with and without ``calibration=``) run beside variants
implemented here on the same layer statistics:

- token weighting of the least-squares fit: every token row as is (``token``), every sentence
  equal (rows scaled by ``1/sqrt(tokens)``), every token equal (rows scaled by ``1/‖x_t‖``);
- padding: the calibration encoded in batches of 64 (padded positions, which mean pooling
  ignores, enter the Gram) or one sentence per call (none);
- damping of the solve (``λ / mean(diag H)``), chosen on B;
- EW: Wanda masks (``|w|·‖x‖`` compared within each output), SparseGPT (OBS updates column
  by column, Frantar & Alistarh 2023), per-layer sparsity allocated by each layer's measured
  effect on the embeddings of A (OWL-style, same total);
- TW: neuron pairs (``tilesparse.neurons``) with the weightings above;
- a short distillation of the pruned FFN weights (masks held) toward the dense model's last
  hidden states on A.

Every variant prunes layers in order, each layer's statistics gathered with the earlier ones
already pruned. JSON to ``benchmarks/results/tilesparse_calibration_variants.json``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from benchmarks.tilesparse.bench_calibration import evaluate as evaluate_pairs
from recipes.corpora import (
    lee_news_pairs,
    python_reference_sentences,
    sklearn_description_pairs,
)
from recipes.minilm import load_minilm
from recipes.prune_transformer import is_ffn

Pairs = list[tuple[str, str]]


def _encode(model: Any, sentences: list[str], batch_size: int = 16) -> torch.Tensor:
    return model.encode(sentences, batch_size=batch_size, convert_to_tensor=True).float().cpu()


def _ffn(model: Any) -> list[tuple[str, nn.Linear]]:
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
    layer: nn.Linear, g: Gram, sparsity: float, damping: float, block: int = 128
) -> torch.Tensor:
    """SparseGPT (Frantar & Alistarh 2023): columns (inputs) in order, each pruned weight's
    error spread over the later inputs through the inverse Hessian's Cholesky factor; masks
    chosen per block of ``block`` inputs by ``w² / [H⁻¹]_kk²``."""
    w = layer.weight.detach().double().clone()  # (N, K)
    h = g.h.clone()
    dead = h.diagonal() <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0
    h.diagonal().add_(_ridge(h, damping))
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    k = w.shape[1]
    mask = torch.ones_like(w, dtype=torch.bool)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1 = w[:, i1:i2].clone()
        q1 = torch.zeros_like(w1)
        err1 = torch.zeros_like(w1)
        h1 = hinv[i1:i2, i1:i2]
        tmp = w1.pow(2) / h1.diagonal().pow(2).unsqueeze(0)
        thr = tmp.flatten().sort().values[int(tmp.numel() * sparsity)]
        m1 = tmp > thr
        for i in range(i2 - i1):
            col = w1[:, i]
            d = h1[i, i]
            q = col * m1[:, i]
            q1[:, i] = q
            e = (col - q) / d
            w1[:, i:] -= e.unsqueeze(1) * h1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i1:i2] = q1
        mask[:, i1:i2] = m1
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    layer.weight.copy_(w.float())
    return mask


# -- the variants -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Variant:
    """One way to prune the 12 FFN linears at ``sparsity`` (mean over the layers).

    Attributes:
        name: the row's label.
        pattern: ``tw`` or ``ew``.
        method: ``neurons`` (TW) | ``wanda`` | ``sparsegpt`` | ``magnitude`` (EW).
        damping: the ridge (``None``: no refit).
        calib: how the statistics are gathered.
        allocation: ``uniform`` or ``effect`` (per-layer sparsity from each layer's measured
            effect on A's embeddings, spread ``spread`` around the target, same total).
        distill_steps: distillation steps on A after the prune (0: none).
    """

    name: str
    pattern: str
    method: str
    damping: float | None
    calib: Calib
    allocation: str = "uniform"
    spread: float = 0.0
    distill_steps: int = 0


def layer_effects(base: Any, calib: Calib, method: str, sparsity: float) -> list[float]:
    """Per FFN linear, ``1 - cos`` of A's embeddings to dense with that layer alone pruned
    (no refit: magnitude / Wanda on the dense model's inputs)."""
    dense = _encode(base, calib.sentences)
    out = []
    layers = _ffn(base)
    gs = grams(base, [m for _, m in layers], calib, True) if method != "magnitude" else None
    for i, (_, m) in enumerate(layers):
        saved = m.weight.detach().clone()
        if gs is None:
            magnitude_prune(m, sparsity)
        else:
            wanda_prune(m, gs[i], sparsity)
        emb = _encode(base, calib.sentences)
        out.append(1.0 - float(nn.functional.cosine_similarity(emb, dense, dim=-1).mean()))
        with torch.no_grad():
            m.weight.copy_(saved)
    return out


def allocate(effects: list[float], sparsity: float, spread: float) -> list[float]:
    """Sparsities in ``[s - spread, s + spread]`` with mean ``s``, lower where the effect is
    larger (rank-based, as OWL maps outlier ratios)."""
    n = len(effects)
    order = sorted(range(n), key=lambda i: effects[i])  # least effect first
    out = [0.0] * n
    for rank, i in enumerate(order):
        out[i] = sparsity + spread * (1 - 2 * rank / max(1, n - 1))
    return out


def prune_variant(base: Any, v: Variant, sparsity: float) -> tuple[Any, Masks, dict[str, Any]]:
    """A pruned copy of ``base`` and its masks, layer by layer (each layer's statistics with
    the earlier ones pruned)."""
    model = copy.deepcopy(base)
    layers = [m for _, m in _ffn(model)]
    info: dict[str, Any] = {}
    if v.allocation == "effect":
        effects = layer_effects(
            model, v.calib, "magnitude" if v.method == "magnitude" else "wanda", sparsity
        )
        targets = allocate(effects, sparsity, v.spread)
        info["effects"], info["sparsities"] = effects, targets
    else:
        targets = [sparsity] * len(layers)
    masks: Masks = {}
    if v.method == "neurons":
        for b in range(0, len(layers), 2):
            fc1, fc2 = layers[b], layers[b + 1]
            g2 = grams(model, [fc2], v.calib)[0]
            masks.update(neuron_prune(fc1, fc2, g2, (targets[b] + targets[b + 1]) / 2, v.damping))
        return model, masks, info
    for i, m in enumerate(layers):
        if v.method == "magnitude":
            masks[m] = magnitude_prune(m, targets[i])
            continue
        g = grams(model, [m], v.calib, v.method == "wanda")[0]
        if v.method == "wanda":
            masks[m] = wanda_prune(m, g, targets[i])
        else:
            assert v.damping is not None
            masks[m] = sparsegpt_prune(m, g, targets[i], v.damping)
    return model, masks, info


def distill(student: Any, teacher: Any, masks: Masks, sentences: list[str], steps: int) -> float:
    """``steps`` Adam steps (lr 5e-5, batches of 8 of ``sentences``) of the FFN linears toward
    the teacher's token embeddings (MSE over real tokens), masks re-applied after each step.
    Returns the last loss."""
    params = [p for m in masks for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=5e-5)
    student.train()
    loss = torch.tensor(0.0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        idx = torch.randint(len(sentences), (8,), generator=gen).tolist()
        feats = student.tokenize([sentences[i] for i in idx])
        with torch.no_grad():
            t = teacher(dict(feats))["token_embeddings"]
        s = student(dict(feats))["token_embeddings"]
        keep = feats["attention_mask"].bool()
        loss = nn.functional.mse_loss(s[keep], t[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for m, mask in masks.items():
                m.weight.mul_(mask)
    student.eval()
    return float(loss.detach())


def evaluate(model: Any, evals: dict[str, Pairs], dense: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per set: cosine to dense (mean, 5th percentile) and next-sentence retrieval, encoded 16
    sentences at a time as this benchmark's dense embeddings are."""
    return evaluate_pairs(model, evals, dense, batch_size=16)


class _Encode:
    """``model.encode(sentences)``, as ``prune_``'s calibration."""

    def __init__(self, sentences: list[str], batch_size: int) -> None:
        self.sentences, self.batch_size = sentences, batch_size

    def __call__(self, model: nn.Module) -> None:
        _encode(model, self.sentences, self.batch_size)


def library_row(
    base: Any, pattern: str, sentences: list[str] | None, batch_size: int, sparsity: float
) -> tuple[Any, dict[str, Any]]:
    """``tilesparse.prune_`` with the default config (plus ``calibration=``)."""
    model = copy.deepcopy(base)
    cfg = tilesparse.TileSparseConfig(pattern=tilesparse.Pattern(pattern), sparsity=sparsity)
    calib = None if sentences is None else _Encode(sentences, batch_size)
    pruner = tilesparse.prune_(model, cfg, is_ffn, calibration=calib)
    check = pruner.output_check
    return model, {
        "achieved_sparsity": pruner.overall_sparsity(),
        "output_check_kept": None if check is None else check.calibrated_kept,
    }


def variants(a: list[str], which: list[str] | None) -> list[Variant]:
    """The variants run (``which``: their names in the order to run, ``None`` all)."""
    tok, sen, nrm = Calib(a), Calib(a, "sentence"), Calib(a, "norm")
    pad = Calib(a, padded=True)
    out = [
        Variant("tw neurons, no refit", "tw", "neurons", None, tok),
        Variant("tw neurons, padded, token, d=0.01", "tw", "neurons", 0.01, pad),
    ]
    for cal, label in ((tok, "token"), (sen, "sentence"), (nrm, "norm")):
        for d in (0.001, 0.01, 0.1, 1.0):
            out.append(Variant(f"tw neurons, {label}, d={d:g}", "tw", "neurons", d, cal))
    out += [
        Variant("ew magnitude per layer", "ew", "magnitude", None, tok),
        Variant("ew wanda", "ew", "wanda", None, tok),
        Variant("ew wanda, effect allocation 0.1", "ew", "wanda", None, tok, "effect", 0.1),
        Variant("ew wanda, effect allocation 0.2", "ew", "wanda", None, tok, "effect", 0.2),
    ]
    for cal, label in ((tok, "token"), (sen, "sentence"), (nrm, "norm")):
        for d in (0.01, 0.1, 1.0):
            out.append(Variant(f"ew sparsegpt, {label}, d={d:g}", "ew", "sparsegpt", d, cal))
    out += [
        Variant(
            "tw neurons, token, d=0.01, effect allocation 0.1",
            "tw",
            "neurons",
            0.01,
            tok,
            "effect",
            0.1,
        ),
        Variant(
            "ew sparsegpt, token, d=0.1, effect allocation 0.1",
            "ew",
            "sparsegpt",
            0.1,
            tok,
            "effect",
            0.1,
        ),
    ]
    if which is None:
        return out
    by_name = {v.name: v for v in out}
    return [by_name[n] for n in which]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lee-wheel", default=None, help="the gensim wheel (evaluation set C)")
    ap.add_argument("--calibration", type=int, default=128, help="reference sentences (A)")
    ap.add_argument("--distill-sentences", type=int, default=512, help="A sentences to distil on")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--pairs", type=int, default=100, help="most news pairs evaluated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="variant names to run, separated by ';'")
    ap.add_argument("--library", action="store_true", help="also the library's prune_ rows")
    ap.add_argument("--distill", default="", help="'name=steps;...': distil these variants")
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_calibration_variants.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    evals: dict[str, Pairs] = {"sklearn_descr": sklearn_description_pairs()}
    if args.lee_wheel:
        evals["lee_news"] = lee_news_pairs(args.lee_wheel)[: args.pairs]
    a = python_reference_sentences(args.calibration)
    base = load_minilm()
    dense = {k: _encode(base, [x for x, _ in p] + [y for _, y in p]) for k, p in evals.items()}
    rows: list[dict[str, Any]] = []

    def record(name: str, model: Any, seconds: float, extra: dict[str, Any]) -> None:
        row = {"variant": name, "prune_seconds": seconds, "load": os.getloadavg()[0], **extra}
        row["eval"] = evaluate(model, evals, dense)
        rows.append(row)
        ev = " ".join(
            f"{k}: {v['cosine']:.4f}/{v['retrieval']:.2f}" for k, v in row["eval"].items()
        )
        print(f"{name:45s} {seconds:6.1f}s load {row['load']:.1f}  {ev}", flush=True)
        write_json(args.out, rows, partial=True)

    if args.library:
        for pattern in ("tw", "ew"):
            for label, sents, bs in (
                ("uncalibrated", None, 64),
                ("calibrated", a, 64),
                ("calibrated, batch 1", a, 1),
            ):
                t0 = time.perf_counter()
                model, extra = library_row(base, pattern, sents, bs, args.sparsity)
                record(f"library {pattern} {label}", model, time.perf_counter() - t0, extra)
    which = None if args.only is None else args.only.split(";")
    steps = {k: int(n) for k, _, n in (x.rpartition("=") for x in args.distill.split(";") if x)}
    for v in variants(a, which):
        t0 = time.perf_counter()
        model, masks, info = prune_variant(base, v, args.sparsity)
        kept = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
        record(v.name, model, time.perf_counter() - t0, {"achieved_sparsity": 1 - kept, **info})
        if v.name in steps:
            t0 = time.perf_counter()
            loss = distill(
                model,
                base,
                masks,
                python_reference_sentences(args.distill_sentences),
                steps[v.name],
            )
            record(
                f"{v.name} + distil {steps[v.name]}",
                model,
                time.perf_counter() - t0,
                {"distill_loss": loss},
            )
    write_json(args.out, rows, pairs={k: len(p) for k, p in evals.items()}, sparsity=args.sparsity)


if __name__ == "__main__":
    main()
