"""Prune a pretrained sentence-transformers model with calibration, optionally distil it on
unlabelled text, and report how close it stays to the dense model and how fast it runs.

``python -m recipes.prune_transformer`` (default: the packaged all-MiniLM-L6-v2, its 12 FFN
linears, TW 50 % with the default config plus a calibration) writes ``report.json``,
``report.md``, ``plots/layers.png`` and the compressed model (``model/``, reloadable with
``SentenceTransformer(path)`` + ``tilesparse.load_compressed``) into ``--out``. The text is
real and from different sources (:mod:`recipes.corpora`): calibration on 1,270 sentences of
English Wikipedia where gensim's text is at hand (``--lee-wheel``, or an installed gensim
holding it: :func:`recipes.corpora.wikipedia_sentences`), else of five technical-prose
sources interleaved (:func:`recipes.corpora.broad_sentences`: the Python Language Reference,
docstrings of the standard library and of installed packages, the system's
``/usr/share/doc`` and ``/usr/share/info``; ``--calibration-text`` names one, ``reference``
the Language Reference alone, 256 sentences), distillation on Language Reference prose the
calibration did not use, evaluation on scikit-learn's dataset descriptions
(``sklearn/datasets/descr/*.rst``) and, given ``--lee-wheel``, on gensim's Lee background
news corpus: cosine to dense and next-sentence retrieval accuracy, dense beside pruned.
"""

from __future__ import annotations

import copy
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

import tilesparse
from recipes.cli import OutFolder, check_knobs, knob, parse_knobs, run_recipe
from recipes.corpora import (
    BROAD_LEAST,
    BROAD_SOURCES,
    CalibrationText,
    calibration_sentences,
    default_calibration_text,
    lee_news_pairs,
    python_reference_sentences,
    retrieval_accuracy,
    sklearn_description_pairs,
)
from recipes.minilm import load_minilm

Pairs = list[tuple[str, str]]

SOURCES = {
    "sklearn_descr": "scikit-learn's dataset descriptions (sklearn/datasets/descr/*.rst)",
    "lee_news": "gensim's Lee background news corpus (gensim/test/test_data/lee_background.cor)",
}

CALIBRATION_SOURCES = {
    CalibrationText.BROAD: "the Python Language Reference, standard-library and package "
    "docstrings, /usr/share/doc and /usr/share/info, interleaved (recipes.corpora.broad_sentences)",
    CalibrationText.REFERENCE: "the Python Language Reference (pydoc_data/topics.py)",
    CalibrationText.WIKIPEDIA: "English Wikipedia articles shipped with gensim "
    "(gensim/test/test_data/enwiki-latest-pages-articles1.xml-...-shortened.bz2)",
}

#: what a run writes into --out: all that --overwrite of such a run's folder removes
OUTPUTS = ("report.json", "report.md", "model", "plots")

log = logging.getLogger("recipes.prune_transformer")


