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
- TW rows only by tile-structured OBS with tiles of ``G`` = 8, 16, 32 output columns;
- a short distillation of the pruned FFN linears' kept weights (masks held) toward the dense
  model's sentence embeddings and last hidden states on all of A (``--distill``).

Every variant prunes layers in order, each layer's statistics gathered with the earlier ones
already pruned. JSON to ``benchmarks/results/tilesparse_calibration_variants.json``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from benchmarks.tilesparse.bench_calibration import evaluate as evaluate_pairs
from benchmarks.tilesparse.bench_oneshot_distill import distill
from benchmarks.tilesparse.calibration_methods import (
    TILE,
    Calib,
    Masks,
    dense_target_weight,
    encode,
    ffn_layers,
    grams,
    layer_inputs,
    magnitude_prune,
    neuron_prune,
    neurons_then_tile_obs,
    sparsegpt_prune,
    wanda_prune,
)
from recipes.corpora import (
    lee_news_pairs,
    python_reference_sentences,
    sklearn_description_pairs,
)
from recipes.minilm import load_minilm
from recipes.prune_transformer import is_ffn

Pairs = list[tuple[str, str]]


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
    neuron_share: float = 0.5
    block: int = 128
    per_output: bool = False
    tile: int = TILE


def layer_effects(base: Any, calib: Calib, method: str, sparsity: float) -> list[float]:
    """Per FFN linear, ``1 - cos`` of A's embeddings to dense with that layer alone pruned
    (no refit: magnitude / Wanda on the dense model's inputs)."""
    dense = encode(base, calib.sentences)
    out = []
    layers = ffn_layers(base)
    gs = grams(base, [m for _, m in layers], calib, True) if method != "magnitude" else None
    for i, (_, m) in enumerate(layers):
        saved = m.weight.detach().clone()
        if gs is None:
            magnitude_prune(m, sparsity)
        else:
            wanda_prune(m, gs[i], sparsity)
        emb = encode(base, calib.sentences)
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
    layers = [m for _, m in ffn_layers(model)]
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
    if v.method == "neurons_obs":
        assert v.damping is not None
        for b in range(0, len(layers), 2):
            fc1, fc2 = layers[b], layers[b + 1]
            masks.update(
                neurons_then_tile_obs(model, fc1, fc2, v.calib, v.neuron_share, v.damping, sparsity)
            )
        return model, masks, info
    if v.method == "neurons":
        for b in range(0, len(layers), 2):
            fc1, fc2 = layers[b], layers[b + 1]
            g2 = grams(model, [fc2], v.calib)[0]
            masks.update(neuron_prune(fc1, fc2, g2, (targets[b] + targets[b + 1]) / 2, v.damping))
        return model, masks, info
    dense_layers = [m for _, m in ffn_layers(base)]
    for i, m in enumerate(layers):
        if v.method == "sparsegpt_dense_target":
            assert v.damping is not None
            xd = layer_inputs(base, dense_layers[i], v.calib)
            xp = layer_inputs(model, m, v.calib)
            w_t, h = dense_target_weight(m, xp, xd, v.damping)
            with torch.no_grad():
                m.weight.copy_(w_t.float())
            masks[m] = sparsegpt_prune(m, None, targets[i], v.damping, h=h)
            continue
        if v.method == "tile_obs":
            assert v.damping is not None
            g = grams(model, [m], v.calib)[0]
            mask_kn, w_kn = tilesparse.tile_obs(
                m.weight.detach().T, g.h, targets[i], v.damping, v.tile
            )
            with torch.no_grad():
                m.weight.copy_(w_kn.T)
            masks[m] = mask_kn.T.contiguous()
            continue
        if v.method == "magnitude":
            masks[m] = magnitude_prune(m, targets[i])
            continue
        g = grams(model, [m], v.calib, v.method == "wanda")[0]
        if v.method == "wanda":
            masks[m] = wanda_prune(m, g, targets[i])
        else:
            assert v.damping is not None
            masks[m] = sparsegpt_prune(
                m, g, targets[i], v.damping, block=v.block, per_output=v.per_output
            )
    return model, masks, info


