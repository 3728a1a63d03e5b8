"""Training hyper-parameters (:class:`TrainConfig`) and the optimizer they build."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from enum import StrEnum
from typing import Any

import torch
from torch import nn

from hps.rowformat import RowDtype


class OptimizerKind(StrEnum):
    """Optimizers the trainer builds (one for embeddings and dense part, two param groups)."""

    ADAGRAD = "adagrad"
    SGD = "sgd"


class EmbeddingOptimizerKind(StrEnum):
    """The update the fused sparse path applies to the looked-up rows of a table.

    ``adagrad``: exact Adagrad (one squared-gradient sum per weight, as ``torch.optim.Adagrad``
    and MLPerf DLRM); ``rowwise_adagrad``: one sum per row (the mean of the row's squared
    gradient; TorchRec's default, ``1/dim`` of the state memory); ``sgd``: plain SGD (no
    momentum: momentum would move rows the batch did not touch).
    """

    ADAGRAD = "adagrad"
    ROWWISE_ADAGRAD = "rowwise_adagrad"
    SGD = "sgd"


class EmbeddingKernel(StrEnum):
    """Which kernel runs the fused embedding lookup and update.

    ``auto``: FBGEMM's table-batched kernel when ``fbgemm_gpu`` imports, else the reference
    path (with one logged warning); ``fbgemm``: FBGEMM or an error; ``reference``: pure torch
    (sparse row gradients and an index-based update).
    """

    AUTO = "auto"
    FBGEMM = "fbgemm"
    REFERENCE = "reference"


class TableRounding(StrEnum):
    """How an FP16/BF16 table's updated rows are rounded back to their storage dtype (the row
    update itself is computed in float32).

    ``stochastic``: up or down to one of the two nearest representable values, with the
    probability that makes the expected value the float32 result (unbiased: small updates
    are not lost on average; FBGEMM's default, which its CUDA kernels apply — its CPU kernel
    rounds to nearest whatever its ``stochastic_rounding`` flag says, so these tables train
    on our compiled fused backward, :mod:`embark.training.half_kernel`, or the reference
    path); ``nearest``: round to nearest even (what FBGEMM's CPU kernel
    does, and what it runs).
    """

    STOCHASTIC = "stochastic"
    NEAREST = "nearest"


#: the storage dtypes a trained table can have (TrainConfig.table_dtype)
TRAINABLE_TABLE_DTYPES = (RowDtype.FP32, RowDtype.FP16, RowDtype.BF16)

#: the optimizer groups the trainer names itself (:func:`build_optimizer`)
RESERVED_GROUPS = ("embeddings", "dense")


@dataclass(frozen=True)
class ParamGroup:
    """Parameters with a learning rate of their own (fine-tuning: a small one for pretrained
    layers, a large one for a new head).

    Args:
        name: the optimizer group's name (not ``"embeddings"`` or ``"dense"``).
        patterns: ``fnmatch`` patterns over ``model.named_parameters()`` names, e.g.
            ``("top_mlp.*",)``; a fused embedding table matches by its weight's name
            (``"embeddings.t0.weight"``) and steps its rows with this ``lr``.
        lr: the group's learning rate (> 0; the warm-up scales it like the others).

    Raises:
        ValueError: naming the field, for a reserved or empty name, no pattern, or an
            ``lr`` that is not a finite number > 0.
    """

    name: str
    patterns: tuple[str, ...]
    lr: float

    def __post_init__(self) -> None:
        if not self.name or self.name in RESERVED_GROUPS:
            raise ValueError(
                f"ParamGroup.name must be non-empty and not one of {RESERVED_GROUPS}, "
                f"got {self.name!r}"
            )
        object.__setattr__(self, "patterns", tuple(self.patterns))
        if not self.patterns or not all(isinstance(p, str) and p for p in self.patterns):
            raise ValueError(
                f"ParamGroup {self.name!r}: patterns must be non-empty strings, got "
                f"{self.patterns!r}"
            )
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(
                f"ParamGroup {self.name!r}: lr must be a finite number > 0, got {self.lr!r}"
            )

    def matches(self, param_name: str) -> bool:
        """Whether ``param_name`` matches one of :attr:`patterns`."""
        return any(fnmatch.fnmatchcase(param_name, p) for p in self.patterns)


@dataclass(frozen=True)
class TrainConfig:
    """Training hyper-parameters.

    Args:
        lr: learning rate of the dense part (and of the embeddings unless ``embedding_lr``).
        embedding_lr: learning rate of the embedding tables; ``None`` = ``lr``.
        optimizer: ``adagrad`` or ``sgd``.
        momentum: SGD momentum of the dense part (ignored by Adagrad; embedding rows step
            without momentum, :class:`EmbeddingOptimizerKind`).
        adagrad_eps: Adagrad's denominator epsilon.
        initial_accumulator_value: Adagrad's starting squared-gradient sum.
        eval_every: evaluate every this many steps during :meth:`Trainer.fit` when eval
            batches are given; 0 = never during fit.
        checkpoint_every: save a checkpoint to ``checkpoint_dir`` every this many steps; 0 = never.
        checkpoint_dir: folder for periodic checkpoints (replaced atomically each time).
        seed: seed of the trainer's generator (for callbacks needing randomness).
        embedding_optimizer: the update of the embedding tables
            (:class:`EmbeddingOptimizerKind`); ``None`` = ``optimizer`` (``adagrad`` is exact
            Adagrad).
        embedding_kernel: :class:`EmbeddingKernel` of the fused lookup and update.
        warmup_steps: linear learning-rate warm-up: step ``k`` (1-based, counted by the
            trainer's ``step``) of the first ``warmup_steps`` runs at ``k / warmup_steps`` of
            each learning rate, dense part and tables alike (MLPerf DLRM's reference
            ``--lr-num-warmup-steps``); 0 = none. Adagrad's first steps move every weight by
            about ``lr`` whatever its gradient (its squared-gradient sum is just that gradient
            squared), which at a full ``lr`` can push all units of a ReLU layer negative at once.
        param_groups: parameters with learning rates of their own (:class:`ParamGroup`); a
            parameter goes to the first group that matches it, the others to ``"embeddings"``
            / ``"dense"``.
        table_dtype: the storage dtype of the trained tables' weights
            (:class:`~hps.rowformat.RowDtype` ``fp32``, ``fp16`` or ``bf16``): half-size
            tables hold half the bytes per row; lookups return float32 and the row update is
            computed in float32, then rounded by ``table_rounding`` (the optimizer state stays
            float32). A trainer stores its model's tables in this dtype.
        table_rounding: :class:`TableRounding` of FP16/BF16 rows after each update.

    Raises:
        ValueError: naming the field, for out-of-range values.
    """

    lr: float = 0.05
    embedding_lr: float | None = None
    optimizer: OptimizerKind = OptimizerKind.ADAGRAD
    momentum: float = 0.0
    adagrad_eps: float = 1e-8
    initial_accumulator_value: float = 0.0
    eval_every: int = 0
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    seed: int = 0
    embedding_optimizer: EmbeddingOptimizerKind | None = None
    embedding_kernel: EmbeddingKernel = EmbeddingKernel.AUTO
    warmup_steps: int = 0
    param_groups: tuple[ParamGroup, ...] = ()
    table_dtype: RowDtype = RowDtype.FP32
    table_rounding: TableRounding = TableRounding.STOCHASTIC

    def __post_init__(self) -> None:
        groups = tuple(
            g if isinstance(g, ParamGroup) else ParamGroup(**g)  # from_dict gives mappings
            for g in self.param_groups
        )
        object.__setattr__(self, "param_groups", groups)
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"TrainConfig.param_groups: names must be distinct, got {names}")
        self._enum_field("optimizer", OptimizerKind, self.optimizer)
        if self.embedding_optimizer is not None:
            self._enum_field(
                "embedding_optimizer", EmbeddingOptimizerKind, self.embedding_optimizer
            )
        self._enum_field("embedding_kernel", EmbeddingKernel, self.embedding_kernel)
        self._enum_field("table_dtype", RowDtype, self.table_dtype)
        self._enum_field("table_rounding", TableRounding, self.table_rounding)
        if self.table_dtype not in TRAINABLE_TABLE_DTYPES:
            raise ValueError(
                f"TrainConfig.table_dtype must be one of "
                f"{[d.value for d in TRAINABLE_TABLE_DTYPES]} (a trained table's weight), got "
                f"{self.table_dtype.value!r}; quantize a trained model to store int8/int4 rows"
            )
        for name in ("lr", "adagrad_eps"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"TrainConfig.{name} must be a finite number > 0, got {v!r}")
        if self.embedding_lr is not None and not (
            math.isfinite(self.embedding_lr) and self.embedding_lr > 0
        ):
            raise ValueError(
                f"TrainConfig.embedding_lr must be > 0 or None, got {self.embedding_lr!r}"
            )
        for name in ("momentum", "initial_accumulator_value"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {v!r}")
        for name in ("eval_every", "checkpoint_every", "seed", "warmup_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an integer >= 0, got {v!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("TrainConfig.checkpoint_every > 0 needs checkpoint_dir")

    def _enum_field(self, name: str, kind: type[StrEnum], value: object) -> None:
        try:
            object.__setattr__(self, name, kind(value))  # type: ignore[arg-type]
        except ValueError:
            raise ValueError(
                f"TrainConfig.{name} must be one of {[o.value for o in kind]}, got {value!r}"
            ) from None

    @property
    def embedding_update(self) -> EmbeddingOptimizerKind:
        """The embedding tables' update: ``embedding_optimizer``, or the one named like
        ``optimizer``."""
        if self.embedding_optimizer is not None:
            return self.embedding_optimizer
        return EmbeddingOptimizerKind(self.optimizer.value)

    def lr_scale(self, step: int) -> float:
        """The warm-up factor of 1-based ``step``: ``min(1, step / warmup_steps)``, 1 without
        warm-up."""
        if self.warmup_steps == 0 or step >= self.warmup_steps:
            return 1.0
        return max(step, 1) / self.warmup_steps

    def group_of(self, param_name: str) -> ParamGroup | None:
        """The first of :attr:`param_groups` matching ``param_name``, else ``None``."""
        return next((g for g in self.param_groups if g.matches(param_name)), None)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["param_groups"] = [
            {"name": g.name, "patterns": list(g.patterns), "lr": g.lr} for g in self.param_groups
        ]
        d["optimizer"] = self.optimizer.value
        d["embedding_optimizer"] = self.embedding_optimizer and self.embedding_optimizer.value
        d["embedding_kernel"] = self.embedding_kernel.value
        d["table_dtype"] = self.table_dtype.value
        d["table_rounding"] = self.table_rounding.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config of :meth:`to_dict`'s mapping (a field it lacks, e.g. ``table_dtype`` in
        a checkpoint written before it existed, takes its default)."""
        allowed = {f.name for f in fields(cls)}
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"TrainConfig: unknown field(s) {sorted(unknown)}; allowed {sorted(allowed)}"
            )
        return cls(**d)


