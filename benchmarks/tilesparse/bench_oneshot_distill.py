"""One-shot prune of the packaged MiniLM-L6's 12 FFN linears at 50 %, then an optional short
distillation toward the dense model; calibrate on A (the first 128 prose sentences of the
Python Language Reference), choose on B (scikit-learn's dataset descriptions), report on C
(the Lee news stories of the gensim wheel; never used for a choice).

    pip download --no-deps gensim==4.4.0 -d DIR
    python -m benchmarks.tilesparse.bench_oneshot_distill --lee-wheel DIR/gensim-4.4.0-*.whl \\
        --prune library-ew --distill "3e-4:300;1e-3:300" --out benchmarks/results/x.json

``--prune``:

- ``library-tw`` / ``library-ew``: ``tilesparse.prune_`` with the default
  ``TileSparseConfig(pattern=..., sparsity=0.5)`` plus ``calibration=`` (A encoded);
- ``neurons``: neuron pairs (``fc1`` columns and ``fc2`` rows of the lowest-energy hidden
  units, ``fc2``'s kept weights and bias refitted, damping 0.01: the library's TW choice);
- ``tile-obs:G``: both linears rows only by tile-structured OBS (``tilesparse.tile_obs``)
  with tiles of ``G`` output columns, damping 0.01.

``--distill "lr:steps;..."``: each run starts from the pruned weights: Adam on the FFN
linears' kept weights and biases (pruned weights get zero gradients and stay zero), batches
of 16 sentences drawn from all of A (1,272 sentences; never B or C), ``lr`` after 20 warm-up
steps falling linearly to 0, loss ``1 - cos`` of the sentence embeddings (mean-pooled,
normalised) plus the last hidden states' relative squared error over real tokens; both
models in eval mode (no dropout) unless ``--train-mode`` (the student's dropout on, as
``tilesparse.distill_(train_mode=True)`` runs it). JSON rows: each set's
cosine to dense and next-sentence retrieval, seconds, load average.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import sys
import time
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from benchmarks.tilesparse.bench_calibration import evaluate
from benchmarks.tilesparse.calibration_methods import Calib, encode, ffn_layers, grams, neuron_prune
from recipes.corpora import lee_news_pairs, python_reference_sentences, sklearn_description_pairs
from recipes.minilm import load_minilm
from recipes.prune_transformer import is_ffn

Masks = dict[nn.Linear, torch.Tensor]


class _Encode:
    """``model.encode(sentences)``, as ``prune_``'s calibration."""

    def __init__(self, sentences: list[str]) -> None:
        self.sentences = sentences

    def __call__(self, model: nn.Module) -> None:
        encode(model, self.sentences)


def prune(base: Any, kind: str, a: list[str]) -> tuple[Any, Masks, float]:
    """A pruned copy of ``base`` (``--prune``), its FFN masks (torch layout) and the seconds."""
    model = copy.deepcopy(base)
    t0 = time.perf_counter()
    if kind.startswith("library-"):
        pattern = tilesparse.Pattern(kind.split("-", 1)[1])
        cfg = tilesparse.TileSparseConfig(pattern=pattern, sparsity=0.5)
        pruner = tilesparse.prune_(model, cfg, is_ffn, calibration=_Encode(a))
        for m in pruner.layers.values():
            parametrize.remove_parametrizations(m, "weight", leave_parametrized=True)
    else:
        layers = [m for _, m in ffn_layers(model)]
        cal = Calib(a)
        for b in range(0, len(layers), 2):
            fc1, fc2 = layers[b], layers[b + 1]
            if kind == "neurons":
                neuron_prune(fc1, fc2, grams(model, [fc2], cal)[0], 0.5, 0.01)
                continue
            tile = int(kind.split(":")[1])
            for m in (fc1, fc2):
                g = grams(model, [m], cal)[0]
                _, w_kn = tilesparse.tile_obs(m.weight.detach().T, g.h, 0.5, 0.01, tile)
                with torch.no_grad():
                    m.weight.copy_(w_kn.T)
    seconds = time.perf_counter() - t0
    return model, {m: m.weight.detach() != 0 for _, m in ffn_layers(model)}, seconds


