"""One-shot pruning of the packaged MiniLM-L6's FFN linears with and without calibration,
side by side in one run, on three real sources with three roles: calibrate on the Python
Language Reference (A), choose the library's defaults on scikit-learn's dataset descriptions
(B, reported as ``tuning``), report on the Lee news stories (C, ``evaluation``).

    python -m benchmarks.tilesparse.bench_calibration --lee-wheel DIR/gensim-4.4.0-...whl

(the wheel from ``pip download --no-deps gensim==4.4.0 -d DIR``, read with ``zipfile``, never
installed; without it the news evaluation is skipped).

Per pattern (TW, TW rows-only, EW, 2:4) at 50 %, the *default* ``TileSparseConfig`` and:

- ``uncalibrated``: no calibration (magnitude, one global threshold);
- ``real``: ``calibration=`` the first ``--calibration`` prose sentences of the Python
  Language Reference (``pydoc_data/topics.py``, standard library);
- ``templated``: ``calibration=`` 64 generated template sentences (:mod:`recipes.sentences`);
- ``broad``: ``calibration=`` ``--broad`` sentences of five technical-prose sources
  interleaved (:func:`recipes.corpora.broad_sentences`, the transformer recipe's default).

Evaluated on sources the calibration never saw (:mod:`recipes.corpora`): the first two
sentences of each Lee background news story (gensim's ``lee_background.cor``: cosine to dense
and next-sentence retrieval accuracy; the evaluation set) and consecutive sentence pairs of
scikit-learn's dataset descriptions (``sklearn/datasets/descr/*.rst``; the set the defaults
were chosen on). JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import logging
import time
from typing import Any

import torch
from torch import nn

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from recipes.corpora import (
    broad_sentences,
    lee_news_pairs,
    python_reference_sentences,
    retrieval_accuracy,
    sklearn_description_pairs,
)
from recipes.minilm import load_minilm
from recipes.prune_transformer import is_ffn
from recipes.sentences import make_sentences

PATTERNS = ("tw", "ew", "nm")


def _encode(model: Any, sentences: list[str], batch_size: int = 64) -> torch.Tensor:
    return model.encode(sentences, batch_size=batch_size, convert_to_tensor=True).float().cpu()


class _Calibration:
    """``model.encode(sentences)``, as a calibration callable."""

    def __init__(self, sentences: list[str]) -> None:
        self.sentences = sentences

    def __call__(self, model: nn.Module) -> None:
        _encode(model, self.sentences)


def evaluate(
    model: Any,
    evals: dict[str, list[tuple[str, str]]],
    dense: dict[str, torch.Tensor],
    batch_size: int = 64,
) -> dict[str, Any]:
    """Per set of sentence pairs: cosine to the dense model's embeddings ``dense[name]`` (mean,
    5th percentile) and next-sentence retrieval accuracy, encoding ``batch_size`` at a time."""
    out = {}
    for name, pairs in evals.items():
        n = len(pairs)
        emb = _encode(model, [a for a, _ in pairs] + [b for _, b in pairs], batch_size)
        cos = nn.functional.cosine_similarity(emb, dense[name], dim=-1)
        out[name] = {
            "cosine": float(cos.mean()),
            "cosine_p05": float(cos.quantile(0.05)),
            "retrieval": retrieval_accuracy(emb[:n], emb[n:]),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lee-wheel", default=None, help="the gensim wheel (news evaluation)")
    ap.add_argument("--calibration", type=int, default=128, help="reference sentences")
    ap.add_argument("--broad", type=int, default=1270, help="broad calibration sentences")
    ap.add_argument("--sparsity", type=float, default=0.5)
    ap.add_argument("--patterns", default=",".join(PATTERNS))
    ap.add_argument("--modes", default="uncalibrated,real,templated,broad")
    ap.add_argument("--pairs", type=int, default=100, help="most news pairs evaluated")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--per-layer", action="store_true", help="global_threshold=False: each layer at the target"
    )
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_calibration.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    evals: dict[str, list[tuple[str, str]]] = {"sklearn_descr": sklearn_description_pairs()}
    if args.lee_wheel:
        evals["lee_news"] = lee_news_pairs(args.lee_wheel)[: args.pairs]
    modes = args.modes.split(",")
    calibrations = {
        "real": python_reference_sentences(args.calibration),
        "templated": make_sentences(64, seed=3),
    }
    if "broad" in modes:  # harvested only when asked: 1-2 minutes of parsing
        calibrations["broad"] = broad_sentences(args.broad)
    base = load_minilm()
    dense = {k: _encode(base, [a for a, _ in p] + [b for _, b in p]) for k, p in evals.items()}
    n = {k: len(p) for k, p in evals.items()}
    dense_scores = {
        k: {"retrieval": retrieval_accuracy(d[: n[k]], d[n[k] :])} for k, d in dense.items()
    }
    print("dense", dense_scores, flush=True)
    rows = []
    for mode in modes:  # every pattern's uncalibrated row first
        for pattern in args.patterns.split(","):
            model = copy.deepcopy(base)
            cfg = tilesparse.TileSparseConfig(
                pattern=pattern,
                sparsity=None if pattern == "nm" else args.sparsity,
                global_threshold=not args.per_layer,
            )
            calib = None if mode == "uncalibrated" else _Calibration(calibrations[mode])
            t0 = time.perf_counter()
            pruner = tilesparse.prune_(model, cfg, is_ffn, calibration=calib)
            seconds = time.perf_counter() - t0
            row = {
                "pattern": pattern,
                "mode": mode,
                "global_threshold": not args.per_layer,
                "calibration_sentences": 0 if calib is None else len(calib.sentences),
                "achieved_sparsity": pruner.overall_sparsity(),
                "prune_seconds": seconds,
                "eval": evaluate(model, evals, dense),
                "output_check": None
                if pruner.output_check is None
                else {
                    "layer": pruner.output_check.layer,
                    "calibrated_error": pruner.output_check.calibrated_error,
                    "uncalibrated_error": pruner.output_check.uncalibrated_error,
                    "calibrated_kept": pruner.output_check.calibrated_kept,
                },
                "layers": [
                    {
                        "fqn": r.fqn.split("encoder.")[-1],
                        "importance": r.importance.value if r.importance else None,
                        "column_share": r.column_share,
                        "neurons_with": r.neurons_with,
                        "accepted": r.accepted,
                        "damping": r.damping,
                        "held_out_error": r.held_out_error,
                        "held_out_magnitude_error": r.held_out_magnitude_error,
                    }
                    for r in pruner.reconstructions
                ],
            }
            rows.append(row)
            ev = " ".join(
                f"{k}: cos {v['cosine']:.4f} ret {v['retrieval']:.3f}"
                for k, v in row["eval"].items()
            )
            print(f"{pattern:8s} {mode:13s} {seconds:6.1f}s  {ev}", flush=True)
            write_json(args.out, rows, dense=dense_scores, partial=True)
    write_json(
        args.out,
        rows,
        dense=dense_scores,
        sources={
            "calibration_real": "pydoc_data/topics.py (Python standard library)",
            "calibration_templated": "recipes.sentences.make_sentences(64, seed=3)",
            "calibration_broad": "recipes.corpora.broad_sentences: the Language Reference, "
            "standard-library and package docstrings, /usr/share/doc, /usr/share/info",
            "sklearn_descr": "scikit-learn: sklearn/datasets/descr/*.rst (tuning set)",
            "lee_news": "gensim 4.4.0 wheel: gensim/test/test_data/lee_background.cor "
            "(evaluation set)",
        },
        pairs={k: len(p) for k, p in evals.items()},
    )


if __name__ == "__main__":
    main()