def build_optimizer(
    cfg: TrainConfig,
    embedding_params: Sequence[nn.Parameter],
    dense_params: Sequence[nn.Parameter],
    grouped: Mapping[str, Sequence[nn.Parameter]] | None = None,
) -> torch.optim.Optimizer:
    """The trainer's optimizer for ``cfg``: param groups ``"embeddings"`` (``embedding_lr or
    lr``), ``"dense"`` (``lr``) and one per :attr:`TrainConfig.param_groups` entry (its
    ``lr``; ``grouped``: ``{group name: its parameters}``), empty ones left out (a rank of a
    sharded run may hold no table).

    Raises:
        ValueError: when both groups are empty.
    """
    groups: list[dict[str, Any]] = []
    if embedding_params:
        groups.append(
            {
                "params": list(embedding_params),
                "name": "embeddings",
                "lr": cfg.embedding_lr or cfg.lr,
            }
        )
    if dense_params:
        groups.append({"params": list(dense_params), "name": "dense", "lr": cfg.lr})
    grouped = grouped or {}
    for g in cfg.param_groups:
        if grouped.get(g.name):
            groups.append({"params": list(grouped[g.name]), "name": g.name, "lr": g.lr})
    if not groups:
        raise ValueError("Trainer: the model has no trainable parameters")
    if cfg.optimizer == OptimizerKind.ADAGRAD:
        params = [p for g in groups for p in g["params"]]
        return torch.optim.Adagrad(
            groups,
            lr=cfg.lr,
            eps=cfg.adagrad_eps,
            initial_accumulator_value=cfg.initial_accumulator_value,
            # torch's fused kernel: one pass per tensor instead of foreach's five (4x faster
            # on 16 M CPU parameters: 10 ms against 43 ms); the same update up to rounding
            fused=all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
            or None,
        )
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def copy_group_options(dst: torch.optim.Optimizer, src: torch.optim.Optimizer) -> None:
    """Copy the options (lr, ...) of ``src``'s param groups onto ``dst``'s groups of the same
    ``"name"`` (``"embeddings"`` / ``"dense"``, :func:`build_optimizer`). By name, not
    position: a rank that holds no embedding parameter has only the dense group."""
    theirs = {g.get("name"): g for g in src.param_groups}
    for mine in dst.param_groups:
        g = theirs.get(mine.get("name"))
        if g is not None:
            mine.update({k: v for k, v in g.items() if k != "params"})
