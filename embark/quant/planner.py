"""The compression planner: each table's row format from measured sensitivity.

For every table ``t`` and candidate dtype ``d`` the planner quantizes ``t`` alone to ``d`` and
measures the AUC on held-out batches (the validation set: choices are made on it, never on the
data a figure is reported on). The AUC loss of ``(t, d)`` is ``max(0, base AUC - that AUC)``.
Then, like the sharding planner's greedy, one short loop: from every table in fp32, repeatedly
take the move (one table to a cheaper dtype) that costs the least AUC loss per byte saved,

- ``budget_bytes``: until the tables fit the budget;
- ``max_auc_loss``: while the summed losses of the chosen moves stay within it; the plan is
  then measured whole, and the last moves are undone while the measured loss exceeds it.

The result (:class:`CompressionPlan`) reports each table's dtype, bytes and measured AUC
change, and the AUC of all choices together; :meth:`CompressionPlan.config` is the
:class:`~embark.quant.EmbeddingQuantConfig` that applies it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from embark.data.batch import Batch
from embark.models.dlrm import DLRM
from embark.quant.config import EmbeddingQuantConfig
from embark.quant.quantize import table_bytes
from embark.quant.tables import QuantizedEmbeddingBag
from embark.training.config import EmbeddingKernel
from embark.training.metrics import auc
from embark.types import Combiner
from hps.rowformat import RowDtype, row_bytes

__all__ = [
    "DEFAULT_CANDIDATES",
    "CompressionPlan",
    "TableChoice",
    "evaluate_auc",
    "plan_compression",
]

#: Dtypes the planner tries, cheapest first (int2 loses ~0.01 AUC per table on tiny: opt-in).
DEFAULT_CANDIDATES: tuple[RowDtype, ...] = (RowDtype.INT4, RowDtype.INT8, RowDtype.FP16)


@dataclass(frozen=True)
class TableChoice:
    """One table's row in the plan.

    Attributes:
        auc_change: validation AUC with this table alone in ``dtype`` minus the fp32 AUC.
        sensitivity: ``{dtype: AUC change}`` of every candidate measured for this table.
    """

    table: str
    rows: int
    dim: int
    dtype: RowDtype
    bytes: int
    fp32_bytes: int
    auc_change: float
    sensitivity: dict[RowDtype, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "rows": self.rows,
            "dim": self.dim,
            "dtype": self.dtype.value,
            "bytes": self.bytes,
            "fp32_bytes": self.fp32_bytes,
            "auc_change": self.auc_change,
            "sensitivity": {d.value: v for d, v in self.sensitivity.items()},
        }


@dataclass(frozen=True)
class CompressionPlan:
    """Per-table dtypes and what they cost (validation figures)."""

    choices: tuple[TableChoice, ...]
    base_auc: float  # every table fp32
    planned_auc: float  # every table in its chosen dtype, measured together
    budget_bytes: int | None
    max_auc_loss: float | None

    @property
    def table_bytes(self) -> int:
        return sum(c.bytes for c in self.choices)

    @property
    def fp32_bytes(self) -> int:
        return sum(c.fp32_bytes for c in self.choices)

    def config(self, kernel: EmbeddingKernel = EmbeddingKernel.AUTO) -> EmbeddingQuantConfig:
        """The config that stores each table as planned."""
        return EmbeddingQuantConfig(RowDtype.FP32, {c.table: c.dtype for c in self.choices}, kernel)

    def to_dict(self) -> dict[str, Any]:
        return {
            "budget_bytes": self.budget_bytes,
            "max_auc_loss": self.max_auc_loss,
            "base_auc": self.base_auc,
            "planned_auc": self.planned_auc,
            "table_bytes": self.table_bytes,
            "fp32_bytes": self.fp32_bytes,
            "tables": [c.to_dict() for c in self.choices],
        }

    def markdown(self) -> str:
        """The plan as a markdown table, one row per table and a total."""
        lines = [
            "| table | rows × dim | dtype | bytes | fp32 bytes | AUC change alone (val) |",
            "|---|---|---|---:|---:|---:|",
        ]
        for c in self.choices:
            lines.append(
                f"| {c.table} | {c.rows} × {c.dim} | {c.dtype.value} | {c.bytes:,} | "
                f"{c.fp32_bytes:,} | {c.auc_change:+.5f} |"
            )
        lines.append(
            f"| **all** | | | {self.table_bytes:,} | {self.fp32_bytes:,} | "
            f"{self.planned_auc - self.base_auc:+.5f} (together) |"
        )
        return "\n".join(lines) + "\n"


@torch.no_grad()
def evaluate_auc(model: DLRM, batches: Iterable[Batch]) -> float:
    """AUC of ``model``'s logits on ``batches``, in eval mode (a quantized model has no float
    tables for a :class:`~embark.training.Trainer` to attach its update to; this needs none).

    Raises:
        ValueError: when ``batches`` is empty.
    """
    was_training = model.training
    model.eval()
    try:
        pairs = [(model(b.dense, b.sparse).float(), b.labels.float()) for b in batches]
    finally:
        model.train(was_training)
    if not pairs:
        raise ValueError("evaluate_auc: no batches")
    return auc(torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs]))


class _Evaluator:
    """AUC of ``model`` on fixed batches with some tables swapped for quantized ones; each
    batch's fp32 pooled vectors are computed once and only the swapped tables are looked up."""

    def __init__(self, model: DLRM, batches: Sequence[Batch]) -> None:
        self.model = model
        self.batches = list(batches)
        if not self.batches:
            raise ValueError("plan_compression: no validation batches")
        with torch.no_grad():
            self.pooled = [model.pool(b.sparse) for b in self.batches]
        self.labels = torch.cat([b.labels.float() for b in self.batches])

    @torch.no_grad()
    def auc(self, swaps: dict[str, QuantizedEmbeddingBag]) -> float:
        index = {n: i for i, n in enumerate(self.model.table_names)}
        logits = []
        for b, pooled in zip(self.batches, self.pooled):
            vectors = list(pooled)
            for name, table in swaps.items():
                ids = b.sparse.values_for(name)
                vectors[index[name]] = table(ids, b.sparse.bag_offsets(name))
            logits.append(self.model.dense_forward(b.dense, vectors).float())
        return auc(torch.cat(logits), self.labels)


