"""The DLRM story's compressed-tables half (``recipes.prune_dlrm``, ``--quant-budget``): the
dense baseline and the main pruned run with their tables stored as int8, int4, and as the
compression planner chooses for a byte budget — the whole model's bytes (tables + dense part)
and the AUC of each.

Choices are made on validation batches (eval batches after the test ones); every AUC in the
report is measured on the recipe's eval batches (the test set every other figure uses).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import Any

from embark import (
    DLRM,
    Batch,
    EmbeddingQuantConfig,
    RowDtype,
    evaluate_auc,
    model_size,
    plan_compression,
    quantize_embeddings_,
)

__all__ = ["quant_report", "quant_section", "quant_summary"]


def _variant(
    model: DLRM, config: EmbeddingQuantConfig | None, test: Sequence[Batch]
) -> dict[str, Any]:
    """Bytes and test AUC of ``model`` with its tables stored per ``config`` (None: as is)."""
    quantized = model if config is None else quantize_embeddings_(copy.deepcopy(model), config)
    return {"size": model_size(quantized).to_dict(), "auc": evaluate_auc(quantized, test)}


def quant_report(
    dense: DLRM,
    pruned: DLRM,
    pruned_label: str,
    test: Sequence[Batch],
    validation: Sequence[Batch],
    budget_fraction: float,
) -> dict[str, Any]:
    """``report["quantized"]``: every variant's ``{"size": {"tables", "dense", "total"},
    "auc"}`` (test AUC), the AUC change of each table dtype against the same model with fp32
    tables, and the planner's plan for ``budget_fraction`` of the fp32 tables' bytes.

    Args:
        dense: the dense baseline; pruned: the main run's compressed model (both unchanged).
        pruned_label: e.g. ``"tw 75%"``.
    """
    t0 = time.perf_counter()
    fp32_tables = model_size(dense).tables
    budget = int(budget_fraction * fp32_tables)
    plan = plan_compression(pruned, validation, budget_bytes=budget)
    variants = {
        "dense": _variant(dense, None, test),
        "dense + int8": _variant(dense, EmbeddingQuantConfig(RowDtype.INT8), test),
        pruned_label: _variant(pruned, None, test),
        f"{pruned_label} + int8": _variant(pruned, EmbeddingQuantConfig(RowDtype.INT8), test),
        f"{pruned_label} + int4": _variant(pruned, EmbeddingQuantConfig(RowDtype.INT4), test),
        f"{pruned_label} + plan": _variant(pruned, plan.config(), test),
    }
    base = {"dense": variants["dense"]["auc"], pruned_label: variants[pruned_label]["auc"]}
    for name, v in variants.items():
        of = "dense" if name.startswith("dense") else pruned_label
        v["auc_change"] = v["auc"] - base[of]
        v["compression"] = variants["dense"]["size"]["total"] / v["size"]["total"]
    return {
        "pruned": pruned_label,
        "budget_fraction": budget_fraction,
        "budget_bytes": budget,
        "variants": variants,
        "plan": plan.to_dict(),
        "plan_markdown": plan.markdown(),
        "seconds": time.perf_counter() - t0,
    }


def quant_section(q: dict[str, Any]) -> str:
    """A markdown section of ``report["quantized"]``."""
    lines = [
        "## Compressed tables",
        "",
        "Whole model (tables + dense part) and test AUC; the AUC change is against the same "
        "model with fp32 tables.",
        "",
        "| model | tables (bytes) | dense (bytes) | total (bytes) | vs dense | AUC | AUC change |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, v in q["variants"].items():
        s = v["size"]
        lines.append(
            f"| {name} | {s['tables']:,} | {s['dense']:,} | {s['total']:,} | "
            f"{v['compression']:.2f}x | {v['auc']:.5f} | {v['auc_change']:+.5f} |"
        )
    lines += [
        "",
        f"Planner ({q['pruned']}, tables within {q['budget_fraction']:.0%} of their fp32 bytes "
        f"= {q['budget_bytes']:,} bytes; sensitivity on validation batches):",
        "",
        q["plan_markdown"],
    ]
    return "\n".join(lines)


def quant_summary(q: dict[str, Any]) -> str:
    """Terminal lines: each variant's total bytes and test AUC."""
    rows = ["compressed tables (whole model bytes, test AUC, change vs fp32 tables):"]
    for name, v in q["variants"].items():
        rows.append(
            f"  {name:<16} {v['size']['total']:>12,} B ({v['compression']:.2f}x)  "
            f"AUC {v['auc']:.5f} ({v['auc_change']:+.5f})"
        )
    return "\n".join(rows)
