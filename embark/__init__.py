"""embark: DLRM training with sharded embeddings (EMBark).

Rooms, lowest first: ``embark.types`` and ``embark.topology`` (the vocabulary: tables,
shardings, plans, machines), ``embark.data`` (batches, synthetic and Criteo data),
``embark.models`` (DLRM, DLRM-DCNv2, workloads), ``embark.training`` (one :class:`Trainer`,
checkpoints, metrics), ``embark.planner`` (where each table goes), ``embark.sharding`` (the
runtime on ``torch.distributed`` and the sharded model), ``embark.interop`` (TorchRec tables,
state dicts, batches, plans and EBC models; torchrec optional). Command lines:
``python -m embark.plan`` and ``torchrun -m embark.sharded_train``.

>>> from embark import SyntheticCTR, TrainConfig, Trainer, build_model, get_workload
>>> w = get_workload("tiny")
>>> data = SyntheticCTR(w, batch_size=64)
>>> trainer = Trainer(build_model(w), TrainConfig(lr=0.05))
>>> trainer.fit(data.batches(2), steps=2, progress=False)["steps"]
2
"""

from embark.data.batch import Batch, local_batch
from embark.data.criteo import CriteoTSV
from embark.data.jagged import JaggedBatch
from embark.data.synthetic import SyntheticCTR
from embark.models.dlrm import DLRM, build_model
from embark.models.workloads import Workload, get_workload
from embark.planner.planner import plan_sharding
from embark.planner.simulator import simulate
from embark.sharding.checkpoint import load_sharded_checkpoint, save_sharded_checkpoint
from embark.sharding.model import ShardedDLRM
from embark.sharding.run import ShardedRunConfig, run_sharded
from embark.topology import get_topology
from embark.training.callbacks import Callback
from embark.training.config import (
    EmbeddingKernel,
    EmbeddingOptimizerKind,
    OptimizerKind,
    TrainConfig,
)
from embark.training.metrics import auc, log_loss
from embark.training.state import TrainState
from embark.training.trainer import Trainer
from embark.types import (
    Cluster,
    Combiner,
    CommDtype,
    PlanError,
    ShardingPlan,
    ShardingType,
    TableConfig,
    Topology,
)

__all__ = [
    "DLRM",
    "Batch",
    "Callback",
    "Cluster",
    "Combiner",
    "CommDtype",
    "CriteoTSV",
    "EmbeddingKernel",
    "EmbeddingOptimizerKind",
    "JaggedBatch",
    "OptimizerKind",
    "PlanError",
    "ShardedDLRM",
    "ShardedRunConfig",
    "ShardingPlan",
    "ShardingType",
    "SyntheticCTR",
    "TableConfig",
    "Topology",
    "TrainConfig",
    "TrainState",
    "Trainer",
    "Workload",
    "auc",
    "build_model",
    "get_topology",
    "get_workload",
    "load_sharded_checkpoint",
    "local_batch",
    "log_loss",
    "plan_sharding",
    "run_sharded",
    "save_sharded_checkpoint",
    "simulate",
]