@dataclass(frozen=True)
class PruneTransformerConfig:
    """Every knob of the recipe, with its default (each is a ``--flag`` of the same name)."""

    model: str | None = knob(None, "sentence-transformers folder; none = the packaged MiniLM")
    layers: Literal["ffn", "all"] = knob("ffn", "which linears: the FFN pair of each block, or all")
    pattern: Literal["tw", "tw_rows", "ew", "nm"] = knob("tw", "sparsity pattern")
    sparsity: float = knob(0.5, "target sparsity (nm: always 2:4 = 0.5)", ge=0, lt=1)
    # none: what fits the layers (tilesparse.fitting_tile: 128 for MiniLM's FFN)
    tile: int | None = knob(None, "TW tile width G (none: what fits the layers)", ge=1)
    # none: per layer, activation or magnitude, whichever the held-out calibration prefers
    importance: Literal["activation", "magnitude"] | None = knob(None, "importance score")
    # none: per layer, 0.5 or 0 (rows only) by the held-out calibration error; pruning whole
    # output columns of the FFN's second linear zeroes dimensions of the residual stream
    column_share: float | None = knob(
        None, "share of the TW budget taken by whole columns", ge=0, le=1
    )
    # the default: one threshold allocates the layers' sparsities, each layer's mask is then
    # chosen at its own (--no-global-threshold: every layer at the target, as SparseGPT)
    global_threshold: bool = knob(True, "one threshold across layers instead of per layer")
    # none: wikipedia where gensim's text is at hand (--lee-wheel, or an installed gensim
    # holding it), else broad; chosen on movie reviews, reported on news (docs/benchmarks.md,
    # "One-shot MiniLM: general-domain calibration text")
    calibration_text: CalibrationText | None = knob(
        None, "real text calibrating (none: wikipedia with gensim's text at hand, else broad)"
    )
    # none: 1,270 broad (254 of each source), 256 reference (the rest of the Language
    # Reference, ~1,000 sentences, is left to distil on)
    calibration_sentences: int | None = knob(
        None, "calibration sentences (none: 1270 broad or wikipedia, 256 reference)", ge=1
    )
    held_out: int = knob(300, "most evaluation pairs per source", ge=1)
    lee_wheel: str | None = knob(
        None, "gensim wheel: the Lee news evaluation and the Wikipedia calibration text"
    )
    distill_seconds: float = knob(0.0, "distillation budget in seconds (0: none)", ge=0)
    distill_sentences: int = knob(1000, "most Python reference sentences to distil on", ge=1)
    distill_batch: int = knob(32, "sentences per distillation step", ge=1)
    distill_lr: float = knob(1e-4, "AdamW learning rate of the distillation", gt=0)
    speed_sentences: int = knob(256, "sentences per timed encode, dense vs condensed", ge=1)
    speed_repeats: int = knob(3, "timed encodes of each model (interleaved; median)", ge=1)
    # 1: on the shared 2-core machine 2 threads ran the distillation at 5 steps in 300 s,
    # 1 thread at 87 (thread contention), as prune_dlrm's training measured
    threads: int = knob(1, "torch threads", ge=1, le=256)
    seed: int = knob(0, "seed of the distillation", ge=0)
    save_model: bool = knob(True, "save the compressed model and check it reloads equal")
    out: str | None = knob(None, "output folder; none = runs/prune_transformer-<UTC timestamp>")
    overwrite: bool = knob(False, "clear a non-empty --out that holds an earlier run")
    progress: bool = knob(True, "tqdm progress bars")

    def __post_init__(self) -> None:
        check_knobs(self)

    @property
    def folder(self) -> OutFolder:
        return OutFolder("prune_transformer", self.out, self.overwrite, outputs=OUTPUTS)

    def text(self) -> CalibrationText:
        """The calibration text in effect (:func:`recipes.corpora.default_calibration_text`
        when none is named)."""
        if self.calibration_text is not None:
            return self.calibration_text
        return default_calibration_text(self.lee_wheel)

    def prune_config(self) -> tilesparse.TileSparseConfig:
        return tilesparse.TileSparseConfig(
            pattern=tilesparse.Pattern(self.pattern),
            sparsity=None if self.pattern == "nm" else self.sparsity,
            tile=self.tile,
            importance=None if self.importance is None else tilesparse.Importance(self.importance),
            column_share=self.column_share,
            global_threshold=self.global_threshold,
        )


def is_ffn(module: nn.Module, fqn: str) -> bool:
    """The two linears of a BERT block's feed-forward network."""
    return fqn.endswith("intermediate.dense") or (
        fqn.endswith("output.dense") and ".attention." not in fqn
    )


def is_encoder_linear(module: nn.Module, fqn: str) -> bool:
    """Every linear of the encoder blocks (not the pooler)."""
    return ".encoder." in f".{fqn}" and isinstance(module, nn.Linear)


class _Encoder:
    """``model.encode`` of fixed sentences, as a calibration callable."""

    def __init__(self, sentences: list[str], batch_size: int = 64) -> None:
        self.sentences, self.batch_size = sentences, batch_size

    def __call__(self, model: nn.Module) -> torch.Tensor:
        return _encode(model, self.sentences, self.batch_size)


def _encode(model: nn.Module, sentences: list[str], batch_size: int = 64) -> torch.Tensor:
    out = model.encode(sentences, batch_size=batch_size, convert_to_tensor=True)  # type: ignore[operator]
    return out.float().cpu()


