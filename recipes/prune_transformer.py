"""Prune a pretrained sentence-transformers model with calibration, optionally distil it on
unlabelled text, and report how close it stays to the dense model and how fast it runs.

``python -m recipes.prune_transformer`` (default: the packaged all-MiniLM-L6-v2, its 12 FFN
linears, TW 50 % with activation importance and reconstruction on 128 sentences) writes
``report.json``, ``report.md``, ``plots/layers.png`` and the compressed model (``model/``,
reloadable with ``SentenceTransformer(path)`` + ``tilesparse.load_compressed``) into
``--out``. The text is generated (:mod:`recipes.sentences`): calibration, distillation and
held-out sentences are disjoint. Cosine is measured on the held-out sentences.
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
from recipes.minilm import load_minilm
from recipes.sentences import splits

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
    tile: int = knob(128, "TW tile width G", ge=1)
    importance: Literal["activation", "magnitude"] = knob("activation", "importance score")
    # 0: per-tile rows only. Pruning whole output columns of the FFN's second linear zeroes
    # hidden dimensions of the residual stream, which no reconstruction can bring back.
    column_share: float = knob(0.0, "share of the TW budget taken by whole columns", ge=0, le=1)
    # per-layer sparsity, as SparseGPT and Wanda prune
    global_threshold: bool = knob(False, "one threshold across layers instead of per layer")
    calibration_sentences: int = knob(128, "sentences the calibration runs", ge=1)
    held_out: int = knob(256, "held-out sentences for the cosine to dense", ge=1)
    distill_seconds: float = knob(0.0, "distillation budget in seconds (0: none)", ge=0)
    distill_sentences: int = knob(2048, "unlabelled sentences to distil on", ge=1)
    distill_batch: int = knob(32, "sentences per distillation step", ge=1)
    distill_lr: float = knob(1e-4, "AdamW learning rate of the distillation", gt=0)
    speed_sentences: int = knob(256, "sentences per timed encode, dense vs condensed", ge=1)
    speed_repeats: int = knob(3, "timed encodes of each model (interleaved; median)", ge=1)
    # 1: on the shared 2-core machine 2 threads ran the distillation at 5 steps in 300 s,
    # 1 thread at 87 (thread contention), as prune_dlrm's training measured
    threads: int = knob(1, "torch threads", ge=1, le=256)
    seed: int = knob(0, "seed of the generated sentences and the distillation", ge=0)
    save_model: bool = knob(True, "save the compressed model and check it reloads equal")
    out: str | None = knob(None, "output folder; none = runs/prune_transformer-<UTC timestamp>")
    overwrite: bool = knob(False, "clear a non-empty --out that holds an earlier run")
    progress: bool = knob(True, "tqdm progress bars")

    def __post_init__(self) -> None:
        check_knobs(self)

    @property
    def folder(self) -> OutFolder:
        return OutFolder("prune_transformer", self.out, self.overwrite, outputs=OUTPUTS)

    def prune_config(self) -> tilesparse.TileSparseConfig:
        return tilesparse.TileSparseConfig(
            pattern=tilesparse.Pattern(self.pattern),
            sparsity=None if self.pattern == "nm" else self.sparsity,
            tile=self.tile,
            importance=tilesparse.Importance(self.importance),
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


def _layer_rows(pruner: tilesparse.TileSparsePruner) -> list[dict[str, Any]]:
    rec = {r.fqn: r for r in pruner.reconstructions}
    rows = []
    for st in pruner.stats():
        row = st.to_dict()
        if st.fqn in rec:
            row["masked_error"] = rec[st.fqn].masked_error
            row["reconstructed_error"] = rec[st.fqn].reconstructed_error
        rows.append(row)
    return rows


def main(cfg: PruneTransformerConfig) -> dict[str, Any]:
    """Run the recipe; returns the report (also written to ``cfg.out``)."""
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t_start = time.perf_counter()
    cfg.folder.check()
    pcfg = cfg.prune_config()
    out = cfg.folder.open()
    calib, distil, held = splits(
        cfg.calibration_sentences,
        cfg.distill_sentences,
        max(cfg.held_out, cfg.speed_sentences),
        cfg.seed,
    )
    teacher = load_minilm(cfg.model)
    student = copy.deepcopy(teacher)
    dense_emb = _encode(teacher, held[: cfg.held_out])
    filter_fn = is_ffn if cfg.layers == "ffn" else is_encoder_linear
    t0 = time.perf_counter()
    pruner = tilesparse.prune_(
        student, pcfg, filter_fn, calibration=_Encoder(calib), progress=cfg.progress
    )
    seconds: dict[str, float] = {"calibrate": time.perf_counter() - t0}
    results = {"oneshot": cosine(_encode(student, held[: cfg.held_out]), dense_emb)}
    print(
        f"one-shot with calibration: cosine to dense {results['oneshot']['mean']:.4f}", flush=True
    )
    distill_report = None
    if cfg.distill_seconds > 0:
        distill_report = _distill(cfg, student, teacher, pruner, distil)
        seconds["distill"] = distill_report["seconds"]
        results["distilled"] = cosine(_encode(student, held[: cfg.held_out]), dense_emb)
        print(
            f"distilled ({distill_report['steps']} steps, {distill_report['seconds']:.0f} s): "
            f"cosine {results['distilled']['mean']:.4f}",
            flush=True,
        )
    layers = _layer_rows(pruner)
    sparsity = pruner.overall_sparsity()
    pruner.compress()
    compressed_emb = _encode(student, held[: cfg.held_out])
    results["compressed"] = cosine(compressed_emb, dense_emb)
    speed = _speed(teacher, student, cfg, held[: cfg.speed_sentences])
    memory = {
        "dense": tilesparse.model_memory(teacher).to_dict(),
        "compressed": tilesparse.model_memory(student).to_dict(),
    }
    saved = _save_and_reload(student, out / "model", held[:16]) if cfg.save_model else None
    report: dict[str, Any] = {
        "recipe": "prune_transformer",
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "knobs": asdict(cfg),
        "config": pcfg.to_dict(),
        "text": "generated sentences (recipes.sentences): templates x vocabularies, seeded; "
        "calibration, distillation and held-out sets disjoint",
        "achieved_sparsity": sparsity,
        "cosine_to_dense": results,
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
    cos = report["cosine_to_dense"]
    ax.set_title(
        "per-layer sparsity; cosine to dense "
        + ", ".join(f"{k} {v['mean']:.3f}" for k, v in cos.items()),
        fontsize=9,
    )
    fig.tight_layout()
    (out / "plots").mkdir(exist_ok=True)
    fig.savefig(out / "plots" / "layers.png", dpi=110)
    plt.close(fig)
    return "plots/layers.png"


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown page (also the terminal summary)."""
    c = report["config"]
    lines = [
        f"# prune_transformer: {c['pattern']} {c['sparsity']:.0%}, importance {c['importance']}",
        "",
        f"Achieved sparsity {report['achieved_sparsity']:.4f} over {len(report['layers'])} layers. "
        f"Text: {report['text']}.",
        "",
        "| stage | cosine mean | p05 | min |",
        "|---|---|---|---|",
    ]
    for k, v in report["cosine_to_dense"].items():
        lines.append(f"| {k} | {v['mean']:.4f} | {v['p05']:.4f} | {v['min']:.4f} |")
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
        "| layer | K×N | sparsity | kept columns | tiles | output error masked → reconstructed |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["layers"]:
        err = (
            f"{r['masked_error']:.4f} → {r['reconstructed_error']:.4f}"
            if "masked_error" in r
            else ""
        )
        lines.append(
            f"| {r['fqn']} | {r['in_features']}×{r['out_features']} | {r['sparsity']:.3f} | {r['kept_columns']} | {r['tiles']} | {err} |"
        )
    lines += ["", f"![layers]({report['plot']})", ""]
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> PruneTransformerConfig:
    return parse_knobs(PruneTransformerConfig, argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_recipe(main, parse_args()))
