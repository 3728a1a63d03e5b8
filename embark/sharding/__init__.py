"""embark.sharding: the runtime of a sharding plan on ``torch.distributed``.

:class:`ShardedEmbeddingCollection` holds this rank's shards, distributes the keys of each
local batch to their owners and returns pooled embeddings equal to ``nn.EmbeddingBag`` on the
full tables; :class:`ShardedDLRM` is the DLRM over it (dense part replicated), trained by the
one :class:`~embark.training.Trainer` with its :class:`ShardedSync` (replicated gradients
summed in :class:`GradBuckets` while backward runs); its checkpoints are the
single-process format, each rank writing its own shards (:func:`save_sharded_checkpoint`) and
any world size or plan reading them back (:func:`load_sharded_checkpoint`), and
:func:`run_sharded` is a whole run (``torchrun -m embark.sharded_train``);
:class:`SparseDistPipeline` overlaps each batch's input distribution with the previous step.
"""

from embark.sharding.checkpoint import (
    from_single_process,
    load_sharded_checkpoint,
    save_sharded_checkpoint,
    to_single_process,
)
from embark.sharding.collection import ShardedEmbeddingCollection
from embark.sharding.comm import CommStats
from embark.sharding.grad_buckets import GradBuckets
from embark.sharding.hierarchical import NodeGroups
from embark.sharding.input import DistributedInput, PendingInput
from embark.sharding.model import ShardedDLRM, ShardedSync
from embark.sharding.pipeline import SparseDistPipeline
from embark.sharding.prefetch import InputPrefetcher
from embark.sharding.routing import Layout, ShardRef
from embark.sharding.run import ShardedRunConfig, ShardedRunResult, run_sharded

__all__ = [
    "CommStats",
    "DistributedInput",
    "GradBuckets",
    "InputPrefetcher",
    "Layout",
    "NodeGroups",
    "PendingInput",
    "ShardRef",
    "ShardedDLRM",
    "ShardedEmbeddingCollection",
    "ShardedRunConfig",
    "ShardedRunResult",
    "ShardedSync",
    "SparseDistPipeline",
    "from_single_process",
    "load_sharded_checkpoint",
    "run_sharded",
    "save_sharded_checkpoint",
    "to_single_process",
]