def _embed(model: nn.Module, features: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sentence embeddings of tokenized ``features``, with gradients."""
    return model(dict(features))["sentence_embedding"]


def cosine(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    c = nn.functional.cosine_similarity(a, b, dim=-1)
    return {"mean": float(c.mean()), "min": float(c.min()), "p05": float(c.quantile(0.05))}


def _speed(
    dense: nn.Module, sparse: nn.Module, cfg: PruneTransformerConfig, sents: list[str]
) -> dict[str, Any]:
    """Median seconds of one encode of ``sents`` (one batch), the two models interleaved."""
    times: dict[str, list[float]] = {"dense": [], "condensed": []}
    for m in (dense, sparse):
        _encode(m, sents[:8], 8)  # warm-up
    for _ in range(cfg.speed_repeats):
        for name, m in (("dense", dense), ("condensed", sparse)):
            t0 = time.perf_counter()
            _encode(m, sents, len(sents))
            times[name].append(time.perf_counter() - t0)
    d, s = statistics.median(times["dense"]), statistics.median(times["condensed"])
    return {"sentences": len(sents), "dense_s": d, "condensed_s": s, "speedup": d / s, "all": times}


def _line(res: dict[str, dict[str, float]]) -> str:
    return ", ".join(
        f"{k}: cosine {v['mean']:.4f}, retrieval {v['retrieval']:.3f}" for k, v in res.items()
    )


def _layer_rows(pruner: tilesparse.TileSparsePruner) -> list[dict[str, Any]]:
    rec = {r.fqn: r for r in pruner.reconstructions}
    rows = []
    for st in pruner.stats():
        row = st.to_dict()
        r = rec.get(st.fqn)
        if r is not None:
            row |= {
                "importance": None if r.importance is None else r.importance.value,
                "column_share": r.column_share,
                "refit_accepted": r.accepted,
                "damping": r.damping,
                "held_out_error": r.held_out_error,
                "held_out_magnitude_error": r.held_out_magnitude_error,
            }
        rows.append(row)
    return rows


def _sources(cfg: PruneTransformerConfig) -> tuple[list[str], list[str], dict[str, Pairs]]:
    """Calibration sentences (:meth:`PruneTransformerConfig.text`), distillation sentences (Python
    reference prose the calibration does not hold) and the evaluation pairs per source.

    Raises:
        ValueError: when ``--calibration-sentences`` is too small for broad text, when the
            calibration holds a sentence of the evaluation pairs, or when a distillation is
            asked for and fewer than one ``--distill-batch`` of sentences is left for it
            (fewer than ``--distill-sentences``: a logged warning).
    """
    n, text = cfg.calibration_sentences, cfg.text()
    if text is CalibrationText.BROAD and n is not None and n < BROAD_LEAST:
        raise ValueError(
            f"--calibration-sentences {n} with --calibration-text broad: at least "
            f"{BROAD_LEAST} needed (one of each source: {', '.join(BROAD_SOURCES)})"
        )
    calib = calibration_sentences(text, n, cfg.lee_wheel)
    used = set(calib)
    distil = [s for s in python_reference_sentences() if s not in used][: cfg.distill_sentences]
    if cfg.distill_seconds > 0 and len(distil) < cfg.distill_sentences:
        # fewer than asked is the default's case (the reference's 1,272 prose sentences, some
        # repeated, less every copy of those the calibration holds: 935 left at 256); fewer
        # than one batch cannot distil
        left = (
            f"--distill-sentences {cfg.distill_sentences}: only {len(distil)} Python reference "
            f"sentences are left after {len(calib)} {text} calibration sentences"
        )
        if len(distil) < cfg.distill_batch:
            raise ValueError(
                f"{left}, fewer than one --distill-batch ({cfg.distill_batch}); lower "
                "--calibration-sentences"
            )
        log.warning("%s; distilling on those", left)
    evals: dict[str, Pairs] = {"sklearn_descr": sklearn_description_pairs()[: cfg.held_out]}
    if cfg.lee_wheel is not None:
        evals["lee_news"] = lee_news_pairs(cfg.lee_wheel)[: cfg.held_out]
    held = {s for p in evals.values() for pair in p for s in pair}
    leaked = used & held
    if leaked:
        raise ValueError(
            f"{len(leaked)} calibration sentences are also evaluation sentences "
            f"({', '.join(evals)}), e.g. {min(leaked)!r}: the evaluation must be text the "
            "calibration never saw"
        )
    return calib, distil, evals


def _flat(pairs: Pairs) -> list[str]:
    return [a for a, _ in pairs] + [b for _, b in pairs]


def evaluate(
    model: nn.Module, evals: dict[str, Pairs], dense: dict[str, torch.Tensor]
) -> dict[str, dict[str, float]]:
    """Per source: cosine of ``model``'s embeddings to ``dense`` (mean, p05, min) and
    next-sentence retrieval accuracy (:func:`recipes.corpora.retrieval_accuracy`)."""
    out = {}
    for name, pairs in evals.items():
        emb = _encode(model, _flat(pairs))
        n = len(pairs)
        out[name] = cosine(emb, dense[name]) | {"retrieval": retrieval_accuracy(emb[:n], emb[n:])}
    return out


def main(cfg: PruneTransformerConfig) -> dict[str, Any]:
    """Run the recipe; returns the report (also written to ``cfg.out``)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    cfg.folder.check()
    pcfg = cfg.prune_config()
    out = cfg.folder.open()
    t0 = time.perf_counter()
    print(f"harvesting the {cfg.text()} calibration text", flush=True)
    calib, distil, evals = _sources(cfg)
    harvest = time.perf_counter() - t0
    teacher = load_minilm(cfg.model)
    student = copy.deepcopy(teacher)
    dense_emb = {k: _encode(teacher, _flat(p)) for k, p in evals.items()}
    results: dict[str, Any] = {"dense": evaluate(teacher, evals, dense_emb)}
    filter_fn = is_ffn if cfg.layers == "ffn" else is_encoder_linear
    t0 = time.perf_counter()
    pruner = tilesparse.prune_(
        student, pcfg, filter_fn, calibration=_Encoder(calib), progress=cfg.progress
    )
    seconds: dict[str, float] = {"harvest": harvest, "calibrate": time.perf_counter() - t0}
    results["oneshot"] = evaluate(student, evals, dense_emb)
    print(f"one-shot with calibration: {_line(results['oneshot'])}", flush=True)
    distill_report = None
    if cfg.distill_seconds > 0:
        distill_report = _distill(cfg, student, teacher, pruner, distil)
        seconds["distill"] = distill_report["seconds"]
        results["distilled"] = evaluate(student, evals, dense_emb)
        print(
            f"distilled ({distill_report['steps']} steps, {distill_report['seconds']:.0f} s): "
            f"{_line(results['distilled'])}",
            flush=True,
        )
    layers = _layer_rows(pruner)
    sparsity = pruner.overall_sparsity()
    pruner.compress()
    results["compressed"] = evaluate(student, evals, dense_emb)
    speed_sents = [s for p in evals.values() for s in _flat(p)][: cfg.speed_sentences]
    speed = _speed(teacher, student, cfg, speed_sents)
    memory = {
        "dense": tilesparse.model_memory(teacher).to_dict(),
        "compressed": tilesparse.model_memory(student).to_dict(),
    }
    saved = _save_and_reload(student, out / "model", speed_sents[:16]) if cfg.save_model else None
    report: dict[str, Any] = {
        "recipe": "prune_transformer",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "knobs": asdict(cfg),
        "config": pcfg.to_dict(),
        "text": {
            "calibration": f"{len(calib)} sentences: {CALIBRATION_SOURCES[cfg.text()]}",
            "distillation": f"{len(distil)} other sentences of the Python Language Reference "
            "(pydoc_data/topics.py)",
            "evaluation": {k: f"{len(p)} sentence pairs: {SOURCES[k]}" for k, p in evals.items()},
        },
        "achieved_sparsity": sparsity,
        "evaluation": results,
        "distillation": distill_report,
        "layers": layers,
        "speed": speed,
        "memory": {
            k: {f: v[f] for f in ("dense_bytes", "weight_bytes", "index_bytes", "total_fraction")}
            for k, v in memory.items()
        },
        "saved_model": saved,
        "seconds": seconds | {"total": time.perf_counter() - t_start},
    }
    report["plot"] = _plot(out, report)
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "report.md").write_text(markdown(report))
    print(markdown(report))
    print(f"written to {out}")
    return report


