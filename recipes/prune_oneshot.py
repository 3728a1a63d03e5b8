"""The DLRM story's one-shot half (``recipes.prune_dlrm --calibration-batches N``): each
pruning config is also applied once to the trained dense model, with no schedule —

- ``magnitude``: the magnitude mask alone, no fine-tuning;
- ``calibrated``: ``tilesparse.prune_(..., calibration=...)`` on N training batches: the
  magnitude masks, each layer's least-squares refit kept where it lowers the error on
  held-out calibration batches, no fine-tuning;
- ``calibrated_finetuned``: the same, then the recipe's fine-tuning budget with the mask held
  (the dense trainer's Adagrad state carried over, as every run of the recipe).

AUC drops are against the recipe's dense baseline (fine-tuned for the same budget).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import nn
from tqdm.auto import tqdm

import tilesparse
from embark import Batch, Callback, TrainConfig, Trainer
from tilesparse import Importance, OneShotSchedule, PruningCallback, TileSparseConfig

__all__ = ["oneshot_rows", "oneshot_section"]


class _Hooks(PruningCallback, Callback):
    """The pruner's duck-typed callback, typed as the trainer's Callback."""


def _auc(model: nn.Module, train_cfg: TrainConfig, eval_batches: Sequence[Batch]) -> float:
    return float(Trainer(model, train_cfg).evaluate(eval_batches)["auc"])


def _calibrated(
    model: nn.Module, pcfg: TileSparseConfig, calib: list[tuple[Any, ...]]
) -> tilesparse.TileSparsePruner:
    """``prune_`` with calibration: the run's pattern, sparsity, tile and block; magnitude
    masks under the global threshold (TW: the paper's column split), each layer's refit and
    its damping chosen on held-out calibration batches. On DLRM-DCNv2 these fixed masks
    held the AUC better than masks chosen per layer by their own output error
    (docs/benchmarks.md)."""
    cfg = replace(
        pcfg,
        schedule=OneShotSchedule(),
        importance=Importance.MAGNITUDE,
        column_share=pcfg.share,
        damping=None,
    )
    return tilesparse.prune_(model, cfg, calibration=calib)


def oneshot_rows(
    dense: nn.Module,
    configs: Sequence[TileSparseConfig],
    train_cfg: TrainConfig,
    optimizer_state: dict[str, Any],
    ft_batches: Sequence[Batch],
    eval_batches: Sequence[Batch],
    calibration_batches: int,
    dense_auc: float,
    progress: bool,
) -> list[dict[str, Any]]:
    """One row per config: the three one-shot variants' AUC and drop (module docstring).

    The calibration runs the first ``calibration_batches`` fine-tuning batches (training
    data, never the eval batches)."""
    calib = [(b.dense, b.sparse) for b in ft_batches[:calibration_batches]]
    rows = []
    for pcfg in configs:
        mag = copy.deepcopy(dense)
        tilesparse.prune_(
            mag, replace(pcfg, schedule=OneShotSchedule(), importance=Importance.MAGNITUDE)
        )
        cal = copy.deepcopy(dense)
        pruner = _calibrated(cal, pcfg, calib)
        ft = copy.deepcopy(dense)
        trainer = Trainer(ft, train_cfg)
        trainer.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        ft_pruner = _calibrated(ft, pcfg, calib)
        trainer.rebuild_optimizer()  # keeps the state: the weights moved under parametrizations
        trainer.add_callback(_Hooks(ft_pruner))
        label = f"fine-tune calibrated {pcfg.pattern.value} {pcfg.target_sparsity:.0%}"
        for b in tqdm(ft_batches, disable=not progress, desc=label, unit="step", leave=False):
            trainer.train_step(b)
        aucs = {
            "magnitude": _auc(mag, train_cfg, eval_batches),
            "calibrated": _auc(cal, train_cfg, eval_batches),
            "calibrated_finetuned": float(trainer.evaluate(eval_batches)["auc"]),
        }
        rows.append(
            {
                "pattern": pcfg.pattern.value,
                "sparsity": pcfg.target_sparsity,
                "calibration_batches": len(calib),
                "achieved_sparsity": pruner.overall_sparsity(),
                "auc": aucs,
                "auc_drop": {k: dense_auc - v for k, v in aucs.items()},
                "reconstruction": [
                    {
                        "fqn": r.fqn,
                        "masked": r.masked_error,
                        "reconstructed": r.reconstructed_error,
                        "refit_accepted": r.accepted,
                        "held_out_error": r.held_out_error,
                        "held_out_magnitude_error": r.held_out_magnitude_error,
                    }
                    for r in pruner.reconstructions
                ],
            }
        )
    return rows


def oneshot_section(rows: list[dict[str, Any]]) -> str:
    """The Markdown section of the report."""
    lines = [
        "## One-shot with calibration",
        "",
        "AUC drop vs the dense baseline; one-shot masks, no schedule "
        f"({rows[0]['calibration_batches']} calibration batches).",
        "",
        "| pattern | sparsity | magnitude | calibrated | calibrated + fine-tuning |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        d = r["auc_drop"]
        lines.append(
            f"| {r['pattern']} | {r['sparsity']:.0%} | {d['magnitude']:+.4f} | "
            f"{d['calibrated']:+.4f} | {d['calibrated_finetuned']:+.4f} |"
        )
    return "\n".join(lines) + "\n"
