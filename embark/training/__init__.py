"""embark.training: one :class:`Trainer` for single-process and sharded training (the
gradient synchronisation injected, :class:`GradientSync`), its run state
(:class:`TrainState`), callbacks (:class:`Callback`, a protocol), versioned checkpoints
(:mod:`embark.training.checkpoint`), evaluation metrics (:func:`auc`, :func:`log_loss`) and
the loop's parts (:class:`FitReport`, :class:`EarlyStopping`, :class:`KeepBest` on a
:class:`Monitor`, :func:`reshuffled` epochs) and the fused sparse update of embedding tables (:class:`EmbeddingUpdates`,
:class:`SparseTableUpdate`, :class:`RowOptimizer`)."""

from embark.training.callbacks import Callback, EarlyStopping, KeepBest, TrainerView
from embark.training.checkpoint import CHECKPOINT_FORMAT_VERSION, read_state
from embark.training.checkpoint.schema import FormatVersionError
from embark.training.config import (
    EmbeddingKernel,
    EmbeddingOptimizerKind,
    OptimizerKind,
    ParamGroup,
    TableRounding,
    TrainConfig,
)
from embark.training.epochs import reshuffled
from embark.training.fused import EmbeddingUpdates, SparseTableUpdate
from embark.training.metrics import MetricMode, Monitor, auc, log_loss
from embark.training.report import FitReport
from embark.training.sparse_rows import RowOptimizer
from embark.training.state import TrainState
from embark.training.sync import GradientSync, LocalSync
from embark.training.trainer import EvalData, Trainer, TrainingDiverged

__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "Callback",
    "EarlyStopping",
    "EmbeddingKernel",
    "EmbeddingOptimizerKind",
    "EmbeddingUpdates",
    "EvalData",
    "FitReport",
    "FormatVersionError",
    "KeepBest",
    "GradientSync",
    "LocalSync",
    "MetricMode",
    "Monitor",
    "OptimizerKind",
    "ParamGroup",
    "RowOptimizer",
    "SparseTableUpdate",
    "TableRounding",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainerView",
    "TrainingDiverged",
    "auc",
    "log_loss",
    "read_state",
    "reshuffled",
]