def _distill(
    cfg: PruneTransformerConfig,
    student: Any,
    teacher: Any,
    pruner: tilesparse.TileSparsePruner,
    sentences: list[str],
) -> dict[str, Any]:
    """Distil ``student`` toward ``teacher`` on ``sentences`` for ``cfg.distill_seconds``."""
    batches = [
        student.preprocess(sentences[i : i + cfg.distill_batch])
        for i in range(0, len(sentences), cfg.distill_batch)
    ]
    d = tilesparse.distill_(
        student, teacher, batches, pruner, seconds=cfg.distill_seconds,
        lr=cfg.distill_lr, outputs=_embed, progress=cfg.progress,
    )  # fmt: skip
    return {
        "steps": d.steps,
        "seconds": d.seconds,
        "first_loss": d.losses[0],
        "last_loss": d.losses[-1],
    }


def _save_and_reload(model: nn.Module, path: Path, sents: list[str]) -> dict[str, Any]:
    """Save the compressed model, load it back (dense architecture + load_compressed) and
    compare embeddings."""
    model.save(str(path))  # type: ignore[operator]
    back = load_minilm(path)
    tilesparse.load_compressed(back, path)
    a, b = _encode(model, sents), _encode(back, sents)
    return {
        "path": str(path.name),
        "reload_equal": bool(torch.equal(a, b)),
        "max_abs_diff": float((a - b).abs().max()),
    }


