"""embark: DLRM training with sharded embeddings (EMBark).

Rooms, lowest first: ``embark.types`` and ``embark.topology`` (the types: tables,
shardings, plans, machines), ``embark.data`` (batches; synthetic, Criteo and tabular data: DataFrame,
Arrow, Parquet, CSV, with feature vocabularies),
``embark.models`` (DLRM, DLRM-DCNv2, workloads), ``embark.training`` (one :class:`Trainer`,
checkpoints, metrics), ``embark.planner`` (where each table goes), ``embark.sharding`` (the
runtime on ``torch.distributed`` and the sharded model), ``embark.quant`` (tables stored as
fp16 … int2 rows, the compression planner), ``embark.interop`` (TorchRec tables, state dicts,
batches, plans and EBC models; torchrec optional). Command lines:
``python -m embark.plan`` and ``torchrun -m embark.sharded_train``.

>>> from embark import SyntheticCTR, TrainConfig, Trainer, build_model, get_workload
>>> w = get_workload("tiny")
>>> data = SyntheticCTR(w, batch_size=64)
>>> trainer = Trainer(build_model(w), TrainConfig(lr=0.05))
>>> trainer.fit(data.batches(2), steps=2, progress=False).steps
2
"""

from typing import TYPE_CHECKING

from embark.lazy import lazy_attributes

if TYPE_CHECKING:
    from embark.cli import MAX_BATCH_SIZE, MAX_SEED, MAX_THREADS
    from embark.data.batch import Batch, local_batch
    from embark.data.criteo import CriteoTSV
    from embark.data.hotness import HotnessError
    from embark.data.jagged import JaggedBatch
    from embark.data.synthetic import Split, SyntheticCTR
    from embark.data.tabular import Preprocessor, TabularSource
    from embark.data.tabular_spec import Categorical, ColumnTransform, Dense, Splits, TabularSpec
    from embark.data.vocabulary import OOVPolicy, Vocabulary
    from embark.models.dlrm import DLRM, build_model
    from embark.models.workloads import PRESETS, Interaction, Workload, get_workload
    from embark.outputs import check_output_dir
    from embark.planner.planner import plan_sharding
    from embark.planner.simulator import simulate
    from embark.quant import (
        EmbeddingQuantConfig,
        RowDtype,
        evaluate_auc,
        model_size,
        plan_compression,
        quantize_embeddings_,
    )
    from embark.sharding.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
    from embark.sharding.model import ShardedDLRM
    from embark.sharding.run import ShardedRunConfig, run_sharded
    from embark.topology import get_topology
    from embark.training.callbacks import Callback, EarlyStopping, KeepBest
    from embark.training.checkpoint import read_state
    from embark.training.config import (
        EmbeddingKernel,
        EmbeddingOptimizerKind,
        OptimizerKind,
        ParamGroup,
        TableRounding,
        TrainConfig,
    )
    from embark.training.epochs import reshuffled
    from embark.training.metrics import MetricMode, Monitor, auc, log_loss
    from embark.training.report import FitReport
    from embark.training.state import TrainState
    from embark.training.trainer import Trainer, TrainingDiverged
    from embark.types import (
        Cluster,
        Combiner,
        CommDtype,
        HotnessPolicy,
        PlanError,
        ShardingPlan,
        ShardingType,
        TableConfig,
        Topology,
    )