def _quantized(
    model: DLRM, name: str, dtype: RowDtype, kernel: EmbeddingKernel
) -> QuantizedEmbeddingBag:
    bag = model.embeddings[name]
    if not isinstance(bag, nn.EmbeddingBag):
        raise ValueError(f"table {name!r} is a {type(bag).__name__}, not a float nn.EmbeddingBag")
    combiner = Combiner.MEAN if bag.mode == "mean" else Combiner.SUM
    return QuantizedEmbeddingBag.from_float(name, bag.weight, dtype, combiner, kernel)


def _holds(dtype: RowDtype, dim: int) -> bool:
    return not dtype.quantized or dim % (8 // dtype.bits) == 0


@dataclass
class _Move:
    table: str
    dtype: RowDtype
    saved: int
    extra_loss: float


def _moves(
    current: dict[str, RowDtype],
    sizes: dict[str, dict[RowDtype, int]],
    loss: dict[str, dict[RowDtype, float]],
    excluded: set[tuple[str, RowDtype]],
) -> list[_Move]:
    """Every move of one table to a cheaper dtype, least AUC loss per byte saved first."""
    moves = []
    for name, dtype in current.items():
        for cand, nbytes in sizes[name].items():
            saved = sizes[name][dtype] - nbytes
            if saved > 0 and (name, cand) not in excluded:
                extra = loss[name][cand] - loss[name][dtype]
                moves.append(_Move(name, cand, saved, extra))
    moves.sort(key=lambda m: (m.extra_loss / m.saved, -m.saved, m.table))
    return moves


def plan_compression(
    model: DLRM,
    batches: Iterable[Batch],
    *,
    budget_bytes: int | None = None,
    max_auc_loss: float | None = None,
    candidates: Sequence[RowDtype] = DEFAULT_CANDIDATES,
    kernel: EmbeddingKernel = EmbeddingKernel.AUTO,
) -> CompressionPlan:
    """Choose each fp32 table's dtype for ``model`` (left unchanged) from its measured
    sensitivity on ``batches`` (held-out validation batches).

    Args:
        budget_bytes: the tables' total stored bytes must fit this; or
        max_auc_loss: the validation AUC may drop at most this much (exactly one of the two).
        candidates: dtypes to try besides fp32 (a table whose width a dtype cannot pack skips
            it).

    Raises:
        ValueError: for both or neither target, a negative target, a model with a table
            already quantized, or a budget below the smallest plan (every table in the
            cheapest candidate), naming both byte counts.
    """
    if (budget_bytes is None) == (max_auc_loss is None):
        raise ValueError("plan_compression: give exactly one of budget_bytes and max_auc_loss")
    if (budget_bytes is not None and budget_bytes < 0) or (
        max_auc_loss is not None and max_auc_loss < 0
    ):
        raise ValueError(
            f"plan_compression: targets must be >= 0, got budget_bytes={budget_bytes}, "
            f"max_auc_loss={max_auc_loss}"
        )
    quantized = [
        n for n in model.table_names if isinstance(model.embeddings[n], QuantizedEmbeddingBag)
    ]
    if quantized:
        raise ValueError(f"plan_compression: tables {quantized} are already quantized")
    kinds = [RowDtype(c) for c in candidates]
    was_training = model.training
    model.eval()
    try:
        return _plan(model, list(batches), budget_bytes, max_auc_loss, kinds, kernel)
    finally:
        model.train(was_training)


def _plan(
    model: DLRM,
    batches: list[Batch],
    budget_bytes: int | None,
    max_auc_loss: float | None,
    candidates: list[RowDtype],
    kernel: EmbeddingKernel,
) -> CompressionPlan:
    evaluator = _Evaluator(model, batches)
    base = evaluator.auc({})
    fp32 = table_bytes(model)
    shapes = {n: (int(w.shape[0]), int(w.shape[1])) for n, w in model.embedding_tables().items()}
    sizes, change = _sensitivity(evaluator, model, shapes, fp32, candidates, kernel, base)
    loss = {n: {d: max(0.0, -c) for d, c in per.items()} for n, per in change.items()}
    current = dict.fromkeys(model.table_names, RowDtype.FP32)
    built: dict[tuple[str, RowDtype], QuantizedEmbeddingBag] = {}
    if budget_bytes is not None:
        _fit_budget(current, sizes, loss, budget_bytes)
    else:
        assert max_auc_loss is not None
        applied = _within_loss(current, sizes, loss, max_auc_loss)
        while applied and base - _measure(evaluator, model, current, kernel, built) > max_auc_loss:
            table, previous = applied.pop()  # the losses did not add up: undo the last move
            current[table] = previous
    planned = _measure(evaluator, model, current, kernel, built)
    choices = tuple(
        TableChoice(
            table=n,
            rows=shapes[n][0],
            dim=shapes[n][1],
            dtype=d,
            bytes=sizes[n][d],
            fp32_bytes=fp32[n],
            auc_change=change[n][d],
            sensitivity={k: v for k, v in change[n].items() if k is not RowDtype.FP32},
        )
        for n, d in current.items()
    )
    return CompressionPlan(choices, base, planned, budget_bytes, max_auc_loss)


def _sensitivity(
    evaluator: _Evaluator,
    model: DLRM,
    shapes: dict[str, tuple[int, int]],
    fp32: dict[str, int],
    candidates: list[RowDtype],
    kernel: EmbeddingKernel,
    base: float,
) -> tuple[dict[str, dict[RowDtype, int]], dict[str, dict[RowDtype, float]]]:
    """``({table: {dtype: bytes}}, {table: {dtype: AUC change alone}})``, fp32 included."""
    sizes: dict[str, dict[RowDtype, int]] = {}
    change: dict[str, dict[RowDtype, float]] = {}
    for name in model.table_names:
        rows, dim = shapes[name]
        sizes[name] = {RowDtype.FP32: fp32[name]}
        change[name] = {RowDtype.FP32: 0.0}
        for dtype in candidates:
            if _holds(dtype, dim) and dtype is not RowDtype.FP32:
                sizes[name][dtype] = rows * row_bytes(dtype, dim)
                table = _quantized(model, name, dtype, kernel)
                change[name][dtype] = evaluator.auc({name: table}) - base
    return sizes, change


def _fit_budget(
    current: dict[str, RowDtype],
    sizes: dict[str, dict[RowDtype, int]],
    loss: dict[str, dict[RowDtype, float]],
    budget_bytes: int,
) -> None:
    """Take the cheapest moves (AUC loss per byte saved) until the tables fit the budget."""
    smallest = sum(min(s.values()) for s in sizes.values())
    if smallest > budget_bytes:
        raise ValueError(
            f"plan_compression: the tables need at least {smallest} bytes (each in its "
            f"cheapest candidate), above the budget of {budget_bytes} bytes"
        )
    while sum(sizes[n][d] for n, d in current.items()) > budget_bytes:
        move = _moves(current, sizes, loss, set())[0]
        current[move.table] = move.dtype


def _within_loss(
    current: dict[str, RowDtype],
    sizes: dict[str, dict[RowDtype, int]],
    loss: dict[str, dict[RowDtype, float]],
    max_auc_loss: float,
) -> list[tuple[str, RowDtype]]:
    """Take the cheapest moves while their summed losses stay within ``max_auc_loss``;
    returns ``[(table, dtype before the move)]`` in the order taken."""
    applied: list[tuple[str, RowDtype]] = []
    spent, excluded = 0.0, set[tuple[str, RowDtype]]()
    while moves := _moves(current, sizes, loss, excluded):
        move = moves[0]
        if spent + move.extra_loss <= max_auc_loss:
            applied.append((move.table, current[move.table]))
            current[move.table] = move.dtype
            spent += move.extra_loss
        excluded.add((move.table, move.dtype))
    return applied


def _measure(
    evaluator: _Evaluator,
    model: DLRM,
    current: dict[str, RowDtype],
    kernel: EmbeddingKernel,
    built: dict[tuple[str, RowDtype], QuantizedEmbeddingBag],
) -> float:
    """Validation AUC with every table in its ``current`` dtype; quantized tables are kept in
    ``built`` for the next measurement (the plans measured differ in a move or two)."""
    swaps = {}
    for name, dtype in current.items():
        if dtype is not RowDtype.FP32:
            if (name, dtype) not in built:
                built[(name, dtype)] = _quantized(model, name, dtype, kernel)
            swaps[name] = built[(name, dtype)]
    return evaluator.auc(swaps)
