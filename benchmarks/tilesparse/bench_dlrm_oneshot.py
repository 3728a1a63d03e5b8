"""One-shot TW 75 % of a trained DLRM-DCNv2 with calibration and no fine-tuning, on two
synthetic workloads of different layer widths: AUC drop against the dense model.

    python -m benchmarks.tilesparse.bench_dlrm_oneshot            # ~minutes on 2 cores

Per workload (``tiny``, and ``wide``: tiny's tables at dim 32 with a 13-128-64-32 bottom MLP,
three cross layers of rank 48 and a 256-128-64-1 top MLP): the dense model trains
``--dense-steps`` steps; every linear is then pruned one-shot to 75 % TW with
``tilesparse.prune_`` — ``uncalibrated`` (the default config: magnitude, one global threshold,
automatic tile), ``calibrated_defaults`` (the default config plus ``calibration=`` batches of
the generator's calibration stream) and ``calibrated`` (what ``recipes.prune_dlrm``'s one-shot
runs: magnitude masks under the global threshold, column share 0.5, each layer's refit and
damping chosen on held-out calibration batches) for each candidate tile width (automatic, 8).
The ``calibrated`` candidate is chosen on
*validation* batches (training-stream batches the dense model never saw) and every AUC is
reported on *test* batches (the generator's eval stream). JSON to ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import time
from dataclasses import replace
from typing import Any

import torch

import tilesparse
from benchmarks.meta import RESULTS_DIR, write_json
from embark.data import SyntheticCTR
from embark.models import build_model
from embark.models.workloads import Interaction, get_workload
from embark.training.trainer import TrainConfig, Trainer
from tilesparse.config import Importance, Pattern


def _wide() -> Any:
    tiny = get_workload("tiny")
    return replace(
        tiny,
        name="wide",
        tables=tuple(replace(t, dim=32) for t in tiny.tables),
        bottom_mlp=(128, 64, 32),
        top_mlp=(256, 128, 64, 1),
        interaction=Interaction(type="dcnv2", num_layers=3, low_rank=48),
        source="tiny's tables at dim 32, wider MLPs, three cross layers (synthetic)",
    )


def _auc(model: torch.nn.Module, cfg: TrainConfig, batches: list[Any]) -> float:
    return float(Trainer(model, cfg).evaluate(batches)["auc"])


def run_workload(workload: Any, args: argparse.Namespace) -> dict[str, Any]:
    data = SyntheticCTR(workload, batch_size=args.batch_size, seed=args.seed)
    train_cfg = TrainConfig(lr=0.05, seed=args.seed)
    dense = build_model(workload, seed=args.seed)
    trainer = Trainer(dense, replace(train_cfg, warmup_steps=100))
    t0 = time.perf_counter()
    trainer.fit(data.batches(args.dense_steps), args.dense_steps, progress=False)
    train_s = time.perf_counter() - t0
    val = list(data.batches(args.val_batches, start=args.dense_steps))
    test = list(data.batches(args.test_batches, split="eval"))
    calib = [
        (b.dense, b.sparse) for b in data.batches(args.calibration_batches, split="calibration")
    ]
    dense_val, dense_test = _auc(dense, train_cfg, val), _auc(dense, train_cfg, test)
    rows = []
    modes: list[tuple[str, int | None]] = [("uncalibrated", None), ("calibrated_defaults", None)]
    modes += [("calibrated", t) for t in (None, 8)]
    for mode, tile in modes:
        model = copy.deepcopy(dense)
        cfg = tilesparse.TileSparseConfig(pattern=Pattern.TW, sparsity=0.75, tile=tile)
        if mode == "calibrated":  # recipes.prune_oneshot's: magnitude masks, refit chosen
            cfg = replace(cfg, importance=Importance.MAGNITUDE, column_share=0.5)
        t0 = time.perf_counter()
        pruner = tilesparse.prune_(
            model, cfg, calibration=None if mode == "uncalibrated" else calib
        )
        row: dict[str, Any] = {
            "mode": mode,
            "tile": pruner.config.tile,
            "tile_knob": tile,
            "prune_seconds": time.perf_counter() - t0,
            "achieved_sparsity": pruner.overall_sparsity(),
            "val_auc": _auc(model, train_cfg, val),
            "test_auc": _auc(model, train_cfg, test),
            "layers": [
                {
                    "fqn": s.fqn,
                    "shape": [s.in_features, s.out_features],
                    "sparsity": s.sparsity,
                    "tiles": s.tiles,
                }
                for s in pruner.stats()
            ],
            "choices": [
                {
                    "fqn": r.fqn,
                    "importance": None if r.importance is None else r.importance.value,
                    "column_share": r.column_share,
                    "refit": r.accepted,
                    "damping": r.damping,
                    "held_out_error": r.held_out_error,
                    "held_out_magnitude_error": r.held_out_magnitude_error,
                }
                for r in pruner.reconstructions
            ],
        }
        row["test_auc_drop"] = dense_test - row["test_auc"]
        rows.append(row)
        print(
            f"{workload.name:5s} {mode:19s} tile {row['tile']:3d}: val {row['val_auc']:.4f} "
            f"test {row['test_auc']:.4f} (drop {row['test_auc_drop']:+.4f})",
            flush=True,
        )
    cal = [r for r in rows if r["mode"] == "calibrated"]
    chosen = max(cal, key=lambda r: r["val_auc"])
    return {
        "workload": workload.to_dict(),
        "dense_steps": args.dense_steps,
        "train_seconds": train_s,
        "dense_val_auc": dense_val,
        "dense_test_auc": dense_test,
        "rows": rows,
        "chosen_on_validation": {"tile": chosen["tile"], "test_auc_drop": chosen["test_auc_drop"]},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="tiny,wide")
    ap.add_argument("--dense-steps", type=int, default=2000)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--val-batches", type=int, default=20)
    ap.add_argument("--test-batches", type=int, default=40)
    ap.add_argument("--calibration-batches", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS_DIR / "tilesparse_dlrm_oneshot.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    builders = {"tiny": lambda: get_workload("tiny"), "wide": _wide}
    results = [run_workload(builders[w](), args) for w in args.workloads.split(",")]
    for r in results:
        c = r["chosen_on_validation"]
        print(
            f"{r['workload']['name']}: dense test AUC {r['dense_test_auc']:.4f}; chosen on "
            f"validation: tile {c['tile']}, test AUC drop {c['test_auc_drop']:+.4f}"
        )
    write_json(args.out, results, knobs=vars(args))


if __name__ == "__main__":
    main()