# Names are imported on first use, so that a command which needs no torch (the data
# converter) starts without importing it.
_EXPORTS = {
    "Batch": "embark.data.batch",
    "local_batch": "embark.data.batch",
    "CriteoTSV": "embark.data.criteo",
    "JaggedBatch": "embark.data.jagged",
    "Split": "embark.data.synthetic",
    "SyntheticCTR": "embark.data.synthetic",
    "HotnessError": "embark.data.hotness",
    "Preprocessor": "embark.data.tabular",
    "TabularSource": "embark.data.tabular",
    "Categorical": "embark.data.tabular_spec",
    "ColumnTransform": "embark.data.tabular_spec",
    "Dense": "embark.data.tabular_spec",
    "Splits": "embark.data.tabular_spec",
    "TabularSpec": "embark.data.tabular_spec",
    "OOVPolicy": "embark.data.vocabulary",
    "Vocabulary": "embark.data.vocabulary",
    "Interaction": "embark.models.workloads",
    "DLRM": "embark.models.dlrm",
    "EmbeddingQuantConfig": "embark.quant",
    "RowDtype": "embark.quant",
    "evaluate_auc": "embark.quant",
    "model_size": "embark.quant",
    "plan_compression": "embark.quant",
    "quantize_embeddings_": "embark.quant",
    "build_model": "embark.models.dlrm",
    "Workload": "embark.models.workloads",
    "PRESETS": "embark.models.workloads",
    "MAX_BATCH_SIZE": "embark.cli",
    "MAX_SEED": "embark.cli",
    "MAX_THREADS": "embark.cli",
    "check_output_dir": "embark.outputs",
    "read_state": "embark.training.checkpoint",
    "TrainingDiverged": "embark.training.trainer",
    "get_workload": "embark.models.workloads",
    "plan_sharding": "embark.planner.planner",
    "simulate": "embark.planner.simulator",
    "load_sharded_checkpoint": "embark.sharding.checkpoint",
    "save_sharded_checkpoint": "embark.sharding.checkpoint",
    "ShardedDLRM": "embark.sharding.model",
    "ShardedRunConfig": "embark.sharding.run",
    "run_sharded": "embark.sharding.run",
    "get_topology": "embark.topology",
    "Callback": "embark.training.callbacks",
    "EarlyStopping": "embark.training.callbacks",
    "KeepBest": "embark.training.callbacks",
    "reshuffled": "embark.training.epochs",
    "MetricMode": "embark.training.metrics",
    "Monitor": "embark.training.metrics",
    "FitReport": "embark.training.report",
    "EmbeddingKernel": "embark.training.config",
    "EmbeddingOptimizerKind": "embark.training.config",
    "OptimizerKind": "embark.training.config",
    "ParamGroup": "embark.training.config",
    "TableRounding": "embark.training.config",
    "TrainConfig": "embark.training.config",
    "auc": "embark.training.metrics",
    "log_loss": "embark.training.metrics",
    "TrainState": "embark.training.state",
    "Trainer": "embark.training.trainer",
    "Cluster": "embark.types",
    "Combiner": "embark.types",
    "CommDtype": "embark.types",
    "HotnessPolicy": "embark.types",
    "PlanError": "embark.types",
    "ShardingPlan": "embark.types",
    "ShardingType": "embark.types",
    "TableConfig": "embark.types",
    "Topology": "embark.types",
}

__all__ = [
    "DLRM",
    "MAX_BATCH_SIZE",
    "MAX_SEED",
    "MAX_THREADS",
    "PRESETS",
    "Batch",
    "Callback",
    "Categorical",
    "Cluster",
    "ColumnTransform",
    "Combiner",
    "CommDtype",
    "CriteoTSV",
    "Dense",
    "EarlyStopping",
    "EmbeddingKernel",
    "EmbeddingOptimizerKind",
    "EmbeddingQuantConfig",
    "FitReport",
    "HotnessError",
    "HotnessPolicy",
    "Interaction",
    "JaggedBatch",
    "KeepBest",
    "MetricMode",
    "Monitor",
    "OOVPolicy",
    "OptimizerKind",
    "ParamGroup",
    "PlanError",
    "Preprocessor",
    "RowDtype",
    "ShardedDLRM",
    "ShardedRunConfig",
    "ShardingPlan",
    "ShardingType",
    "Split",
    "Splits",
    "SyntheticCTR",
    "TableConfig",
    "TabularSource",
    "TabularSpec",
    "Topology",
    "TableRounding",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "TrainingDiverged",
    "Vocabulary",
    "Workload",
    "auc",
    "build_model",
    "check_output_dir",
    "evaluate_auc",
    "get_topology",
    "get_workload",
    "load_sharded_checkpoint",
    "local_batch",
    "log_loss",
    "model_size",
    "plan_compression",
    "plan_sharding",
    "quantize_embeddings_",
    "read_state",
    "reshuffled",
    "run_sharded",
    "save_sharded_checkpoint",
    "simulate",
]


__getattr__, __dir__ = lazy_attributes(__name__, _EXPORTS, globals())