def _plot(out: Path, report: dict[str, Any]) -> str:
    from recipes.prune_report import _pyplot

    plt = _pyplot()
    rows = report["layers"]
    fig, ax = plt.subplots(figsize=(9, 3.5))
    ax.bar(range(len(rows)), [r["sparsity"] for r in rows], color="tab:blue")
    ax.set_xticks(
        range(len(rows)), [r["fqn"].split("encoder.")[-1] for r in rows], rotation=70, fontsize=7
    )
    ax.set_ylabel("sparsity")
    ev = report["evaluation"]
    ax.set_title(
        "per-layer sparsity; cosine to dense "
        + ", ".join(
            f"{stage} {src} {v['mean']:.3f}"
            for stage, per in ev.items()
            if stage != "dense"
            for src, v in per.items()
        ),
        fontsize=8,
    )
    fig.tight_layout()
    (out / "plots").mkdir(exist_ok=True)
    fig.savefig(out / "plots" / "layers.png", dpi=110)
    plt.close(fig)
    return "plots/layers.png"


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page (also the terminal summary)."""
    c = report["config"]
    t = report["text"]
    lines = [
        f"# prune_transformer: {c['pattern']} {c['sparsity']:.0%}, importance "
        f"{c['importance'] or 'per layer'}",
        "",
        f"Achieved sparsity {report['achieved_sparsity']:.4f} over {len(report['layers'])} layers. "
        f"Calibration: {t['calibration']}. Evaluation: "
        + "; ".join(f"{k}: {v}" for k, v in t["evaluation"].items())
        + ".",
        "",
        "| stage | source | cosine mean | p05 | min | retrieval |",
        "|---|---|---|---|---|---|",
    ]
    for stage, per in report["evaluation"].items():
        for src, v in per.items():
            lines.append(
                f"| {stage} | {src} | {v['mean']:.4f} | {v['p05']:.4f} | {v['min']:.4f} | "
                f"{v['retrieval']:.3f} |"
            )
    s = report["speed"]
    lines += [
        "",
        f"Speed, {s['sentences']} sentences in one batch: dense {s['dense_s']:.3f} s, condensed "
        f"{s['condensed_s']:.3f} s ({s['speedup']:.2f}x).",
    ]
    m = report["memory"]
    lines.append(
        f"Linear weights: dense {m['dense']['weight_bytes'] / 2**20:.1f} MiB, compressed "
        f"{m['compressed']['weight_bytes'] / 2**20:.1f} MiB (indices {m['compressed']['index_bytes'] / 2**20:.2f} MiB)."
    )
    if report["distillation"]:
        d = report["distillation"]
        lines.append(
            f"Distillation: {d['steps']} steps in {d['seconds']:.0f} s, loss {d['first_loss']:.2e} → {d['last_loss']:.2e}."
        )
    if report["saved_model"]:
        lines.append(
            f"Saved to `{report['saved_model']['path']}/`; reloaded equal: {report['saved_model']['reload_equal']}."
        )
    lines += [
        "",
        "| layer | K×N | sparsity | kept columns | tiles | mask | refit (damping) | held-out "
        "error (magnitude) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["layers"]:
        mask = refit = err = ""
        if "held_out_error" in r:
            share = "" if r["column_share"] is None else f", column share {r['column_share']:g}"
            mask = f"{r['importance']}{share}"
            refit = f"{'kept' if r['refit_accepted'] else 'rejected'} ({r['damping']:g})"
            err = f"{r['held_out_error']:.4f} ({r['held_out_magnitude_error']:.4f})"
        lines.append(
            f"| {r['fqn']} | {r['in_features']}×{r['out_features']} | {r['sparsity']:.3f} | "
            f"{r['kept_columns']} | {r['tiles']} | {mask} | {refit} | {err} |"
        )
    lines += ["", f"![layers]({report['plot']})", ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> PruneTransformerConfig:
    return parse_knobs(PruneTransformerConfig, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_recipe(main, parse_args()))