def distill(
    student: Any,
    teacher: Any,
    masks: Masks,
    sentences: list[str],
    lr: float,
    steps: int,
    train_mode: bool,
) -> list[float]:
    """The module docstring's distillation, in place; returns the losses."""
    params = [p for m in masks for p in m.parameters()]
    for p in student.parameters():
        p.requires_grad_(False)
    for p in params:
        p.requires_grad_(True)
    hooks = [m.weight.register_hook(lambda g, mk=mk: g * mk) for m, mk in masks.items()]
    opt = torch.optim.Adam(params, lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / 20) * max(0.0, 1 - i / steps)
    )
    student.eval()
    teacher.eval()
    if train_mode:
        student.train()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(sentences), (16,), generator=gen).tolist()
        feats = student.tokenize([sentences[j] for j in idx])
        with torch.no_grad():
            t = teacher(dict(feats))
        s = student(dict(feats))
        keep = feats["attention_mask"].bool()
        cos = nn.functional.cosine_similarity(
            s["sentence_embedding"], t["sentence_embedding"], dim=-1
        )
        tt, ss = t["token_embeddings"][keep], s["token_embeddings"][keep]
        mse = (ss - tt).pow(2).sum(-1).mean() / tt.pow(2).sum(-1).mean()
        loss = (1 - cos.mean()) + mse
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        with torch.no_grad():
            for m, mk in masks.items():
                m.weight.mul_(mk)
        losses.append(float(loss.detach()))
    for h in hooks:
        h.remove()
    for p in student.parameters():
        p.requires_grad_(False)
    student.eval()
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lee-wheel", default=None, help="the gensim wheel (evaluation set C)")
    ap.add_argument("--prune", required=True, help="library-tw | library-ew | neurons | tile-obs:G")
    ap.add_argument("--distill", default="", help="'lr:steps;...'")
    ap.add_argument("--train-mode", action="store_true", help="the student's dropout on")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_oneshot_distill.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    evals = {"sklearn_descr": sklearn_description_pairs()}
    if args.lee_wheel:
        evals["lee_news"] = lee_news_pairs(args.lee_wheel)[:100]
    a = python_reference_sentences(128)
    base = load_minilm()
    dense = {k: encode(base, [x for x, _ in p] + [y for _, y in p]) for k, p in evals.items()}
    rows: list[dict[str, Any]] = []

    def record(name: str, model: Any, seconds: float, **extra: Any) -> None:
        ev = evaluate(model, evals, dense, batch_size=16)
        rows.append(
            {"run": name, "seconds": seconds, "load": os.getloadavg()[0], "eval": ev, **extra}
        )
        print(
            name, f"{seconds:.1f}s", {k: round(v["cosine"], 4) for k, v in ev.items()}, flush=True
        )
        write_json(args.out, rows, command=" ".join(sys.argv[1:]), partial=True)

    model, masks, seconds = prune(base, args.prune, a)
    record(args.prune, model, seconds)
    pruned = copy.deepcopy(model.state_dict())
    text = python_reference_sentences()
    for spec in (x for x in args.distill.split(";") if x):
        lr, steps = spec.split(":")
        model.load_state_dict(pruned)
        t0 = time.perf_counter()
        losses = distill(model, base, masks, text, float(lr), int(steps), args.train_mode)
        kept = sum(int((m.weight != 0).sum()) for m in masks) / sum(
            mk.numel() for mk in masks.values()
        )
        record(
            f"{args.prune} + distil {steps} @ {lr}" + (" (dropout on)" if args.train_mode else ""),
            model,
            time.perf_counter() - t0,
            achieved_sparsity=1 - kept,
            distill_sentences=len(text),
            loss_first=losses[:5],
            loss_last=losses[-5:],
        )
    write_json(args.out, rows, command=" ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
