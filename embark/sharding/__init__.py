"""Runtime of a sharding plan on ``torch.distributed``: :class:`ShardedEmbeddingCollection`
holds this rank's shards, distributes the keys of each local batch to their owners and
returns pooled embeddings equal to ``nn.EmbeddingBag`` on the full tables."""

from embark.sharding.collection import (
    DistributedInput,
    PendingInput,
    ShardedEmbeddingCollection,
)
from embark.sharding.comm import CommStats
from embark.sharding.hierarchical import NodeGroups
from embark.sharding.routing import Layout, ShardRef

__all__ = [
    "CommStats",
    "DistributedInput",
    "Layout",
    "NodeGroups",
    "PendingInput",
    "ShardRef",
    "ShardedEmbeddingCollection",
]