def evaluate(model: Any, evals: dict[str, Pairs], dense: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per set: cosine to dense (mean, 5th percentile) and next-sentence retrieval, encoded 16
    sentences at a time as this benchmark's dense embeddings are."""
    return evaluate_pairs(model, evals, dense, batch_size=16)


class _Encode:
    """``model.encode(sentences)``, as ``prune_``'s calibration."""

    def __init__(self, sentences: list[str], batch_size: int) -> None:
        self.sentences, self.batch_size = sentences, batch_size

    def __call__(self, model: nn.Module) -> None:
        encode(model, self.sentences, self.batch_size)


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
    """The variants run (``which``: their names in the order to run, ``None`` all); the
    ``N sentences`` variants calibrate on the first N sentences of A instead of ``a``."""
    tok, sen, nrm = Calib(a), Calib(a, "sentence"), Calib(a, "norm")
    more = {n: Calib(python_reference_sentences(n)) for n in (512, 1024)}
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
    for d in (0.01, 0.1):
        out.append(Variant(f"tw rows tile-obs, token, d={d:g}", "tw", "tile_obs", d, tok))
    for g in (8, 16, 32):
        out.append(
            Variant(f"tw rows tile-obs G={g}, token, d=0.01", "tw", "tile_obs", 0.01, tok, tile=g)
        )
    for d in (0.1, 0.01):
        out.append(
            Variant(f"ew sparsegpt, dense targets, d={d:g}", "ew", "sparsegpt_dense_target", d, tok)
        )
    out += [
        Variant("ew sparsegpt, per output, d=0.1", "ew", "sparsegpt", 0.1, tok, per_output=True),
        Variant("ew sparsegpt, block 32, d=0.1", "ew", "sparsegpt", 0.1, tok, block=32),
        Variant("ew sparsegpt, block 1536, d=0.1", "ew", "sparsegpt", 0.1, tok, block=1536),
    ]
    for share in (0.5, 0.4, 0.3):
        out.append(
            Variant(
                f"tw neurons {share:g} + fc2 tile-obs, d=0.1",
                "tw",
                "neurons_obs",
                0.1,
                tok,
                neuron_share=share,
            )
        )
    for n, cal in more.items():
        out.append(
            Variant(f"ew sparsegpt, token, d=0.1, {n} sentences", "ew", "sparsegpt", 0.1, cal)
        )
        out.append(
            Variant(f"ew sparsegpt, token, d=0.01, {n} sentences", "ew", "sparsegpt", 0.01, cal)
        )
        for d in (0.01, 0.1):
            out.append(
                Variant(
                    f"tw rows tile-obs, token, d={d:g}, {n} sentences", "tw", "tile_obs", d, cal
                )
            )
    if which is None:
        return out
    by_name = {v.name: v for v in out}
    return [by_name[n] for n in which]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lee-wheel", default=None, help="the gensim wheel (evaluation set C)")
    ap.add_argument("--calibration", type=int, default=128, help="reference sentences (A)")
    ap.add_argument(
        "--distill-sentences", type=int, default=0, help="A sentences to distil on (0: all of A)"
    )
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--pairs", type=int, default=100, help="most news pairs evaluated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default=None, help="variant names to run, separated by ';'")
    ap.add_argument("--library", action="store_true", help="also the library's prune_ rows")
    ap.add_argument(
        "--distill",
        default="",
        help="'name=steps@lr;...': distil these variants (a name may repeat: each run starts "
        "from the pruned weights)",
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_calibration_variants.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    evals: dict[str, Pairs] = {"sklearn_descr": sklearn_description_pairs()}
    if args.lee_wheel:
        evals["lee_news"] = lee_news_pairs(args.lee_wheel)[: args.pairs]
    a = python_reference_sentences(args.calibration)
    base = load_minilm()
    dense = {k: encode(base, [x for x, _ in p] + [y for _, y in p]) for k, p in evals.items()}
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
    runs: dict[str, list[tuple[int, float]]] = {}
    for spec in (x for x in args.distill.split(";") if x):
        name, _, budget = spec.rpartition("=")
        n, _, lr = budget.partition("@")
        runs.setdefault(name, []).append((int(n), float(lr or 1e-4)))
    distil_text = python_reference_sentences(args.distill_sentences or None)
    for v in variants(a, which):
        t0 = time.perf_counter()
        model, masks, info = prune_variant(base, v, args.sparsity)
        kept = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
        record(v.name, model, time.perf_counter() - t0, {"achieved_sparsity": 1 - kept, **info})
        pruned = copy.deepcopy(model.state_dict())
        for n, lr in runs.get(v.name, []):
            model.load_state_dict(pruned)
            t0 = time.perf_counter()
            losses = distill(model, base, masks, distil_text, lr, n, train_mode=False)
            kept = sum(int((m.weight != 0).sum()) for m in masks) / sum(
                mk.numel() for mk in masks.values()
            )
            record(
                f"{v.name} + distil {n} @ {lr:g}",
                model,
                time.perf_counter() - t0,
                {
                    "achieved_sparsity": 1 - kept,
                    "distill_sentences": len(distil_text),
                    "distill_loss_first": losses[:10],
                    "distill_loss_last": losses[-10:],
                },
            )
    write_json(args.out, rows, pairs={k: len(p) for k, p in evals.items()}, sparsity=args.sparsity)


if __name__ == "__main__":
    main()
